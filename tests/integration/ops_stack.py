"""Shared parts of the drafter-operations tests (test_ops_*.py): a real MLflow SQLite registry, the
tiny target's reference engine served over real HTTP with the drafter follower and control API,
exactly as tide/services/engine.py wires them (build_engine -> DrafterFollower.from_config ->
build_app).

The engine's first drafter is a tiny drafter trained here (about 10 s) on the target's own greedy
output for PROMPTS, so on that traffic it gets drafts accepted (about 1.5 tokens per forward)
while a drafter with randomized weights gets about 1.0: the collapse guard can tell them apart.
"""
from __future__ import annotations

import json
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace

import httpx
import torch
from safetensors.torch import load_file, save_file

from tide.config import load_config
from tide.contracts import (
    CHALLENGER,
    TAG_CHECKSUM,
    TAG_PARENT,
    TAG_REGISTRATION,
)
from tide.drafter.artifact import load_drafter, save_drafter
from tide.drafter.vocab import build_d2t
from tide.engine.reference import build_engine
from tide.engine.server import HttpServer, build_app
from tide.models.llama import LlamaTarget
from tide.models.tiny import tiny_llama_checkpoint
from tide.ops.control_api import control_plane
from tide.ops.follower import DrafterFollower
from tide.registry import ARTIFACT_PATH, DrafterArtifact, Registry, folder_digest
from tide.spec.generate import generate
from tide.train.offline import generate_samples, new_drafter
from tide.train.trainer import train

TOKEN = "ops-secret"
PROMPTS = ["The quick brown fox", "def fibonacci(n: int)", "Please write a short story",
           "How do I make a cup of tea?", "class Stack:", "Tell me a joke about computers.",
           "import os\nfor name in", "What is the capital of France?"]
MAX_TOKENS = 40


def build_tiny(root: Path) -> SimpleNamespace:
    """The tiny target, its tokenizer, the trained drafter (saved as ``static``) and a target of
    another hidden size (the conftest's ``tiny`` fixture, once per module)."""
    from transformers import AutoTokenizer

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


def store_at(root: Path) -> tuple[str, Path]:
    """(tracking URI, artifact root) of an MLflow SQLite store under ``root``."""
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


def stacks_of(tiny, store, tmp_path):
    """The conftest's ``make_stack``: builds stacks on demand, closes them after the test."""
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



def as_overrides(cfg) -> dict:
    return cfg.model_dump()


