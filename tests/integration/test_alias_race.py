"""Alias writers racing, on a real `mlflow server`: 200 random promote / rollback / auto-promote /
collapse events from 4 processes (tests/integration/alias_race_worker.py), two through the alias
owner's HTTP API (as engine replicas and retrain Jobs do), two writing in-process on the owner's
lock file (as a CLI on the scheduler's host does).

After every event, as the ledger records it: ``champion`` is a registered version whose record
the engine would trust, ``previous-champion`` is the one it replaced, a collapse report leaves no
champion trained from the collapsed drafter (unless no earlier champion was free of it: then the
champion stays, as a weak drafter beats none), an auto-promotion promoted a challenger trained from
the champion it replaced; the operations history is one linear sequence (generations 1..N, each
starting from the champion the previous one left, each reported applied by exactly one event)
and the registry's aliases are its last state. No event raised anything but a conflict.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from tide.config import load_config
from tide.contracts import CHAMPION, PREVIOUS_CHAMPION, TAG_WEIGHTS_SHA
from tide.drafter.artifact import save_drafter
from tide.ops.alias_api import AliasApiServer
from tide.ops.aliases import AliasOwner, descends_from
from tide.registry import Registry, source_problem, tag_problem

WORKERS, EVENTS_EACH = 4, 50
TOKEN = "race-secret"
WORKER = Path(__file__).with_name("alias_race_worker.py")


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    from tide.process import free_port
    from tide.stack import mlflow_server

    root = tmp_path_factory.mktemp("race-mlflow")
    port = free_port()
    svc = mlflow_server(root / "server", port, root / "mlflow.log").start()
    try:
        svc.wait_healthy(300)
        yield f"http://127.0.0.1:{port}"
    finally:
        svc.stop()


@pytest.fixture(scope="module")
def drafter(tmp_path_factory):
    import torch

    from tide.models.llama import LlamaTarget
    from tide.models.tiny import tiny_llama_checkpoint
    from tide.train.offline import new_drafter

    root = tmp_path_factory.mktemp("race-drafter")
    target = LlamaTarget.from_folder(tiny_llama_checkpoint(root / "target"), aux_layer_ids=(1, 2, 3), max_seq_len=256)
    return new_drafter(target, 256, torch.arange(512).flip(0), seed=1).eval()


def _config(tmp_path: Path, uri: str, owner_url: str | None, name: str) -> Path:
    cfg = {"home": str(tmp_path / "home"),
           "server": {"control_token": TOKEN},
           # the race is about ordering, not the registry's latency: on a loaded machine one MLflow
           # (SQLite) behind 4 busy writers can take over the default 10 s to answer a read
           "registry": {"tracking_uri": uri, "registered_model_name": name, "http_timeout_s": 120,
                        "artifact_location": "mlflow-artifacts:/race", "cache_dir": str(tmp_path / "cache")},
           "ops": {"auto_promote": True, "auto_promote_margin": 0.05, "alias_lock_path": str(tmp_path / "alias.lock"),
                   **({"alias_owner_url": owner_url} if owner_url else {})}}
    path = tmp_path / ("owner.yaml" if owner_url else "direct.yaml")
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_alias_writers_racing_leave_one_linear_history(mlflow_server, drafter, tmp_path):
    save_drafter(drafter, tmp_path / "drafter", metadata={"version": "static"})
    name = f"race-{uuid.uuid4().hex[:8]}"
    direct = _config(tmp_path, mlflow_server, None, name)
    cfg = load_config(direct, env={})
    registry = Registry.from_config(cfg)
    registry.ensure_bootstrap(tmp_path / "drafter")  # version 1, champion
    owner = AliasApiServer("127.0.0.1", 0, lambda: (True, {}),
                           lambda: AliasOwner(Registry.from_config(cfg), tmp_path / "alias.lock"), TOKEN).start()
    try:
        via_owner = _config(tmp_path, mlflow_server, f"http://127.0.0.1:{owner.port}", name)
        procs = [subprocess.Popen([sys.executable, str(WORKER), str(via_owner if w < 2 else direct), str(w),
                                   str(EVENTS_EACH), str(1000 + w), str(tmp_path / f"w{w}.jsonl")],
                                  env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
                                  stdout=open(tmp_path / f"w{w}.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True) for w in range(WORKERS)]
        try:
            codes = [p.wait(timeout=1500) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
    finally:
        owner.close()
    assert codes == [0] * WORKERS, [(tmp_path / f"w{w}.log").read_text()[-2000:] for w in range(WORKERS)]
    events = [json.loads(line) for w in range(WORKERS) for line in (tmp_path / f"w{w}.jsonl").read_text().splitlines()]
    assert len(events) == WORKERS * EVENTS_EACH
    unexpected = [e for e in events if e["outcome"] == "unexpected"]
    assert unexpected == [], unexpected[:3]

    ops = registry.operations()
    versions = {v.version: v for v in registry.list_versions(with_run=False)}
    applied = sorted(e["seq"] for e in events if e["outcome"] == "applied")
    # one linear sequence: generations 1..N, each applied by exactly one event
    assert [op["seq"] for op in ops] == list(range(1, len(ops) + 1)) == applied
    champion = 1
    for op in ops:
        assert op["from"] == champion, op  # each operation starts from the champion the last one left
        champion = op["to"]
        info = versions[champion]  # registered and complete, with a record the engine trusts
        assert tag_problem(info.checksum, info.tags.get(TAG_WEIGHTS_SHA)) is None
        assert source_problem(info.source, registry.artifact_root) is None
        assert op["aliases"][CHAMPION] == champion
        if op["op"] == "promote" and op["from"] != op["to"]:
            assert op["aliases"][PREVIOUS_CHAMPION] == op["from"], op  # previous is the one it replaced
        if op["op"] == "rollback":
            assert op["aliases"][PREVIOUS_CHAMPION] is None, op
        if op["actor"] == "auto-promotion":
            assert versions[op["to"]].parent_version == str(op["from"]), op
    champions = {0: 1, **{op["seq"]: op["to"] for op in ops}}
    for e in events:  # a collapse report leaves no champion trained from the collapsed drafter...
        if e["kind"] != "collapse" or not descends_from(versions, champions[e["seq"]], e["collapsed"]):
            continue
        # ... unless every champion so far was (then the champion stays: a weak drafter beats none)
        assert "no earlier champion" in e["detail"], e
        assert all(descends_from(versions, champions[g], e["collapsed"]) for g in range(e["seq"] + 1)), e
    final = registry.aliases()
    assert (final.get(CHAMPION), final.get(PREVIOUS_CHAMPION)) == (
        ops[-1]["aliases"][CHAMPION], ops[-1]["aliases"][PREVIOUS_CHAMPION])
    kinds = {(e["kind"], e["outcome"]) for e in events}
    # the run exercised what it claims: every kind applied, and races were lost and retried on
    assert {("promote", "applied"), ("rollback", "applied"), ("auto-promote", "applied"),
            ("collapse", "applied"), ("promote", "conflict")} <= kinds, kinds
