"""Engine service: the reference engine behind the OpenAI-compatible HTTP API.

Steps: load config (YAML via --config, then TIDE_* environment) → log it → build the engine →
start the drafter follower (registry champion, collapse guard; tide/ops/follower.py) unless
``ops.follow_registry`` is off → build the app (with the control API) → serve until
SIGTERM/SIGINT → drain HTTP, stop the follower, close the engine.
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading

from tide import service

log = logging.getLogger("tide.services.engine")


FLAGS = (service.Flag("--host", "server.host"), service.Flag("--port", "server.port", int),
         service.Flag("--bootstrap-servers", "kafka.bootstrap_servers", note="capture's broker"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return service.parse_args("python -m tide.services.engine", "TIDE engine: speculative decoding over HTTP",
                              FLAGS, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = service.start("engine", args.config, service.flag_overrides(args, FLAGS), args.log_level)
    if started is None:
        return 2
    cfg, stop = started

    # imported here so --help and config errors answer without loading torch and the model
    from tide.engine.reference import build_engine
    from tide.engine.server import build_app, serve
    from tide.ops.control_api import control_plane

    engine = build_engine(cfg)
    failed = threading.Thread(target=_stop_when_failed, args=(engine, stop), name="tide-engine-failure", daemon=True)
    failed.start()
    tap = None
    if cfg.capture.enabled:
        from tide.capture.tap import CaptureTap

        tap = CaptureTap(cfg.capture, cfg.kafka)
        engine.set_capture_sink(tap)
    follower = None
    try:
        if cfg.ops.follow_registry and engine.drafter is not None:
            from tide.ops.follower import DrafterFollower

            follower = DrafterFollower.from_config(engine, cfg)
            follower.start()  # never raises for registry trouble: the engine serves what it has
        log.info("engine ready: target=%s drafter=%s max_seq_len=%d",
                 engine.target_model_id, engine.drafter_version, engine.max_seq_len)
        ops = control_plane(follower) if follower else None
        split = bool(cfg.server.control_port)  # /control on a port of its own
        app = build_app(engine, cfg.server, cfg.engine, ops=ops, surface="api" if split else "all")
        also = ((build_app(engine, cfg.server, cfg.engine, ops=ops, surface="control"), cfg.server.control_port),) \
            if split else ()
        serve(app, cfg.server.host, cfg.server.port, stop, grace_s=cfg.server.shutdown_grace_s, also=also)
    finally:
        if follower is not None:
            follower.stop()
        engine.close()
        if tap is not None:
            tap.close(cfg.capture.flush_timeout_s)
        log.info("engine closed")
    if engine.failure is not None:  # non-zero: a supervisor (Kubernetes, systemd) restarts the process
        log.error("engine exited after a failure: %s", engine.failure)
        return 1
    return 0


def _stop_when_failed(engine, stop: threading.Event, poll_s: float = 0.5) -> None:
    """A dead decode loop ends the service: /health answers 503 meanwhile, then the process exits 1."""
    while not stop.wait(poll_s):
        if engine.failure is not None:
            log.error("engine failed (%s); shutting down", engine.failure)
            stop.set()


if __name__ == "__main__":
    sys.exit(main())
