"""The collapse guard and registry outages: a randomized version rolled back (promoted by hand, while
the registry hangs, with no previous champion), and an engine that serves while the registry is
unreachable and follows it once it is back (ops_stack.py: the stack these run on)."""
from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
import torch
from ops_stack import (
    PROMPTS,
    Stack,
    as_overrides,
    make_config,
    perturbed,
    reference_text,
    register,
)
from prometheus_client import REGISTRY

from tide.config import load_config
from tide.contracts import (
    CHAMPION,
)
from tide.drafter.artifact import save_drafter
from tide.registry import Registry

# --- collapse guard ----------------------------------------------------------------------------

def test_collapse_guard_rolls_back_a_randomized_version_promoted_by_hand(make_stack, tiny, wait):
    s = make_stack(guard_enabled=True, guard_interval_s=0.1, guard_window_forwards=60, guard_floor=1.2,
                   poll_interval_s=0.5)
    collapses = REGISTRY.get_sample_value("tide_ops_rollbacks_total", {"cause": "collapse"}) or 0.0
    # the trained drafter is accepted on this traffic (its live figure settles as rows accrue: bounded)
    s.traffic_until(lambda: s.control("GET", "drafters").json()["live_accept_length"].get("1", 0) > 1.3, 120,
                    what="drafter 1's live acceptance above 1.3")
    bad = perturbed(tiny, 8)
    with torch.no_grad():
        bad.lm_head.weight.normal_()
        bad.fc.weight.normal_()
    v2 = register(s.registry, save_drafter(bad, tiny.root / "randomized"))
    s.registry.promote(v2, actor="cli:mallory", reason="looks fine to me")
    wait(lambda: s.serving() == str(v2), 30, what="the engine to follow the promotion")
    s.traffic_until(lambda: s.serving() == "1", 180, what="the guard to swap the previous drafter back")
    wait(lambda: s.registry.aliases().get(CHAMPION) == 1, 30, what="the registry alias to move back")
    last = s.registry.operations()[-1]
    assert (last["op"], last["actor"], last["from"], last["to"]) == ("rollback", "collapse-guard", v2, 1)
    assert f"drafter {v2}" in last["reason"] and "below floor" in last["reason"]
    assert REGISTRY.get_sample_value("tide_ops_rollbacks_total", {"cause": "collapse"}) == collapses + 1
    assert s.registry.get_version(v2).tags["tide.rolled_back"]
    time.sleep(1.2)  # two more polls: the collapsed version is not taken back
    assert s.serving() == "1"
    texts = [b["choices"][0]["text"] for b in s.traffic()]
    assert sorted(texts) == sorted(reference_text(tiny, p) for p in PROMPTS)


@pytest.fixture(scope="module")
def mlflow_http(tmp_path_factory):
    """A real `mlflow server` (the process `tide up` starts), to be SIGSTOPped by a test."""
    from tide.process import free_port
    from tide.stack import mlflow_server

    root = tmp_path_factory.mktemp("ops-mlflow-http")
    port = free_port()
    svc = mlflow_server(root / "server", port, root / "mlflow.log").start()
    try:
        svc.wait_healthy(300)
        yield svc, f"http://127.0.0.1:{port}", root / "artifacts"
    finally:
        os.killpg(svc.proc.pid, signal.SIGCONT)
        svc.stop()


def randomized(tiny):
    bad = perturbed(tiny, 8)
    with torch.no_grad():
        bad.lm_head.weight.normal_()
        bad.fc.weight.normal_()
    return bad


