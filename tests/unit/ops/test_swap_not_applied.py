"""A swap the engine does not apply is reported as not applied (never as done) and asked again.

The engine is SwapFakeEngine (tests/unit/engine/fake_engine.py): a FAKE implementing the Engine
contract of tide/engine/base.py whose decode loop can stall, so that a swap stays pending. The
registry is a real MLflow SQLite store; the follower and its control API are served over real HTTP
as tide/services/engine.py wires them, and ``tide drafters`` is the real CLI.
"""
from __future__ import annotations

import io
import json
import time
import uuid
from contextlib import redirect_stderr, redirect_stdout

import httpx
import pytest
import torch
import yaml
from fake_engine import TOKEN, SwapFakeEngine
from prometheus_client import REGISTRY

from tide.config import load_config
from tide.contracts import CHALLENGER, TAG_PARENT
from tide.drafter.artifact import load_drafter, save_drafter
from tide.engine.server import HttpServer, build_app
from tide.ops.control_api import control_plane
from tide.ops.follower import DrafterFollower
from tide.ops.swap import SwapWatcher
from tide.registry import Registry

SWAPS = "tide_ops_swap_checks_total"
SERVED = "tide_engine_drafter_info"


@pytest.fixture(scope="module")
def folders(tiny_drafter, tmp_path_factory):
    """Two drafters of the same shape and vocab mapping, with different weights."""
    root = tmp_path_factory.mktemp("swap-drafters")
    first = save_drafter(tiny_drafter, root / "static", metadata={"version": "static"})
    other = load_drafter(first)
    with torch.no_grad():
        other.fc.weight.add_(0.01)
    return first, save_drafter(other, root / "candidate", metadata={"parent_version": "1"})


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("swap-mlflow")
    return f"sqlite:///{root / 'mlflow.db'}", (root / "artifacts").as_uri()


def count(outcome: str) -> float:
    return REGISTRY.get_sample_value(SWAPS, {"outcome": outcome}) or 0.0


def served_metric() -> dict[str, float]:
    return {v: REGISTRY.get_sample_value(SERVED, {"drafter_version": v}) or 0.0 for v in ("1", "2")}


def wait_until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.02)


def run_cli(cfg_path, *argv: str) -> tuple[int, str]:
    from tide.cli import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(["--config", str(cfg_path), "drafters", *argv])
    return code, out.getvalue() + err.getvalue()


def listed(cfg_path, url: str) -> tuple[dict[str, str], str, dict[int, bool]]:
    """``tide drafters --engine URL list``: (table row by version, its last line, --json flags)."""
    code, out = run_cli(cfg_path, "--engine", url, "list")
    assert code == 0, out
    lines = out.strip().splitlines()
    rows = {line.split()[0]: line for line in lines[1:-1]}
    code, out = run_cli(cfg_path, "--engine", url, "list", "--json")
    assert code == 0, out
    return rows, lines[-1], {r["version"]: r["served_by_engine"] for r in json.loads(out)}


@pytest.fixture
def stack(store, folders, tmp_path):
    uri, artifacts = store
    registry_cfg = {"tracking_uri": uri, "artifact_location": artifacts,
                    "registered_model_name": f"swap-{uuid.uuid4().hex[:8]}", "cache_dir": str(tmp_path / "cache")}
    cfg = load_config(env={}, overrides={
        "home": str(tmp_path / "home"), "server": {"control_token": TOKEN}, "registry": registry_cfg,
        "ops": {"poll_interval_s": 0.1, "guard_enabled": False, "registry_retry_s": 0.3}})
    registry = Registry.from_config(cfg)
    registry.ensure_bootstrap(folders[0])  # version 1, champion: what the engine serves at start
    engine = SwapFakeEngine("1")
    follower = DrafterFollower(engine, cfg.ops, lambda: Registry.from_config(cfg))
    follower.watcher.apply_timeout_s = 0.2
    follower.start()
    server = HttpServer(build_app(engine, cfg.server, cfg.engine, ops=control_plane(follower)), "127.0.0.1", 0,
                        grace_s=1, log_level="warning")
    url = f"http://127.0.0.1:{server.start()}"
    cfg_path = tmp_path / "tide.yaml"
    cfg_path.write_text(yaml.safe_dump({"home": str(tmp_path / "home"), "registry": registry_cfg}))
    yield engine, follower, registry, url, cfg_path
    server.stop(timeout_s=10)
    follower.stop()


