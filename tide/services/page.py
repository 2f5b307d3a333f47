"""The page a user watches during ``tide up`` / ``tide demo``: one local HTML page of the loop.

Panels: acceptance length by drafter version over time (swaps and the workload shift marked), new
samples against the retrain threshold, retrain state and history, registry versions and aliases,
the fleet (each engine replica x the version it serves, when it converged, why not), capture drops
and ingest lag (``tide/services/page_data.py`` says where each comes from). Every request queries
the sources afresh, server-side; the page refreshes itself. Routes: ``/`` (the page;
``?minutes=N`` sets the chart's window) and ``/health``.

Run: ``python -m tide.services.page --config <home>/run/tide.yaml --prometheus URL --scheduler URL``
(``tide up`` starts it with these).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from tide import service
from tide.health_server import SmallHandler
from tide.services import page_data, page_html

log = logging.getLogger("tide.services.page")
REFRESH_S = 10
DEFAULT_WINDOW_MIN = 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tide.services.page",
                                     description="TIDE page: the loop on one local HTML page")
    parser.add_argument("--config", help="YAML config file (the registry and the scheduler's state file)")
    parser.add_argument("--prometheus", default="", help="the stack's Prometheus base URL (none: panels say so)")
    parser.add_argument("--scheduler", default="", help="the scheduler's base URL (its /health)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8090)
    parser.add_argument("--log-level", default="INFO")
    return parser.parse_args(argv)


def sources_from(cfg, prometheus_url: str, scheduler_url: str) -> page_data.Sources:
    from tide.schedule.scheduler import default_state_path

    # a down MLflow must cost the page seconds, not the client's minutes of retries
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")

    registry = None

    def open_registry():
        nonlocal registry  # one client for the process: mlflow's import and setup are slow
        if registry is None:
            from tide.registry import Registry
            registry = Registry.from_config(cfg)
        return registry

    fleet = None
    if cfg.ops.alias_owner_url:
        from tide.ops.alias_api import AliasClient
        from tide.ops.aliases import owner_token

        fleet = AliasClient(cfg.ops.alias_owner_url, owner_token(cfg), timeout_s=5.0).fleet
    return page_data.Sources(prometheus_url.rstrip("/"), scheduler_url.rstrip("/"), cfg.home_path,
                             open_registry, default_state_path(cfg), fleet)


def handler_for(sources: page_data.Sources) -> type[BaseHTTPRequestHandler]:
    class Handler(SmallHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            url = urllib.parse.urlsplit(self.path)
            if url.path == "/health":
                self._send(200, "application/json", b'{"status": "ok"}')
            elif url.path == "/":
                window_s = 60 * _minutes(urllib.parse.parse_qs(url.query))
                html = page_html.render(page_data.gather(sources, window_s), REFRESH_S, window_s)
                self._send(200, "text/html; charset=utf-8", html.encode())
            else:
                self._send(404, "text/plain", b"not found\n")

    return Handler


def _minutes(query: dict[str, list[str]]) -> float:
    try:
        return min(max(float(query.get("minutes", [DEFAULT_WINDOW_MIN])[0]), 1.0), 7 * 24 * 60)
    except ValueError:
        return DEFAULT_WINDOW_MIN


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = service.start("page", args.config, None, args.log_level, stop_note="stopping the page")
    if started is None:
        return 2
    cfg, stop = started
    server = ThreadingHTTPServer((args.host, args.port), handler_for(sources_from(cfg, args.prometheus,
                                                                                 args.scheduler)))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="page-http", daemon=True)
    thread.start()
    log.info("page on http://%s:%d/ (prometheus %s, scheduler %s)", args.host, server.server_address[1],
             args.prometheus or "none", args.scheduler or "none")
    try:
        stop.wait()
    finally:
        server.shutdown()
        server.server_close()
        log.info("page closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
