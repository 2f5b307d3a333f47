"""Scheduler service: launches a retrain when enough new data has arrived (APScheduler interval).

Steps: load config (YAML via --config, then TIDE_* environment) → log it → open the dataset table
and the state file → build the launcher (local process or Kubernetes Job) → serve /metrics and
/health, with the alias owner's API beside them (tide/ops/alias_api.py: the one writer of drafter
aliases) → tick every ``schedule.interval_s`` (and maintain the dataset every
``ingest.retention_interval_s``: retention DELETE + VACUUM, compaction) until SIGTERM/SIGINT →
stop scheduling (a tick in progress finishes) → close.

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
import threading

from tide import service

log = logging.getLogger("tide.services.scheduler")


FLAGS = (service.Flag("--data-dir", "ingest.data_dir", note="the dataset table to count and maintain"),)


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

    from tide.dataset.location import Location
    from tide.dataset.retention import maintain
    from tide.dataset.table import DatasetTable
    from tide.ops.alias_api import AliasApiServer, PromotionCatchUp
    from tide.ops.aliases import AliasOwner, default_lock_path, owner_token
    from tide.registry import Registry
    from tide.schedule import RetrainScheduler, StateStore, build_launcher, default_state_path

    scfg = cfg.schedule
    table = DatasetTable(Location.from_config(cfg))
    data_dir = table.uri
    state_path = default_state_path(cfg)
    try:
        launcher = build_launcher(cfg, args.config, state_path)
    except (ValueError, ImportError) as exc:
        log.error("bad configuration: %s", exc)
        return 2
    logging.getLogger("apscheduler").setLevel(logging.WARNING)  # one INFO line per tick otherwise
    try:
        scheduler = RetrainScheduler(scfg, table, StateStore(state_path), launcher,
                                     maintenance=lambda: maintain(DatasetTable(table.location), cfg.ingest),
                                     maintenance_interval_s=cfg.ingest.retention_interval_s)
    except ValueError as exc:
        log.error("bad configuration: %s", exc)
        return 2
    server = None
    try:
        if scfg.metrics_port:
            server = AliasApiServer(scfg.metrics_host, scfg.metrics_port, scheduler.health,
                                    lambda: AliasOwner(Registry.from_config(cfg), default_lock_path(cfg)),
                                    owner_token(cfg)).start()
        scheduler.start()
        if cfg.ops.auto_promote:  # a retrain that finished while this owner was down is promoted now
            owner = server.owner if server is not None else \
                (lambda: AliasOwner(Registry.from_config(cfg), default_lock_path(cfg)))
            catch_up = PromotionCatchUp(owner, cfg.ops.auto_promote_margin,
                                        lambda: _last_registered(StateStore(state_path)), scfg.interval_s)
            threading.Thread(target=catch_up.run, args=(stop,), name="promotion-catch-up", daemon=True).start()
        log.info("scheduling retrains: every %gs, >= %d new %s in %s, %s launcher, state %s",
                 scfg.interval_s, scfg.min_new_samples, scfg.sample_unit, data_dir,
                 launcher.kind, state_path)
        stop.wait()
    finally:
        scheduler.stop(cancel_running=scfg.cancel_on_stop)
        if server is not None:
            server.close()
        log.info("scheduler closed")
    return 0


def _last_registered(store) -> str | None:
    """The job id of the last successful retrain, when it registered a version."""
    last = store.load().last_success
    return last.job_id if last is not None and last.version is not None else None


if __name__ == "__main__":
    sys.exit(main())