def register(registry: Registry, folder) -> int:
    run = registry.start_run("test", {"tide.kind": "retrain"})
    info = registry.register(run.log_drafter(folder), {TAG_PARENT: "1", "tide.kind": "retrain"}, alias=CHALLENGER)
    run.finish()
    return info.version


def test_swap_not_applied_is_reported_failed_and_retried(stack, folders):
    engine, follower, registry, url, cfg_path = stack
    auth = {"Authorization": f"Bearer {TOKEN}"}
    health = lambda: httpx.get(f"{url}/control/health", headers=auth, timeout=10).json()  # noqa: E731
    assert health()["ops"]["state"] == "following" and engine.drafter_version == "1"
    not_applied, swapped = count("not_applied"), count("swapped")
    engine.stall()  # the decode loop takes no step: a swap asked now stays pending
    v2 = register(registry, folders[1])
    registry.promote(v2, actor="cli:test")
    wait_until(lambda: follower.last_check.status != "unchanged", 60, "the first try at the swap")
    first = follower.last_check
    assert (first.status, first.version, follower.watcher.previous) == ("not_applied", "2", None), first
    # each poll asks again: the version is neither refused nor taken as served
    wait_until(lambda: len(engine.swaps_asked) >= 3, 30, "three polls asking for the swap")
    assert engine.swaps_asked[:3] == ["2", "2", "2"] and follower.watcher.refused == {}
    assert count("not_applied") >= not_applied + 2 and count("swapped") == swapped
    h = health()
    ops = h["ops"]
    assert (h["drafter_version"], ops["serving"], ops["previous"], ops["state"]) == ("1", "1", None, "not applied")
    assert ops["last_check"]["status"] == "not_applied" and ops["last_check"]["version"] == "2", ops
    assert "still serves 1" in ops["last_check"]["detail"]
    assert httpx.get(f"{url}/health", timeout=10).json()["drafter_version"] == "1"
    assert served_metric() == {"1": 1.0, "2": 0.0}
    rows, last, flags = listed(cfg_path, url)
    assert "served by engine" in rows["1"] and "served by engine" not in rows["2"] and "champion" in rows["2"]
    assert last == f"engine {url} serves drafter 1" and flags == {1: True, 2: False}

    engine.resume()  # the loop steps again: the pending swap is applied
    wait_until(lambda: health()["ops"]["previous"] == "1", 30, "the applied swap to be recorded")
    h = health()
    assert (h["drafter_version"], h["ops"]["serving"], h["ops"]["state"]) == ("2", "2", "following"), h
    assert count("swapped") == swapped + 1  # reported swapped once, when it was applied
    assert served_metric() == {"1": 0.0, "2": 1.0}
    rows, last, flags = listed(cfg_path, url)
    assert "served by engine" in rows["2"] and last == f"engine {url} serves drafter 2"
    assert flags == {1: False, 2: True}


def test_swap_applied_after_the_wait_is_recorded_at_the_next_check(folders):
    engine = SwapFakeEngine("1")
    champion = ("2", folders[1])
    watcher = SwapWatcher(engine, lambda: champion, smoke_prompt_ids=[5, 6])
    watcher.apply_timeout_s = 0.05
    not_applied, swapped = count("not_applied"), count("swapped")
    engine.stall()
    first = watcher.check_now()
    assert (first.status, first.version, watcher.previous) == ("not_applied", "2", None), first
    assert watcher.check_now().status == "not_applied" and engine.swaps_asked == ["2", "2"]
    assert count("not_applied") == not_applied + 2 and count("swapped") == swapped
    engine.resume()  # applied between two checks, after the watcher stopped waiting
    late = watcher.check_now()
    assert (late.status, late.version, watcher.previous) == ("swapped", "2", ("1", None)), late
    assert count("swapped") == swapped + 1
    assert watcher.check_now().status == "unchanged" and count("swapped") == swapped + 1