def test_collapse_guard_rolls_back_on_time_while_the_registry_hangs(tiny, mlflow_http, tmp_path, monkeypatch,
                                                                    wait):
    svc, uri, artifacts = mlflow_http
    # a stopped server accepts connections and never answers: each call hangs until MLflow's
    # client times out; make that outlast the test (the environment wins over the config)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "600")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    cfg = make_config(tiny, (uri, artifacts), tmp_path / "home", f"ops-{uuid.uuid4().hex[:8]}", guard_enabled=True,
                      guard_interval_s=0.1, guard_window_forwards=60, guard_floor=1.2, poll_interval_s=0.3)
    s, registry = Stack(cfg), Registry.from_config(cfg)
    try:
        s.traffic()  # drafter 1's live baseline
        v2 = register(registry, save_drafter(randomized(tiny), tiny.root / "hang-randomized"))
        registry.promote(v2, actor="cli:mallory")
        wait(lambda: s.serving() == str(v2), 30, what="the engine to follow the promotion")
        ops = lambda: s.control("GET", "health").json()["ops"]  # noqa: E731
        os.killpg(svc.proc.pid, signal.SIGSTOP)
        try:
            wait(lambda: (ops()["registry_call_s"] or 0) > 0.5, 30, what="the follower's registry call to hang")
            hung_before_s = ops()["registry_call_s"]
            served = s.traffic_until(lambda: s.serving() == "1", 180,
                                     what="the guard to swap drafter 1 back while MLflow hangs")
            hung = ops()
            # the same registry call is still hanging (its age only grew), and the rollback waits for it
            assert hung["registry_call_s"] > hung_before_s and hung["pending_registry_rollback"] == str(v2), hung
            assert str(v2) in hung["refused"] and "below floor" in hung["refused"][str(v2)]
        finally:
            os.killpg(svc.proc.pid, signal.SIGCONT)
        reference = {p: reference_text(tiny, p) for p in PROMPTS}
        assert served and all(b["choices"][0]["text"] in reference.values() for b in served)  # lossless throughout
        wait(lambda: registry.aliases().get(CHAMPION) == 1, 120, what="the alias to move back once MLflow answers")
        last = registry.operations()[-1]
        assert (last["op"], last["actor"], last["from"], last["to"]) == ("rollback", "collapse-guard", v2, 1)
        wait(lambda: ops()["pending_registry_rollback"] is None, 30, what="the pending rollback to clear")
        assert s.serving() == "1" and ops()["state"] == "following"
    finally:
        s.close()


def test_collapse_with_no_previous_champion_alerts_and_keeps_serving(make_stack, wait):
    # a floor no drafter reaches: the first champion "collapses" but there is nothing to go back
    # to (the drafter configured before the registry was reached does not count)
    s = make_stack(guard_enabled=True, guard_interval_s=0.1, guard_window_forwards=60, guard_floor=5.0)
    # judged only once it serves drafter 1: traffic served by the configured drafter is not its window
    wait(lambda: s.serving() == "1", 60, what="the follower to bootstrap drafter 1")
    s.traffic_until(lambda: REGISTRY.get_sample_value("tide_ops_collapse_alert") == 1, 180, what="the collapse alert")
    assert s.serving() == "1" and s.registry.aliases() == {CHAMPION: 1} and s.registry.operations() == []
    assert s.control("GET", "health").json()["ops"]["refused"] == {}


# --- registry outage, auto-promotion, CLI -----------------------------------------------------------

def test_engine_serves_while_the_registry_is_unreachable_and_follows_once_it_is_back(tiny, store, tmp_path, wait):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("the store's folder cannot be created while this file is here")
    cfg = make_config(tiny, store, tmp_path / "home", f"ops-{uuid.uuid4().hex[:8]}")
    cfg = load_config(env={}, overrides={**as_overrides(cfg), "registry": {
        **as_overrides(cfg)["registry"], "tracking_uri": f"sqlite:///{blocker / 'mlflow.db'}"}})
    s = Stack(cfg)
    try:
        assert s.serving() == "static"
        assert s.complete(PROMPTS[1])["choices"][0]["text"] == reference_text(tiny, PROMPTS[1])
        resp = s.control("GET", "drafters")
        assert resp.status_code == 503 and "registry" in resp.json()["error"]["message"]
        assert s.control("GET", "health").json()["ops"]["registry_connected"] is False
        blocker.unlink()
        wait(lambda: s.serving() == "1", 60, what="the follower to connect, bootstrap and follow")
        assert s.control("GET", "health").json()["ops"]["registry_connected"] is True
    finally:
        s.close()


