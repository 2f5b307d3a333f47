"""The alias owner's HTTP API (served by the scheduler) and its client.

``alias_writer`` is what every writer calls: this client when ``ops.alias_owner_url`` is set, else
an ``AliasOwner`` in the calling process on the shared lock file.
The scheduler serves the API on its metrics port beside ``/metrics`` and ``/health`` (``AliasApiServer``),
so every process that moves an alias (engine replicas, retrain Jobs, an operator's CLI) reaches
the one ``AliasOwner`` (tide/ops/aliases.py) through one address, ``ops.alias_owner_url``.
Every route below needs ``Authorization: Bearer <token>`` (``ops.alias_owner_token``, else
``server.control_token``), checked before the body is read; with no token configured every call
is refused, so nothing is written by a caller the owner cannot authenticate.

| route | body | answer |
| --- | --- | --- |
| GET /aliases | | the ledger's head: generation, champion, previous, challenger |
| GET /aliases/operations | | {"operations": [...]}, oldest first |
| POST /aliases/promote | version, actor, reason, expected_generation | an ``AliasResult`` |
| POST /aliases/rollback | actor, reason, expected_generation | an ``AliasResult`` |
| POST /aliases/auto-promote | margin, actor | an ``AliasResult`` with the policy's decision |
| POST /aliases/collapse | version, reason, replica | an ``AliasResult`` |
| POST /fleet/report | a replica record (tide/ops/fleet.py) | {"ok": true} |
| GET /fleet | | the fleet view against the champion |

Errors: 400 bad body, 401 token, 404 unknown version, 409 ``{"error": {"type": "conflict"}}`` (another
operation came first: retry), 503 the registry behind the owner is unreachable.
"""
from __future__ import annotations

import hmac
import json
import logging
import threading
from http.server import ThreadingHTTPServer
from typing import Any, Callable

import httpx

from tide.health_server import HealthFn, _handler_for
from tide.ops.aliases import (
    AliasAuthError,
    AliasConflict,
    AliasError,
    AliasOwner,
    AliasResult,
    AliasUnavailable,
    default_lock_path,
    owner_token,
)
from tide.ops.fleet import Fleet
from tide.registry import Registry, RegistryError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 * 1024


class _BadRequest(ValueError):
    pass


def _int(body: dict, key: str, required: bool = False) -> int | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 2**31:
        raise _BadRequest(f"'{key}' must be a non-negative integer")
    return value


def _text(body: dict, key: str, default: str = "", limit: int = 1000) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or len(value) > limit:
        raise _BadRequest(f"'{key}' must be a string of at most {limit} characters")
    return value


def _routes(owner: AliasOwner, fleet: Fleet) -> dict[tuple[str, str], Callable[[dict], Any]]:
    def view(_: dict) -> dict:
        state = owner.state()
        return fleet.view(state["champion"], state["generation"])

    def report(body: dict) -> dict:
        _text(body, "replica", limit=200)
        fleet.report(body)
        return {"ok": True}

    return {
        ("GET", "/aliases"): lambda _: owner.state(),
        ("GET", "/aliases/operations"): lambda _: {"operations": owner.operations()},
        ("GET", "/fleet"): view,
        ("POST", "/fleet/report"): report,
        ("POST", "/aliases/promote"): lambda b: owner.promote(
            _int(b, "version", True), _text(b, "actor", "api", 200), _text(b, "reason"),
            _int(b, "expected_generation")).to_dict(),
        ("POST", "/aliases/rollback"): lambda b: owner.rollback(
            _text(b, "actor", "api", 200), _text(b, "reason"), _int(b, "expected_generation")).to_dict(),
        ("POST", "/aliases/auto-promote"): lambda b: owner.auto_promote(
            float(b.get("margin", 0.05)), _text(b, "actor", "auto-promotion", 200)).to_dict(),
        ("POST", "/aliases/collapse"): lambda b: owner.report_collapse(
            _int(b, "version", True), _text(b, "reason"), _text(b, "replica", limit=200)).to_dict(),
    }


def _error(status: int, kind: str, message: str) -> tuple[int, dict]:
    return status, {"error": {"type": kind, "message": message}}


def _answer(route: Callable[[dict], Any], body: dict) -> tuple[int, Any]:
    try:
        return 200, route(body)
    except (ValueError, TypeError) as exc:  # _BadRequest, or a margin that is no number
        return _error(400, "invalid_request", str(exc))
    except AliasConflict as exc:
        return _error(409, "conflict", str(exc))
    except RegistryError as exc:
        return _error(404 if "has no version" in str(exc) else 503, "registry", str(exc))
    except Exception:  # noqa: BLE001 - the caller learns it failed; the text goes to the log
        log.exception("alias owner: request failed")
        return _error(500, "internal", "internal error; details are in the scheduler's log")


