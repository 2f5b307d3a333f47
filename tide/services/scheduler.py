"""Scheduler service: launches a retrain when enough new data has arrived (APScheduler interval).

Steps: load config (YAML via --config, then TIDE_* environment) → log it → open the dataset index
and the state file → build the launcher (local process or Kubernetes Job) → serve /metrics and
/health → tick every ``schedule.interval_s`` until SIGTERM/SIGINT → stop scheduling (a tick in
progress finishes) → close.

On shutdown a running retrain is NOT stopped or waited for (unless ``schedule.cancel_on_stop``,
which the local stack sets: it stops MLflow too): a retrain takes minutes to hours,
longer than any termination grace period. A local job runs in its own session and survives; the
state file records its pid and start time, and the next scheduler re-adopts it (polls it, enforces
its deadline, records its outcome) instead of launching another. A Kubernetes Job is re-adopted
the same way by name.
"""
from __future__ import annotations

import argparse
import logging
import sys

from tide import service

log = logging.getLogger("tide.services.scheduler")


FLAGS = (service.Flag("--data-dir", "ingest.data_dir", note="the dataset to count"),)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return service.parse_args("python -m tide.services.scheduler", "TIDE scheduler: launches online retrains",
                              FLAGS, argv, config_help=service.CONFIG_HELP + "; also passed on to the retrain command")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = service.start("scheduler", args.config, service.flag_overrides(args, FLAGS), args.log_level,
                            stop_note="stopping the scheduler")
    if started is None:
        return 2
    cfg, stop = started

    from tide.dataset.index import DatasetIndex
    from tide.health_server import HealthServer
    from tide.schedule import RetrainScheduler, StateStore, build_launcher, default_state_path

    scfg = cfg.schedule
    data_dir = cfg.ingest.data_dir or str(cfg.home_path / "dataset")
    state_path = default_state_path(cfg)
    try:
        launcher = build_launcher(cfg, args.config, state_path)
    except (ValueError, ImportError) as exc:
        log.error("bad configuration: %s", exc)
        return 2
    logging.getLogger("apscheduler").setLevel(logging.WARNING)  # one INFO line per tick otherwise
    index = DatasetIndex(data_dir)
    try:
        scheduler = RetrainScheduler(scfg, index, StateStore(state_path), launcher)
    except ValueError as exc:
        log.error("bad configuration: %s", exc)
        index.close()
        return 2
    server = None
    try:
        if scfg.metrics_port:
            server = HealthServer(scfg.metrics_host, scfg.metrics_port, scheduler.health).start()
        scheduler.start()
        log.info("scheduling retrains: every %gs, >= %d new %s in %s, %s launcher, state %s",
                 scfg.interval_s, scfg.min_new_samples, scfg.sample_unit, data_dir,
                 launcher.kind, state_path)
        stop.wait()
    finally:
        scheduler.stop(cancel_running=scfg.cancel_on_stop)
        if server is not None:
            server.close()
        index.close()
        log.info("scheduler closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
