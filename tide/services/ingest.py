"""Ingest service: consumes captured hidden states from Kafka into the Parquet dataset.

Steps: load config (YAML via --config, then TIDE_* environment) → log it → serve /metrics and
/health (200 once joined and polling) →
open the ingestor (clean crash leftovers, reconcile the index, create topics, join the group;
retried while the broker is unreachable) → consume until SIGTERM/SIGINT → seal and commit open
files, leave the group.
"""
from __future__ import annotations

import argparse
import logging
import sys

from tide import service

log = logging.getLogger("tide.services.ingest")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tide.services.ingest",
                                     description="TIDE ingest: Kafka → Parquet dataset")
    parser.add_argument("--config", help="YAML config file (sections as in tide/config.py)")
    parser.add_argument("--bootstrap-servers", help="override kafka.bootstrap_servers")
    parser.add_argument("--data-dir", help="override ingest.data_dir")
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = service.start("ingest", args.config, {"kafka": {"bootstrap_servers": args.bootstrap_servers},
                                                    "ingest": {"data_dir": args.data_dir}}, args.log_level)
    if started is None:
        return 2
    cfg, stop = started

    from tide.dataset.ingest import Ingestor
    from tide.health_server import HealthServer

    icfg = cfg.ingest
    sys.setswitchinterval(icfg.switch_interval_s)
    data_dir = icfg.data_dir or str(cfg.home_path / "dataset")
    ingestor = Ingestor(icfg, cfg.kafka, data_dir)
    http = HealthServer(icfg.metrics_host, icfg.metrics_port, ingestor.health).start() if icfg.metrics_port else None
    try:
        while not stop.is_set():
            try:
                ingestor.open()
                break
            except Exception as exc:  # broker not up yet: keep trying until told to stop
                log.warning("cannot start ingest (%s); retrying in 2 s", exc)
                ingestor.close(flush=False)
                ingestor.last_error = str(exc)
                stop.wait(2.0)
        if not stop.is_set():
            log.info("ingesting %s from %s into %s", cfg.kafka.topic, cfg.kafka.bootstrap_servers, data_dir)
            ingestor.run(stop)
    finally:
        ingestor.close()
        if http is not None:
            http.close()
        log.info("ingest closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