class AliasApiServer:
    """``/metrics``, ``/health`` and the alias owner's routes on one port (stdlib, daemon thread).
    ``owner`` is built on first use (the registry may be down when the scheduler starts)."""

    def __init__(self, host: str, port: int, health: HealthFn, owner: Callable[[], AliasOwner], token: str,
                 fleet: Fleet | None = None) -> None:
        self.fleet = fleet or Fleet()
        self._owner, self._built, self._build_lock = owner, None, threading.Lock()
        self._server = ThreadingHTTPServer((host, port), self._handler(_handler_for(health), token))
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="alias-api", daemon=True)

    def owner(self) -> AliasOwner:
        with self._build_lock:
            if self._built is None:
                self._built = self._owner()
            return self._built

    def _dispatch(self, method: str, path: str, body: dict) -> tuple[int, Any]:
        if (method, path) not in _ROUTE_KEYS:
            return _error(404, "not_found", f"no route {method} {path}")
        try:
            owner = self.owner()
        except RegistryError as exc:
            return _error(503, "registry", str(exc))
        return _answer(_routes(owner, self.fleet)[(method, path)], body)

    def _handler(self, base: type, token: str) -> type:
        server = self

        class Handler(base):
            def _json(self, status: int, body: Any) -> None:
                self._send(status, "application/json", json.dumps(body, default=str).encode())

            def _authorised(self) -> bool:
                given = self.headers.get("Authorization", "")
                if token and hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                    return True
                why = "wrong or missing token" if token else \
                    "no token configured (ops.alias_owner_token or server.control_token): every call is refused"
                self._json(*_error(401, "authentication_error", f"alias owner: {why}"))
                return False

            def _serve(self, method: str) -> None:
                path = self.path.split("?", 1)[0]
                if not self._authorised():
                    return
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    self._json(*_error(413, "invalid_request", f"body over {MAX_BODY_BYTES} bytes"))
                    return
                try:
                    body = json.loads(self.rfile.read(length) or b"{}") if method == "POST" else {}
                    if not isinstance(body, dict):
                        raise ValueError("the body must be a JSON object")
                except ValueError as exc:
                    self._json(*_error(400, "invalid_request", f"bad JSON body: {exc}"))
                    return
                self._json(*server._dispatch(method, path, body))

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                if self.path.split("?", 1)[0] in ("/metrics", "/health"):
                    super().do_GET()
                else:
                    self._serve("GET")

            def do_POST(self) -> None:  # noqa: N802
                self._serve("POST")

        return Handler

    def start(self) -> "AliasApiServer":
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


_ROUTE_KEYS = (("GET", "/aliases"), ("GET", "/aliases/operations"), ("GET", "/fleet"), ("POST", "/fleet/report"),
               ("POST", "/aliases/promote"), ("POST", "/aliases/rollback"), ("POST", "/aliases/auto-promote"),
               ("POST", "/aliases/collapse"))


