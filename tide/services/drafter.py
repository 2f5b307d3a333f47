"""Drafter service: one drafter process drafting for several target engines (StarSD).

Steps: load config (YAML via --config, then TIDE_* environment) → log it → load the target's
embeddings (the drafter's input table; the target's layers are never loaded) and the configured
drafter (``drafter.path``) → listen on the network transport (``drafter_service.host``/``port``,
ZeroMQ) and the one-host transport (``drafter_service.ipc_path``: shared memory) → serve /metrics
and /health → follow the registry's ``champion`` once for every engine it serves
(``ops.follow_registry``: the engine follower's swap watcher over this process's drafter; each
version checked as an engine checks it, less the smoke decode, which needs the target: a smoke
draft instead) with one collapse guard per engine, judged on the acceptance that engine reports
with its requests; a collapse swaps the previous drafter back for all and is reported to the alias
owner once → draft until SIGTERM/SIGINT. Engines point ``spec.drafter_service`` here.
"""
from __future__ import annotations

import argparse
import logging
import sys
import threading
from pathlib import Path

from tide import service

log = logging.getLogger("tide.services.drafter")

FLAGS = (service.Flag("--host", "drafter_service.host"), service.Flag("--port", "drafter_service.port", int),
         service.Flag("--ipc-path", "drafter_service.ipc_path", note='"-": none'),
         service.Flag("--metrics-port", "drafter_service.metrics_port", int))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return service.parse_args("python -m tide.services.drafter", "TIDE drafter service: drafts for many engines",
                              FLAGS, argv)


def endpoints(cfg) -> tuple[str | None, str | None]:
    """(network URL, one-host URL) the service listens on, from ``drafter_service``."""
    dcfg = cfg.drafter_service
    tcp = f"tcp://{dcfg.host}:{dcfg.port}" if dcfg.port else None
    path = dcfg.ipc_path or str(cfg.home_path / "run" / "drafter.sock")
    if dcfg.ipc_path != "-":
        Path(path).parent.mkdir(parents=True, exist_ok=True)
    return tcp, None if dcfg.ipc_path == "-" else f"ipc://{path}"


def build_server(cfg):
    """The drafter, its host and the serving loop over the configured sockets."""
    from tide.drafter.artifact import TargetSpec, load_drafter, read_metadata
    from tide.drafter.static import static_drafter_path
    from tide.drafter.vocab import mapping_digest
    from tide.drafting.server import DrafterHost, DraftServer
    from tide.drafting.transport import ServiceSockets
    from tide.drafting.wire import Limits
    from tide.models.target import load_target_heads

    heads = load_target_heads(cfg)
    spec = TargetSpec(heads.shape.hidden_size, heads.shape.vocab_size, heads.aux_layer_ids, cfg.model.max_seq_len)
    path = static_drafter_path(cfg) if cfg.drafter.path == "static" else Path(cfg.drafter.path)
    drafter = load_drafter(path, spec)
    version = str(read_metadata(path).get("version", path.name))
    host = DrafterHost(drafter, version, spec, heads.embed_weight, mapping_digest(drafter.d2t))
    limits = Limits(heads.shape.vocab_size, 3 * heads.shape.hidden_size, cfg.model.max_seq_len,
                    max_rows=cfg.drafter_service.max_batch_rows, max_depth=cfg.spec.draft_len * 4)
    tcp, ipc = endpoints(cfg)
    sockets = ServiceSockets(tcp, ipc, limits.max_array_bytes)
    dcfg = cfg.drafter_service
    return DraftServer(host, sockets, limits, dcfg.max_sessions, dcfg.session_idle_s, dcfg.max_batch_rows)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = service.start("drafter", args.config, service.flag_overrides(args, FLAGS), args.log_level)
    if started is None:
        return 2
    cfg, stop = started
    import torch

    from tide.health_server import HealthServer

    torch.set_num_threads(cfg.model.torch_threads)
    server = build_server(cfg)
    follower = None
    loop = threading.Thread(target=server.serve, args=(stop,), name="tide-drafter", daemon=True)
    loop.start()
    http = HealthServer(cfg.drafter_service.host, cfg.drafter_service.metrics_port,
                        lambda: (loop.is_alive(), server.health())).start() if cfg.drafter_service.metrics_port else None
    try:
        if cfg.ops.follow_registry:
            from tide.services.drafter_follow import ServiceFollower

            follower = ServiceFollower.from_config(server, cfg)
            follower.start(block=False)  # the loop applies its swaps: it must be running first
        log.info("drafter service %s ready: drafter %s on %s", server.service_id, server.host.drafter_version,
                 ", ".join(server.sockets.endpoints.values()))
        while not stop.wait(1.0):
            if not loop.is_alive():
                log.error("the drafting loop died; exiting")
                return 1
    finally:
        stop.set()
        if follower is not None:
            follower.stop()
        loop.join(timeout=10)
        if http is not None:
            http.close()
        server.sockets.close()
        log.info("drafter service closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
