"""Drafter operations end to end: a real MLflow SQLite registry, the tiny target's reference
engine served over real HTTP with the drafter follower and control API, exactly as
tide/services/engine.py wires them (build_engine -> DrafterFollower.from_config -> build_app).

The engine's first drafter is a tiny drafter trained here (about 10 s) on the target's own greedy
output for PROMPTS, so on that traffic it gets drafts accepted (about 1.5 tokens per forward)
while a drafter with randomized weights gets about 1.0: the collapse guard can tell them apart.
"""
from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
import uuid
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from prometheus_client import REGISTRY
from safetensors.torch import load_file, save_file

from tide.config import load_config
from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    TAG_CHECKSUM,
    TAG_PARENT,
    TAG_PARENT_SIM_ACCEPT,
    TAG_REGISTRATION,
    TAG_SIM_ACCEPT,
)
from tide.drafter.artifact import load_drafter, save_drafter
from tide.drafter.vocab import build_d2t
from tide.engine.reference import build_engine
from tide.engine.server import HttpServer, build_app
from tide.models.llama import LlamaTarget
from tide.models.tiny import tiny_llama_checkpoint
from tide.ops.alias_api import AliasApiServer, auto_promote_after_retrain
from tide.ops.aliases import AliasOwner, default_lock_path
from tide.ops.control_api import control_plane
from tide.ops.follower import DrafterFollower
from tide.ops.inventory import live_acceptance_from_metrics
from tide.registry import ARTIFACT_PATH, DrafterArtifact, Registry, folder_digest
from tide.spec.generate import generate
from tide.train.offline import generate_samples, new_drafter
from tide.train.trainer import train

TOKEN = "ops-secret"
PROMPTS = ["The quick brown fox", "def fibonacci(n: int)", "Please write a short story",
           "How do I make a cup of tea?", "class Stack:", "Tell me a joke about computers.",
           "import os\nfor name in", "What is the capital of France?"]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("ops-tiny")
    folder = tiny_llama_checkpoint(root / "target")
    target = LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 3), max_seq_len=256)
    tok = AutoTokenizer.from_pretrained(folder)
    samples = generate_samples(target, [tok.encode(p) for p in PROMPTS], MAX_TOKENS + 4, eos_ids=(),
                               progress=False)
    good = new_drafter(target, 256, torch.arange(512).flip(0), seed=1)
    train(good, target.embed_weight, target.lm_head_weight, samples, epochs=60, lr=3e-2, batch_tokens=512,
          max_len=256, ttt_length=1, step_weight=0.8, progress=False)
    static = save_drafter(good.eval(), root / "static", metadata={"version": "static"})
    other = tiny_llama_checkpoint(root / "target-h32", hidden=32)  # for a drafter of another hidden size
    return SimpleNamespace(root=root, folder=folder, target=target, tok=tok, good=good, static=static,
                           other_target=LlamaTarget.from_folder(other, aux_layer_ids=(1, 2, 3), max_seq_len=256))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("ops-mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts")


def make_config(tiny, store, home: Path, model_name: str, **ops):
    uri, artifacts = store
    return load_config(env={}, overrides={
        "home": str(home),
        "model": {"target": str(tiny.folder), "model_id": "tiny", "aux_layer_ids": [1, 2, 3],
                  "max_seq_len": 256, "torch_threads": 1},
        "spec": {"draft_len": 3}, "drafter": {"path": str(tiny.static)},
        "engine": {"max_batch_size": 8, "max_prompt_tokens": 128, "max_new_tokens_limit": 64},
        "server": {"control_token": TOKEN},
        "registry": {"tracking_uri": uri, "artifact_location": artifacts.as_uri(),
                     "registered_model_name": model_name, "cache_dir": str(home / "cache")},
        "ops": {"poll_interval_s": 3600.0, "guard_enabled": False, "registry_retry_s": 0.3, **ops}})


