"""``server.control_port``: the control routes on a port of their own, absent from the API port,
so a NetworkPolicy can limit who reaches them (k8s/base/networkpolicy.yaml). Real uvicorn servers
on loopback over FakeEngine (a fake implementing tide/engine/base.py's Engine, no model)."""
from __future__ import annotations

import threading

import httpx
import pytest
from fake_engine import TOKEN, FakeEngine

from tide.config import EngineConfig, ServerConfig
from tide.engine.server import build_app, serve
from tide.process import free_port

AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_control_routes_live_only_on_the_control_port():
    engine, cfg = FakeEngine(), ServerConfig(control_token=TOKEN)
    api_port, control_port = free_port(), free_port()
    api = build_app(engine, cfg, EngineConfig(), surface="api")
    control = build_app(engine, cfg, EngineConfig(), surface="control")
    stop = threading.Event()
    thread = threading.Thread(target=serve, args=(api, "127.0.0.1", api_port, stop, 1.0),
                              kwargs={"also": ((control, control_port),)}, daemon=True)
    thread.start()
    try:
        api_url, control_url = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{control_port}"
        for _ in range(200):  # both servers up
            try:
                httpx.get(f"{api_url}/health", timeout=1)
                httpx.post(f"{control_url}/control/ping", headers=AUTH, timeout=1)
                break
            except httpx.TransportError:
                stop.wait(0.05)
        assert httpx.get(f"{api_url}/health").status_code == 200
        assert httpx.get(f"{api_url}/v1/models").status_code == 200
        # even with the token: the API port has no control routes
        assert httpx.post(f"{api_url}/control/ping", headers=AUTH).status_code == 404
        assert httpx.get(f"{api_url}/control/health", headers=AUTH).status_code == 404
        assert httpx.post(f"{control_url}/control/ping", headers=AUTH).json()["ok"] is True
        assert httpx.post(f"{control_url}/control/ping").status_code == 401
        assert httpx.get(f"{control_url}/v1/models").status_code == 404
        assert httpx.post(f"{control_url}/v1/completions", json={"prompt": "x"}).status_code == 404
        # what `tide drafters --engine` reads besides /control: one URL does
        assert httpx.get(f"{control_url}/metrics").status_code == 200
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    engine.close()


def test_one_port_serves_both_and_a_bad_surface_is_refused():
    engine = FakeEngine()
    with pytest.raises(ValueError, match="surface"):
        build_app(engine, ServerConfig(), EngineConfig(), surface="public")
    paths = {r.path for r in build_app(engine, ServerConfig(), EngineConfig()).routes}
    assert {"/v1/completions", "/health", "/control/ping", "/control/health"} <= paths
    engine.close()
