"""Drafter operations through the engine's control API: the token, promote and rollback served
losslessly, bad versions refused while the champion serves, the auto-promotion policy against the
registry (ops_stack.py: the stack these run on)."""
from __future__ import annotations

import time

import pytest
import torch
from ops_stack import (
    PROMPTS,
    as_overrides,
    bad_version,
    perturbed,
    reference_text,
    register,
)
from prometheus_client import REGISTRY

from tide.config import load_config
from tide.contracts import (
    CHAMPION,
    PREVIOUS_CHAMPION,
    TAG_PARENT_SIM_ACCEPT,
    TAG_SIM_ACCEPT,
)
from tide.drafter.artifact import load_drafter, save_drafter
from tide.ops.alias_api import auto_promote_after_retrain

# --- auth --------------------------------------------------------------------------------------

def test_control_api_needs_the_token(make_stack):
    s = make_stack()
    routes = [("POST", "check", None), ("GET", "drafters", None), ("POST", "promote", {"version": 1}),
              ("POST", "rollback", {}), ("GET", "operations", None)]
    for method, path, body in routes:
        assert s.control(method, path, body, headers={}).status_code == 401, path
        wrong = s.control(method, path, body, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401, path
        assert wrong.json()["error"]["type"] == "authentication_error"
    assert s.registry.aliases() == {CHAMPION: 1} and s.registry.operations() == []  # nothing happened
    listed = s.control("GET", "drafters").json()
    assert listed["serving"] == "1" and [v["version"] for v in listed["versions"]] == [1]
    assert listed["versions"][0]["aliases"] == [CHAMPION] and listed["versions"][0]["kind"] == "static"


# --- promote / check / rollback ----------------------------------------------------------------

def test_registry_promotion_is_served_after_check_and_stays_lossless(make_stack, tiny):
    s = make_stack()
    assert s.serving() == "1"  # the static drafter, bootstrapped as version 1 at start
    v2 = register(s.registry, save_drafter(perturbed(tiny, 2), tiny.root / "v2a"))
    s.registry.promote(v2, actor="cli:test")  # as `tide drafters promote` does: registry only
    assert s.serving() == "1"  # polling is hourly here: nothing changes until asked
    out = s.control("POST", "check").json()
    assert out["status"] == "swapped" and out["version"] == str(v2), out
    assert s.serving() == str(v2)
    assert s.control("POST", "check").json()["status"] == "unchanged"
    for prompt in PROMPTS[:3]:
        body = s.complete(prompt)
        assert body["choices"][0]["text"] == reference_text(tiny, prompt)
        assert body["tide"]["drafter_version"] == str(v2)


def test_api_promote_then_rollback_restores_the_exact_previous_drafter(make_stack, tiny):
    s = make_stack()
    first = s.engine.drafter
    v2 = register(s.registry, save_drafter(perturbed(tiny, 3), tiny.root / "v2b"))
    resp = s.control("POST", "promote", {"version": v2, "actor": "alice", "reason": "try it"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["outcome"]["status"] == "swapped" and s.serving() == str(v2)
    assert s.registry.aliases() == {CHAMPION: v2, PREVIOUS_CHAMPION: 1}
    s.traffic()  # requests in flight across the next swap are covered by bench/swap.py
    resp = s.control("POST", "rollback", {"actor": "bob"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["from"] == v2 and resp.json()["to"] == 1 and s.serving() == "1"
    assert s.engine.drafter is first  # the very object that served before: no reload
    reference = load_drafter(tiny.static).state_dict()
    assert all(torch.equal(t, reference[k]) for k, t in s.engine.drafter.state_dict().items())
    assert s.registry.aliases() == {CHAMPION: 1}
    ops = s.control("GET", "operations").json()["operations"]
    assert [(o["op"], o["actor"], o["from"], o["to"]) for o in ops] == [
        ("promote", "api:alice", 1, v2), ("rollback", "api:bob", v2, 1)]
    assert ops[0]["reason"] == "try it" and ops[0]["at_s"] <= ops[1]["at_s"] <= time.time()
    again = s.control("POST", "rollback")
    assert again.status_code == 409 and "no previous champion" in again.json()["error"]["message"]
    missing = s.control("POST", "promote", {"version": 99})
    assert missing.status_code == 404 and "no version 99" in missing.json()["error"]["message"]
    assert s.control("POST", "promote", {"version": "x"}).status_code == 400



@pytest.mark.parametrize("kind,why", [("checksum", "hash"), ("hidden_size", "does not fit the target"),
                                      ("vocab_mapping", "vocab mapping"), ("pickle", "pickle"),
                                      ("config", "num_heads 0 outside"), ("tag", "not 64 hex"),
                                      ("source", "not under the artifact root")])
def test_bad_versions_are_refused_while_the_champion_keeps_serving(make_stack, tiny, kind, why):
    s = make_stack()
    bad = bad_version(kind, tiny, s.registry)
    refusals = REGISTRY.get_sample_value("tide_ops_swap_checks_total", {"outcome": "refused"}) or 0.0
    # straight in the registry (an operator bypassing the engine): the engine refuses to follow
    s.registry.promote(bad, actor="cli:test", reason="by hand")
    out = s.control("POST", "check").json()
    assert out["status"] == "refused" and out["version"] == str(bad) and why in out["detail"], out
    assert s.serving() == "1"
    assert s.complete(PROMPTS[0])["choices"][0]["text"] == reference_text(tiny, PROMPTS[0])
    assert s.control("POST", "check").json()["status"] == "refused"  # remembered, not retried
    health = s.control("GET", "health").json()["ops"]  # details need the token; /health shows status only
    assert str(bad) in health["refused"] and health["serving"] == "1"
    # reported as refused, once; the registry answered, so it is not an outage
    assert (health["state"], health["registry_connected"], health["last_error"]) == ("refused", True, None)
    assert REGISTRY.get_sample_value("tide_ops_followed_version_refused") == 1
    assert REGISTRY.get_sample_value("tide_ops_registry_connected") == 1
    assert REGISTRY.get_sample_value("tide_ops_swap_checks_total", {"outcome": "refused"}) == refusals + 1
    # through the control API: validated again, refused before the alias moves
    assert s.control("POST", "promote", {"version": 1}).json()["outcome"]["status"] == "unchanged"
    resp = s.control("POST", "promote", {"version": bad, "actor": "carol"})
    assert resp.status_code == 409 and why in resp.json()["error"]["message"], resp.text
    assert s.registry.aliases()[CHAMPION] == 1 and s.serving() == "1"
    assert s.control("POST", "check").json()["status"] == "unchanged"
    assert REGISTRY.get_sample_value("tide_ops_followed_version_refused") == 0
    assert s.control("GET", "health").json()["ops"]["state"] == "following"



def test_auto_promotion_policy_against_the_registry(make_stack, tiny):
    s = make_stack()
    cfg_on = load_config(env={}, overrides={**as_overrides(s.cfg), "ops": {
        **as_overrides(s.cfg)["ops"], "auto_promote": True, "auto_promote_margin": 0.05}})
    weak = register(s.registry, save_drafter(perturbed(tiny, 9), tiny.root / "weak"),
                    {TAG_SIM_ACCEPT: 1.52, TAG_PARENT_SIM_ACCEPT: 1.50})
    assert not auto_promote_after_retrain(s.registry, s.cfg)["promote"]  # off by default
    decision = auto_promote_after_retrain(s.registry, cfg_on)
    assert not decision["promote"] and s.registry.aliases()[CHAMPION] == 1, decision
    strong = register(s.registry, save_drafter(perturbed(tiny, 10), tiny.root / "strong"),
                      {TAG_SIM_ACCEPT: 1.80, TAG_PARENT_SIM_ACCEPT: 1.50})
    assert auto_promote_after_retrain(s.registry, cfg_on)["applied"]
    assert s.registry.aliases() == {CHAMPION: strong, PREVIOUS_CHAMPION: 1} and weak != strong
    op = s.registry.operations()[-1]
    assert (op["op"], op["actor"], op["to"]) == ("promote", "auto-promotion", strong) and "1.800" in op["reason"]
    assert s.control("POST", "check").json()["status"] == "swapped" and s.serving() == str(strong)