class Stack:
    """Engine + follower + HTTP server, wired like tide/services/engine.py."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.engine = build_engine(cfg)
        self.follower = DrafterFollower.from_config(self.engine, cfg)
        self.follower.start()
        self.server = HttpServer(build_app(self.engine, cfg.server, cfg.engine, ops=control_plane(self.follower)),
                                 "127.0.0.1", 0, grace_s=1, log_level="warning")
        self.url = f"http://127.0.0.1:{self.server.start()}"
        self.auth = {"Authorization": f"Bearer {TOKEN}"}

    def close(self):
        self.server.stop(timeout_s=10)
        self.follower.stop()
        self.engine.close()

    def control(self, method: str, path: str, body: dict | None = None, headers=None) -> httpx.Response:
        return httpx.request(method, f"{self.url}/control/{path}", json=body, timeout=60,
                             headers=self.auth if headers is None else headers)

    def serving(self) -> str:
        return httpx.get(f"{self.url}/health", timeout=10).json()["drafter_version"]

    def complete(self, prompt: str, max_tokens: int = MAX_TOKENS) -> dict:
        resp = httpx.post(f"{self.url}/v1/completions", timeout=120,
                          json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def traffic_until(self, done, timeout_s: float, what: str) -> list[dict]:
        """Rounds of traffic until `done()`, bounded: the guard judges drafted rows only, and under the
        default scheduler a drafter this poor drafts on probe steps alone, so how many rounds fill a
        guard window follows the machine's speed."""
        out: list[dict] = []
        deadline = time.monotonic() + timeout_s
        while not done():
            assert time.monotonic() < deadline, f"timed out after {timeout_s:.0f} s waiting for {what}"
            out.extend(self.traffic())
        return out

    def traffic(self, rounds: int = 1) -> list[dict]:
        out: list[dict] = []

        def one(p):
            out.append(self.complete(p))
        for _ in range(rounds):
            threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS]
            [t.start() for t in threads]
            [t.join(120) for t in threads]
        return out


@pytest.fixture
def make_stack(tiny, store, tmp_path):
    stacks = []

    def make(**ops):
        name = f"ops-{uuid.uuid4().hex[:8]}"
        cfg = make_config(tiny, store, tmp_path / "home", name, **ops)
        stack = Stack(cfg)
        stacks.append(stack)
        stack.registry = Registry.from_config(cfg)  # the operator's own handle on the store
        return stack
    yield make
    for s in stacks:
        s.close()


def register(registry: Registry, folder: Path, tags: dict | None = None) -> int:
    run = registry.start_run("test", {"tide.kind": "retrain"})
    info = registry.register(run.log_drafter(folder), {TAG_PARENT: "1", "tide.kind": "retrain", **(tags or {})},
                             alias=CHALLENGER)
    run.finish()
    return info.version


def perturbed(tiny, seed: int, scale: float = 1e-3):
    d = load_drafter(tiny.static)
    with torch.no_grad():
        d.fc.weight.add_(scale * torch.randn(d.fc.weight.shape, generator=torch.Generator().manual_seed(seed)))
    return d


