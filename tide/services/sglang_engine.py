"""Engine service on SGLang (``tide serve --engine sglang --target MODEL_PATH``).

Steps: load config → the drafter the server starts with (the registry's ``champion`` when the
registry answers, else ``drafter.path``) → start SGLang's server with TIDE's plugin
(tide/engine/sglang/server_args.py; its log in <home>/logs/sglang.log) and wait until it answers
``/health`` → ``SGLangEngine`` over its HTTP API → the drafter follower (champion, collapse
guard) unless ``ops.follow_registry`` is off → TIDE's HTTP app on ``server.port`` (the OpenAI
routes proxy to SGLang; /control/*, /health, /metrics as with the reference engine) → serve until
SIGTERM/SIGINT → stop the follower, then the SGLang server. Capture runs inside SGLang (plugin).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from tide import service

log = logging.getLogger("tide.services.sglang_engine")


FLAGS = (service.Flag("--target", "sglang.target", note="HF folder or hub id of the target"),
         service.Flag("--port", "server.port", int, note="TIDE's API and control routes"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return service.parse_args("python -m tide.services.sglang_engine",
                              "TIDE on SGLang: capture and draft-only swaps in an SGLang server", FLAGS, argv)


def starting_drafter(cfg) -> tuple[Path, str]:
    """(folder, version): the champion if the registry answers now, else the configured drafter."""
    from tide.contracts import CHAMPION
    from tide.drafter.artifact import read_metadata
    from tide.drafter.static import static_drafter_path
    from tide.registry import Registry

    if cfg.ops.follow_registry:
        try:
            registry = Registry.from_config(cfg)
            info = registry.get_alias(cfg.ops.follow_alias or CHAMPION)
            if info is not None:
                return registry.download(info.version), str(info.version)
        except Exception as exc:  # noqa: BLE001 - start with the configured drafter; the follower retries
            log.warning("registry unreachable at start (%s); starting with drafter.path", exc)
    path = static_drafter_path(cfg) if cfg.drafter.path == "static" else Path(cfg.drafter.path)
    return path, str(read_metadata(path).get("version", path.name))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = service.start("sglang_engine", args.config, service.flag_overrides(args, FLAGS), args.log_level)
    if started is None:
        return 2
    cfg, stop = started

    from tide.capture.sampling import SamplingPolicy
    from tide.engine.server import build_app, serve
    from tide.engine.sglang.engine import SGLangEngine
    from tide.engine.sglang.server_args import server_command, server_env
    from tide.ops.control_api import control_plane
    from tide.process import ServiceProcess

    folder, version = starting_drafter(cfg)
    sg = cfg.sglang
    config_path = str(Path(args.config).resolve()) if args.config else None
    server = ServiceProcess("sglang", server_command(cfg, sg.target, folder), cfg.home_path / "logs" / "sglang.log",
                            server_env(config_path, version, os.environ), f"http://{sg.host}:{sg.port}/health")
    follower = None
    try:
        server.start().wait_healthy(sg.startup_timeout_s)
        engine = SGLangEngine(f"http://{sg.host}:{sg.port}", folder, version, target_model_id=cfg.model.model_id,
                              max_seq_len=cfg.model.max_seq_len, tokenizer=_tokenizer(sg.target),
                              tp_size=sg.tp_size, timeout_s=sg.request_timeout_s,
                              capture_policy=SamplingPolicy(cfg.capture.sample_fraction,
                                                            dict(cfg.capture.workload_fractions))
                              if cfg.capture.enabled else None,
                              full_capture_fraction=cfg.capture.full_capture_fraction)
        if cfg.ops.follow_registry:
            from tide.ops.follower import DrafterFollower

            follower = DrafterFollower.from_config(engine, cfg)
            follower.start()
        log.info("SGLang engine ready: target=%s drafter=%s", sg.target, json.dumps(version))
        app = build_app(engine, cfg.server, cfg.engine, ops=control_plane(follower) if follower else None)
        serve(app, cfg.server.host, cfg.server.port, stop, grace_s=cfg.server.shutdown_grace_s)
    finally:
        if follower is not None:
            follower.stop()
        server.stop()
        log.info("SGLang engine closed")
    return 0


def _tokenizer(target: str):
    """The target's tokenizer for TIDE's OpenAI routes (chat template, stop strings)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


if __name__ == "__main__":
    sys.exit(main())