class AliasClient:
    """The owner's API with ``AliasOwner``'s methods: what engines, Jobs and the CLI call."""

    def __init__(self, url: str, token: str, timeout_s: float = 60.0) -> None:
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout_s = timeout_s

    def _call(self, method: str, path: str, body: dict | None = None) -> Any:
        try:
            resp = httpx.request(method, self.url + path, json=body, headers=self.headers, timeout=self.timeout_s)
        except httpx.TransportError as exc:
            raise AliasUnavailable(f"alias owner at {self.url} did not answer ({type(exc).__name__}: {exc}); "
                                   "whether it applied the operation is in `tide drafters history`") from exc
        try:
            payload = resp.json()
        except ValueError:
            payload = {}
        message = (payload.get("error") or {}).get("message") or resp.text[:300]
        if resp.status_code == 200:
            return payload
        if resp.status_code == 401:
            raise AliasAuthError(f"alias owner at {self.url} refused the token (401: {message}); nothing was changed")
        if resp.status_code == 409:
            raise AliasConflict(message)
        if resp.status_code == 404 and "has no version" in message:
            raise RegistryError(message)
        if resp.status_code == 503:
            raise AliasUnavailable(f"alias owner at {self.url}: {message}")
        raise AliasError(f"alias owner at {self.url}: {method} {path} answered {resp.status_code}: {message}")

    def state(self) -> dict:
        return self._call("GET", "/aliases")

    def operations(self) -> list[dict]:
        return self._call("GET", "/aliases/operations")["operations"]

    def fleet(self) -> dict:
        return self._call("GET", "/fleet")

    def report_replica(self, record: dict) -> None:
        self._call("POST", "/fleet/report", record)

    def promote(self, version: int, actor: str, reason: str = "", expected_generation: int | None = None) -> AliasResult:
        return AliasResult.from_dict(self._call("POST", "/aliases/promote", {
            "version": version, "actor": actor, "reason": reason, "expected_generation": expected_generation}))

    def rollback(self, actor: str, reason: str = "", expected_generation: int | None = None) -> AliasResult:
        return AliasResult.from_dict(self._call("POST", "/aliases/rollback", {
            "actor": actor, "reason": reason, "expected_generation": expected_generation}))

    def auto_promote(self, margin: float, actor: str = "auto-promotion") -> AliasResult:
        return AliasResult.from_dict(self._call("POST", "/aliases/auto-promote", {"margin": margin, "actor": actor}))

    def report_collapse(self, version: int, reason: str, replica: str = "") -> AliasResult:
        return AliasResult.from_dict(self._call("POST", "/aliases/collapse", {
            "version": version, "reason": reason[:1000], "replica": replica}))


def alias_writer(cfg, registry: Registry | None = None, token: str | None = None):
    """The owner's HTTP client when ``ops.alias_owner_url`` is set, else an ``AliasOwner`` here on
    the shared lock file (``registry`` built from ``cfg`` when not given). ``cfg``: the whole TideConfig."""
    if cfg.ops.alias_owner_url:
        return AliasClient(cfg.ops.alias_owner_url, owner_token(cfg) if token is None else token)
    return AliasOwner(registry or Registry.from_config(cfg), default_lock_path(cfg))


class PromotionCatchUp:
    """The owner's side of auto-promotion: a retrain that finished while the owner (the scheduler
    hosting it) or the registry was down could not have its challenger promoted, and the job does
    not ask twice. Every ``interval_s`` the owner looks at the last successful retrain
    (``last_success``: its job id, None when it registered nothing) and runs the policy once for
    each new one, asking again while the registry does not answer. The policy decides on the
    aliases as they are then, so a promotion the job did get done is not repeated (its challenger
    is champion, or no challenger is left)."""

    def __init__(self, owner: Callable[[], AliasOwner], margin: float, last_success: Callable[[], str | None],
                 interval_s: float) -> None:
        self._owner, self._margin, self._last_success, self._interval_s = owner, margin, last_success, interval_s
        self._done: str | None = None  # this process has not asked yet: a restart asks for the last one again
        self._failing = ""

    def run(self, stop: threading.Event) -> None:
        """Until ``stop``; meant for a daemon thread."""
        while not stop.wait(self._interval_s):
            self.step()

    def step(self) -> None:
        job = None
        try:
            job = self._last_success()
            if job is None or job == self._done:
                return
            result = self._owner().auto_promote(self._margin)
        except Exception as exc:  # noqa: BLE001 - RegistryError, a hung MLflow: asked again next interval
            if str(exc) != self._failing:  # once per distinct failure
                log.warning("auto-promotion catch-up (last successful retrain %s): %s; asking again", job, exc)
            self._failing = str(exc)
            return
        self._done, self._failing = job, ""
        log.info("auto-promotion catch-up (last successful retrain %s): %s", job,
                 result.detail if result.applied else f"not promoting: {result.detail}")


def auto_promote_after_retrain(registry: Registry, cfg) -> dict:
    """The retrain's auto-promotion call: asks the alias owner to apply the policy now; never
    raises (the registered version stands either way)."""
    if not cfg.ops.auto_promote:
        return {"promote": False, "reason": "auto-promotion is off (ops.auto_promote)"}
    try:
        result = alias_writer(cfg, registry).auto_promote(cfg.ops.auto_promote_margin)
    except (AliasError, RegistryError) as exc:
        log.error("auto-promotion failed: %s", exc)
        return {"promote": False, "reason": f"auto-promotion failed: {type(exc).__name__}: {exc}"}
    log.info("auto-promotion: %s", result.detail if result.applied else f"not promoting: {result.detail}")
    return {**(result.decision or {}), "applied": result.applied, "generation": result.state.get("generation")}