def reference_text(tiny, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    eos = tiny.tok.eos_token_id
    ids, _ = generate(tiny.target, None, tiny.tok.encode(prompt), max_tokens, stop_ids=(eos,))
    return tiny.tok.decode(ids, skip_special_tokens=True)


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


# --- refusals ----------------------------------------------------------------------------------

def bad_version(kind: str, tiny, registry: Registry) -> int:
    root = tiny.root / f"bad-{kind}-{uuid.uuid4().hex[:6]}"
    if kind == "checksum":
        version = register(registry, save_drafter(perturbed(tiny, 5), root))
        # corrupt the stored artifact after registration (bit rot, a partial copy, tampering)
        info = registry.get_version(version)
        stored = Path(registry.client.get_run(info.run_id).info.artifact_uri.removeprefix("file://"))
        weights = stored / ARTIFACT_PATH / "model.safetensors"
        state = load_file(str(weights))
        state["fc.weight"] *= 2
        save_file(state, str(weights))
        return version
    if kind == "hidden_size":
        d = new_drafter(tiny.other_target, 256, torch.arange(512).flip(0), seed=3)
        return register(registry, save_drafter(d.eval(), root))
    if kind == "vocab_mapping":
        d = perturbed(tiny, 6)
        d.set_vocab_mapping(build_d2t(torch.arange(512), d.shape.draft_vocab_size))
        return register(registry, save_drafter(d, root))
    if kind == "config":  # zero heads and no head_dim: the old loader divided by zero
        folder = save_drafter(perturbed(tiny, 12), root)
        cfg = json.loads((folder / "config.json").read_text())
        cfg.pop("head_dim")
        (folder / "config.json").write_text(json.dumps({**cfg, "num_attention_heads": 0}))
        return register(registry, folder)
    if kind == "tag":  # a checksum tag that would become part of a cache path
        version = register(registry, save_drafter(perturbed(tiny, 13), root))
        registry.set_version_tag(version, TAG_CHECKSUM, "/../../../../victim" + "0" * 45)
        return version
    if kind == "source":  # a valid drafter whose files lie outside the artifact root
        folder = save_drafter(perturbed(tiny, 14), root / ARTIFACT_PATH)
        registry._ensure_model()
        mv = registry.client.create_model_version(registry.model_name, folder.as_uri(), tags={
            TAG_CHECKSUM: folder_digest(folder), TAG_REGISTRATION: "complete", TAG_PARENT: "1"})
        return int(mv.version)
    # pickle-only artifact: config + pytorch_model.bin, no safetensors; logged by hand since the
    # facade's log_drafter refuses it (an external trainer might not)
    folder = save_drafter(perturbed(tiny, 7), root)
    torch.save(load_drafter(folder).state_dict(), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    run = registry.start_run("pickle", {"tide.kind": "retrain"})
    registry.client.log_artifacts(run.run_id, str(folder), ARTIFACT_PATH)
    artifact = DrafterArtifact(run.run_id, f"{run.artifact_uri}/{ARTIFACT_PATH}", folder_digest(folder), "", "")
    version = registry.register(artifact, {TAG_PARENT: "1"}, alias=CHALLENGER).version
    run.finish()
    return version


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
    cfg = load_config(env={}, overrides={**_as_overrides(cfg), "registry": {
        **_as_overrides(cfg)["registry"], "tracking_uri": f"sqlite:///{blocker / 'mlflow.db'}"}})
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


def _as_overrides(cfg) -> dict:
    return cfg.model_dump()


def test_auto_promotion_policy_against_the_registry(make_stack, tiny):
    s = make_stack()
    cfg_on = load_config(env={}, overrides={**_as_overrides(s.cfg), "ops": {
        **_as_overrides(s.cfg)["ops"], "auto_promote": True, "auto_promote_margin": 0.05}})
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


def run_cli(cfg_path: Path, *argv: str) -> tuple[int, str, str]:
    from tide.cli import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["--config", str(cfg_path), "drafters", *argv])
    return code, out.getvalue(), err.getvalue()


def test_cli_list_show_promote_rollback_diff(make_stack, tiny, tmp_path):
    import yaml

    s = make_stack()
    cfg_path = tmp_path / "tide.yaml"
    cfg_path.write_text(yaml.safe_dump({"home": s.cfg.home, "registry": _as_overrides(s.cfg)["registry"]}))
    v2 = register(s.registry, save_drafter(perturbed(tiny, 11), tiny.root / "cli-v2"),
                  {TAG_SIM_ACCEPT: 1.7, TAG_PARENT_SIM_ACCEPT: 1.5, "tide.data_window_start_s": 1.7e9,
                   "tide.data_window_end_s": 1.7e9 + 3600})
    s.traffic()
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["version", "aliases", "kind", "parent"]
    row2, row1 = lines[1].split(), lines[2].split()
    assert row2[:4] == [str(v2), CHALLENGER, "retrain", "1"] and "1.700" in row2 and "1.500" in row2
    assert row1[:3] == ["1", CHAMPION, "static"] and "2023-11-14" in lines[1]
    # the /metrics page is process-wide here (every test's engine serves a version "1")
    live = live_acceptance_from_metrics(httpx.get(f"{s.url}/metrics").text)["1"]
    assert f"{live:.3f}" in lines[2]
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "--token", TOKEN, "promote", str(v2),
                           "--actor", "dave", "--reason", "better on code")
    assert code == 0 and f"champion: 1 -> {v2}" in out and f"swapped {v2}" in out, out
    assert s.serving() == str(v2)
    code, out, _ = run_cli(cfg_path, "show", str(v2))
    assert code == 0 and "champion" in out and "promote" in out and "by dave" in out
    code, out, _ = run_cli(cfg_path, "diff", "1", str(v2))
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()}
    assert code == 0 and rows["version"] == ["1", str(v2)] and rows["sim_accept_length"] == ["-", "1.7000"]
    assert rows["parent_sim_accept_length"] == ["-", "1.5000"]
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "--token", TOKEN, "rollback", "--actor", "dave")
    assert code == 0 and f"champion: {v2} -> 1" in out and s.serving() == "1"
    code, out, _ = run_cli(cfg_path, "history")
    assert code == 0 and len(out.splitlines()) == 2 and "rollback" in out.splitlines()[1]
    code, _, err = run_cli(cfg_path, "show", "42")
    assert code == 2 and "no version 42" in err
    code, _, err = run_cli(cfg_path, "promote", "42")
    assert code == 2 and "no version 42" in err
    bad = bad_version("vocab_mapping", tiny, s.registry)
    code, _, err = run_cli(cfg_path, "promote", str(bad))
    assert code == 2 and "refused" in err and "vocab mapping" in err
    assert s.registry.aliases()[CHAMPION] == 1
    code, out, _ = run_cli(cfg_path, "list", "--json")
    assert code == 0 and {r["version"] for r in json.loads(out)} == {1, v2, bad}
    # every verb scripts with --json
    code, out, _ = run_cli(cfg_path, "history", "--json")
    assert code == 0 and [op["op"] for op in json.loads(out)] == ["promote", "rollback"]
    code, out, _ = run_cli(cfg_path, "diff", "1", str(v2), "--json")
    assert code == 0 and {r["name"]: r["b"] for r in json.loads(out)}["sim_accept_length"] == "1.7000"
    code, out, _ = run_cli(cfg_path, "--engine", s.url, "--token", TOKEN, "promote", str(v2), "--json")
    change = json.loads(out)
    assert code == 0 and (change["from"], change["to"]) == (1, v2) and change["engine"]["status"] == "swapped"
    code, out, _ = run_cli(cfg_path, "rollback", "--json")
    assert code == 0 and json.loads(out) == {"op": "rolled back", "from": v2, "to": 1, "engine": None,
                                             "generation": len(s.registry.operations())}


