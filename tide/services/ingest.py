"""Ingest service: consumes captured hidden states from Kafka into the dataset's Delta table.

Steps: load config (YAML via --config, then TIDE_* environment) → log it → serve /metrics and
/health (200 once joined and polling) →
open the ingestor (create the table if missing, create topics, join the group; retried while the
broker or the store is unreachable) → consume until SIGTERM/SIGINT → commit open batches, leave
the group. Several replicas in one consumer group share the topic's partitions and the table.
"""
from __future__ import annotations

import argparse
import logging
import sys

from tide import service

log = logging.getLogger("tide.services.ingest")


FLAGS = (service.Flag("--bootstrap-servers", "kafka.bootstrap_servers"),
         service.Flag("--data-dir", "ingest.data_dir"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return service.parse_args("python -m tide.services.ingest", "TIDE ingest: Kafka → Delta table dataset", FLAGS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = service.start("ingest", args.config, service.flag_overrides(args, FLAGS), args.log_level)
    if started is None:
        return 2
    cfg, stop = started

    from tide.dataset.bulk import tune_process
    from tide.dataset.ingest import Ingestor
    from tide.dataset.location import Location
    from tide.health_server import HealthServer

    icfg = cfg.ingest
    tune_process(icfg)  # before any Kafka client exists
    location = Location.from_config(cfg)
    data_dir = location.describe()
    ingestor = Ingestor(icfg, cfg.kafka, location)
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
