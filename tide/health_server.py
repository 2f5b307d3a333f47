"""A small HTTP server for the scheduler and ingest: ``/metrics`` (Prometheus) and ``/health`` (JSON).

Stdlib ``ThreadingHTTPServer`` on a daemon thread: these services need two read-only routes, not a
web framework. ``/health`` answers 200 while the health callable says healthy, else 503, with the
callable's details as the body either way.
"""
from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest

log = logging.getLogger(__name__)

HealthFn = Callable[[], tuple[bool, dict]]


class HealthServer:
    def __init__(self, host: str, port: int, health: HealthFn) -> None:
        handler = _handler_for(health)
        self._server = ThreadingHTTPServer((host, port), handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="health-http",
                                        daemon=True)

    def start(self) -> "HealthServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class SmallHandler(BaseHTTPRequestHandler):
    """Base of TIDE's stdlib handlers: a whole body with its length, requests logged at DEBUG only
    (scrapes and page refreshes would flood the log)."""

    def _send(self, code: int, content_type: str, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, fmt: str, *args: object) -> None:
        log.debug("http: " + fmt, *args)


def _handler_for(health: HealthFn) -> type[BaseHTTPRequestHandler]:
    class Handler(SmallHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(REGISTRY))
            elif path == "/health":
                try:
                    ok, details = health()
                except Exception as exc:  # noqa: BLE001 - health must answer, not crash
                    ok, details = False, {"error": f"{type(exc).__name__}: {exc}"}
                body = json.dumps({"status": "ok" if ok else "unhealthy", **details},
                                  default=str).encode()
                self._send(200 if ok else 503, "application/json", body)
            else:
                self._send(404, "text/plain", b"not found\n")

    return Handler