def test_cli_alias_changes_are_authorised_before_anything_is_written(make_stack, tiny, tmp_path):
    """`tide drafters rollback --token wrong` moves nothing and says the token was refused, whether
    the change goes through the alias owner's API or this process checks the engine's token first."""
    import yaml

    s = make_stack()
    cfg_path = tmp_path / "tide.yaml"
    cfg_path.write_text(yaml.safe_dump({"home": s.cfg.home, "registry": _as_overrides(s.cfg)["registry"]}))
    v2 = register(s.registry, save_drafter(perturbed(tiny, 15), tiny.root / "auth-v2"))
    s.registry.promote(v2, actor="setup")
    owner = AliasApiServer("127.0.0.1", 0, lambda: (True, {}),
                           lambda: AliasOwner(Registry.from_config(s.cfg), default_lock_path(s.cfg)), TOKEN).start()
    try:
        owner_url = f"http://127.0.0.1:{owner.port}"
        before = (s.registry.aliases(), s.registry.operations())
        for argv in (("--owner", owner_url, "--token", "wrong", "rollback"),
                     ("--owner", owner_url, "--token", "wrong", "promote", "1"),
                     ("--engine", s.url, "--token", "wrong", "rollback"),
                     ("--engine", s.url, "--token", "wrong", "promote", "1")):
            code, out, err = run_cli(cfg_path, *argv)
            assert code == 2 and "token" in err and "401" in err and "unreachable" not in err, (argv, err)
            assert (s.registry.aliases(), s.registry.operations()) == before, argv  # nothing was written
        code, out, err = run_cli(cfg_path, "--owner", owner_url, "--engine", s.url, "--token", TOKEN, "rollback",
                                 "--actor", "erin", "--json")
        assert code == 0 and json.loads(out)["engine"]["status"] in ("swapped", "unchanged"), err
        assert s.registry.aliases() == {CHAMPION: 1} and s.registry.operations()[-1]["actor"] == "erin"
        assert s.serving() == "1"
    finally:
        owner.close()


def test_replicas_report_to_the_fleet_view_through_the_alias_owner(tiny, store, tmp_path, wait):
    """Two engines following one registry through the alias owner's API: each reports the version it
    serves; `tide drafters fleet` shows them converging on a promotion made through one of them, and
    a replica that cannot load a version keeps the old one and says why."""
    import yaml

    owner = AliasApiServer("127.0.0.1", 0, lambda: (True, {}), lambda: AliasOwner(Registry.from_config(cfg)),
                           TOKEN).start()
    url = f"http://127.0.0.1:{owner.port}"
    cfg = make_config(tiny, store, tmp_path / "home", f"ops-{uuid.uuid4().hex[:8]}", alias_owner_url=url,
                      poll_interval_s=0.3)
    stacks: list[Stack] = []
    try:
        for port in (8000, 8001):  # the replica names hostname:server.port; both listen on free ports here
            stacks.append(Stack(load_config(env={}, overrides={**_as_overrides(cfg), "server": {
                **_as_overrides(cfg)["server"], "port": port}})))
        a, b = stacks
        registry = Registry.from_config(cfg)
        cfg_path = tmp_path / "tide.yaml"
        cfg_path.write_text(yaml.safe_dump({"home": cfg.home, "registry": _as_overrides(cfg)["registry"]}))

        def fleet() -> dict:
            code, out, err = run_cli(cfg_path, "--owner", url, "--token", TOKEN, "fleet", "--json")
            assert code == 0, err
            return {r["replica"]: r for r in json.loads(out)["replicas"]}

        wait(lambda: len(fleet()) == 2 and all(r["converged"] for r in fleet().values()), 30,
             what="both replicas to report serving the champion")
        v2 = register(registry, save_drafter(perturbed(tiny, 16), tiny.root / "fleet-v2"))
        resp = a.control("POST", "promote", {"version": v2, "actor": "alice"})  # validated here, written by the owner
        assert resp.status_code == 200 and resp.json()["to"] == v2, resp.text
        wait(lambda: all(r["serving"] == str(v2) and r["converged"] for r in fleet().values()), 30,
             what="the fleet to converge on the promotion")
        assert all(r["converged_at_s"] >= r["serving_since_s"] for r in fleet().values())
        assert registry.operations()[-1]["actor"] == "api:alice"
        bad = bad_version("vocab_mapping", tiny, registry)
        code, _, err = run_cli(cfg_path, "--owner", url, "--token", TOKEN, "promote", str(bad), "--force")
        assert code == 0, err
        wait(lambda: all("vocab mapping" in (r["why_not"] or "") for r in fleet().values()), 30,
             what="both replicas to refuse the version and say why")
        assert {r["serving"] for r in fleet().values()} == {str(v2)} and a.serving() == b.serving() == str(v2)
        code, out, _ = run_cli(cfg_path, "--owner", url, "--token", TOKEN, "fleet")
        assert code == 0 and f"champion {bad}" in out and "cannot load" in out
    finally:
        for stack in stacks:
            stack.close()
        owner.close()
