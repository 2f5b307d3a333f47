"""The MLflow facade against a real MLflow SQLite store (one per module: creating it takes ~10 s)."""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from tide.config import RegistryConfig
from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION,
    TAG_CHECKSUM,
    TAG_PARENT,
    TAG_PID,
    TAG_REGISTRATION,
)
from tide.drafter.artifact import load_drafter, save_drafter
from tide.registry import ChecksumError, Registry, RegistryError, folder_digest


@pytest.fixture(scope="module")
def drafter_folders(tiny_drafter, tmp_path_factory):
    """Two drafters with the same vocab mapping and different weights."""
    import torch

    root = tmp_path_factory.mktemp("drafters")
    first = save_drafter(tiny_drafter, root / "static", metadata={"version": "static",
                                                                  "heldout_sim_accept_length": 1.5})
    other = load_drafter(first)
    with torch.no_grad():
        other.fc.weight.add_(0.01)
    second = save_drafter(other, root / "candidate", metadata={"parent_version": "1"})
    return first, second


def _register(registry, folder, tags=None, alias=CHALLENGER):
    run = registry.start_run("test", {"tide.kind": "retrain"})
    run.log_params({"lr": 0.001, "window_start_s": 1.0})
    run.log_series("train_loss", [3.0, 2.5, 2.0])
    run.log_metrics({"candidate_sim_accept_length": 2.25})
    artifact = run.log_drafter(folder)
    info = registry.register(artifact, {TAG_PARENT: "1", **(tags or {})}, alias=alias)
    run.finish()
    return info


def test_empty_registry_then_bootstrap_is_idempotent(registry, drafter_folders):
    assert registry.aliases() == {} and registry.list_versions() == [] and registry.get_alias(CHAMPION) is None
    info = registry.ensure_bootstrap(drafter_folders[0])
    assert info.version == 1 and info.aliases == (CHAMPION,) and info.kind == "static" and info.complete
    assert info.sim_accept_length == 1.5
    again = registry.ensure_bootstrap(drafter_folders[0])
    assert again.version == 1 and len(registry.list_versions()) == 1


def test_register_challenger_with_lineage_metrics_and_download(registry, drafter_folders):
    registry.ensure_bootstrap(drafter_folders[0])
    info = _register(registry, drafter_folders[1], {"tide.data_window_end_s": "123.0"})
    assert info.version == 2 and info.aliases == (CHALLENGER,)
    assert info.tags[TAG_PARENT] == "1" and info.tags["tide.data_window_end_s"] == "123.0"
    assert info.tags[TAG_REGISTRATION] == "complete"
    assert info.checksum == folder_digest(drafter_folders[1])
    assert info.metrics["train_loss"] == 2.0 and info.metrics["candidate_sim_accept_length"] == 2.25
    assert info.params["lr"] == "0.001"
    history = registry.client.get_metric_history(info.run_id, "train_loss")
    assert [(m.step, m.value) for m in history] == [(1, 3.0), (2, 2.5), (3, 2.0)]
    listed = registry.list_versions()
    assert [(v.version, v.aliases) for v in listed] == [(2, (CHALLENGER,)), (1, (CHAMPION,))]
    local = registry.download(2)
    assert folder_digest(local) == info.checksum
    assert registry.download(2) == local  # cached copy reused once it verifies
    load_drafter(local, require_checksum=True)


def test_download_refuses_tampered_artifact(registry, drafter_folders, store):
    info = _register(registry, drafter_folders[1])
    stored = Path(info.source.removeprefix("file://")) / "model.safetensors"
    data = bytearray(stored.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte in the weights
    stored.write_bytes(bytes(data))
    with pytest.raises(ChecksumError):
        registry.download(info.version)
    assert not list((registry.cache_dir / registry.model_name).glob("v*"))  # nothing left behind


def test_failed_alias_leaves_no_version(registry, drafter_folders):
    registry.ensure_bootstrap(drafter_folders[0])
    with pytest.raises(RegistryError):
        _register(registry, drafter_folders[1], alias="latest")  # MLflow reserves this alias
    assert [v.version for v in registry.list_versions(include_incomplete=True)] == [1]


def test_reap_deletes_pending_version_of_dead_process(registry, drafter_folders):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = registry.start_run("killed", {TAG_PID: dead.pid})
    artifact = run.log_drafter(drafter_folders[1])
    registry._ensure_model()
    registry.client.create_model_version(registry.model_name, artifact.uri, run_id=run.run_id,
                                         tags={TAG_REGISTRATION: "pending"})
    live = registry.start_run("alive")  # this process: must stay RUNNING
    assert registry.list_versions() == []  # pending versions are hidden
    assert registry.reap_incomplete() == [1]
    assert registry.list_versions(include_incomplete=True) == []
    assert registry.client.get_run(run.run_id).info.status == "KILLED"
    assert registry.client.get_run(live.run_id).info.status == "RUNNING"
    live.finish()


def test_promote_and_rollback_record_operations(registry, drafter_folders):
    registry.ensure_bootstrap(drafter_folders[0])
    v2 = _register(registry, drafter_folders[1]).version
    assert registry.promote(v2, actor="alice", reason="better") == (1, v2)
    assert registry.aliases() == {CHAMPION: v2, PREVIOUS_CHAMPION: 1}  # challenger consumed
    assert registry.rollback(actor="guard", reason="collapse") == (v2, 1)
    assert registry.aliases() == {CHAMPION: 1}
    assert registry.get_version(v2).tags["tide.rolled_back"] == "collapse"
    with pytest.raises(RegistryError, match="no previous champion"):
        registry.rollback(actor="bob")
    ops = registry.operations()
    assert [(o["op"], o["actor"], o["from"], o["to"]) for o in ops] == [
        ("promote", "alice", 1, v2), ("rollback", "guard", v2, 1)]
    registry.set_alias("canary", v2)
    registry.delete_alias("canary")
    registry.delete_alias("canary")  # deleting a missing alias is not an error
    assert "canary" not in registry.aliases()
    with pytest.raises(RegistryError, match="no version 99"):
        registry.get_version(99)


def test_unreachable_tracking_server_is_a_clear_error(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(RegistryError, match="unreachable"):
        Registry(RegistryConfig(tracking_uri=f"http://127.0.0.1:{port}", http_timeout_s=2), tmp_path)
    assert time.monotonic() - start < 10
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(RegistryError, match="cannot create"):
        Registry(RegistryConfig(tracking_uri=f"sqlite:///{blocker}/sub/mlflow.db"), tmp_path)


def test_folder_digest_sees_every_file(drafter_folders, tmp_path):
    import shutil

    copy = Path(shutil.copytree(drafter_folders[0], tmp_path / "copy"))
    before = folder_digest(copy)
    (copy / "config.json").write_text((copy / "config.json").read_text() + " ")
    assert folder_digest(copy) != before


def test_concurrent_bootstraps_leave_one_static_champion(registry, drafter_folders):
    """Both pass the empty check; the first to create a version (the lower number) completes
    last, the order that once left two static versions."""
    import threading

    first, second = registry, Registry(registry.config, registry.home)
    both_checked, first_created = threading.Barrier(2), threading.Event()
    second_complete, second_looked = threading.Event(), threading.Event()

    def after_check(r):
        real = r.start_run
        r.start_run = lambda *a, **k: (both_checked.wait(60), real(*a, **k))[1]

    def ordered(r, create_after=None, created=None, complete_after=None, completed=None):
        """r's version is created after ``create_after`` and marked complete after ``complete_after``."""
        create, tag = r.client.create_model_version, r.client.set_model_version_tag

        def create_ordered(*a, **k):
            assert create_after is None or create_after.wait(60)
            mv = create(*a, **k)
            if created is not None:
                created.set()
            return mv

        def tag_ordered(model, version, key, value):
            finishing = key == TAG_REGISTRATION and value == "complete"
            if finishing:
                assert complete_after is None or complete_after.wait(60)
            tag(model, version, key, value)
            if finishing and completed is not None:
                completed.set()

        r.client.create_model_version, r.client.set_model_version_tag = create_ordered, tag_ordered

    def looked_after_completing(r):
        real = r.list_versions

        def list_versions(*a, **k):
            listed = real(*a, **k)
            if second_complete.is_set():
                second_looked.set()  # the first may complete only after the second has looked
            return listed

        r.list_versions = list_versions

    [after_check(r) for r in (first, second)]
    looked_after_completing(second)
    ordered(first, created=first_created, complete_after=second_looked)
    ordered(second, create_after=first_created, completed=second_complete)
    results, errors = {}, []

    def boot(name, r):
        try:
            results[name] = r.ensure_bootstrap(drafter_folders[0]).version
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=boot, args=item) for item in (("a", first), ("b", second))]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not errors, errors
    versions = registry.list_versions(include_incomplete=True)
    assert len(versions) == 1 and versions[0].kind == "static" and versions[0].version == 1
    assert results == {"a": 1, "b": 1} and registry.aliases() == {CHAMPION: 1}


# --- trust: a version's record is checked before it is used -----------------------------------

ROOT_URI = "file:///srv/tide/artifacts"


@pytest.mark.parametrize("source,ok", [
    (f"{ROOT_URI}/1/abc/artifacts/drafter", True),
    ("/srv/tide/artifacts/1/abc/artifacts/drafter", True),  # a bare path is a file URI
    (f"{ROOT_URI}/1/../../../../etc/drafter", False),
    (f"{ROOT_URI}/1/%2e%2e/%2e%2e/x/drafter", False),  # encoded dots decode to '..'
    ("file:///srv/tide/artifacts-evil/1/drafter", False),  # a prefix, not a parent
    ("file:///srv/tide/artifacts", False),  # the root itself
    ("file:///etc/drafter", False),
    ("http://evil.example/srv/tide/artifacts/1/drafter", False),
    ("s3://bucket/srv/tide/artifacts/1/drafter", False),
    (f"{ROOT_URI}/1/drafter?x=1", False),
    ("", False),
])
def test_source_must_lie_under_the_artifact_root(source, ok):
    from tide.registry import source_problem

    assert (source_problem(source, ROOT_URI) is None) == ok, source_problem(source, ROOT_URI)
    served = "mlflow-artifacts:/tide-retrain"
    assert source_problem(f"{served}/abc/artifacts/drafter", served) is None
    assert source_problem("mlflow-artifacts://other-host/tide-retrain/abc/drafter", served) is not None


def test_checksum_tags_must_be_64_hex():
    from tide.registry import tag_problem

    assert tag_problem("a" * 64, "b" * 64) is None and tag_problem("a" * 64, None) is None
    for bad in ("", "A" * 64, "a" * 63, "../../../../../tmp/x" + "a" * 44, "a" * 64 + "/"):
        assert tag_problem(bad, None) is not None, bad
    assert "weights" in tag_problem("a" * 64, "zz")


def _version_at(registry, folder, source, run_id=None, checksum=None):
    registry._ensure_model()
    mv = registry.client.create_model_version(
        registry.model_name, source, run_id=run_id,
        tags={TAG_CHECKSUM: checksum or folder_digest(folder), TAG_REGISTRATION: "complete"})
    return int(mv.version)


def test_untrusted_records_are_refused_before_any_download(registry, drafter_folders, tmp_path):
    import shutil

    from tide.registry import UntrustedVersion

    elsewhere = Path(shutil.copytree(drafter_folders[1], tmp_path / "elsewhere" / "drafter"))
    cases = {
        "tag": _version_at(registry, elsewhere, _register(registry, drafter_folders[1]).source,
                           checksum="/../../../../victim" + "0" * 45),
        "outside": _version_at(registry, elsewhere, elsewhere.as_uri()),
        "dotdot": _version_at(registry, elsewhere, f"{registry.artifact_root}/../../elsewhere/drafter"),
        "scheme": _version_at(registry, elsewhere, "http://127.0.0.1:9/drafter"),
    }
    # a run of another experiment, whose artifacts live outside the root, downloaded through it
    exp = registry.client.create_experiment(f"other-{uuid.uuid4().hex[:6]}",
                                            artifact_location=(tmp_path / "other-root").as_uri())
    run = registry.client.create_run(exp)
    registry.client.log_artifacts(run.info.run_id, str(drafter_folders[1]), "drafter")
    cases["other run"] = _version_at(registry, drafter_folders[1], f"{run.info.artifact_uri}/drafter",
                                     run_id=run.info.run_id)
    for what, version in cases.items():
        with pytest.raises(UntrustedVersion) as info:
            registry.download(version)
        words = "not 64 hex" if what == "tag" else "not under the artifact root"
        assert words in str(info.value), (what, info.value)
    assert not registry.cache_dir.exists()  # nothing was fetched, no path was made from a tag


def test_oversized_artifacts_are_refused_from_their_listing(store, drafter_folders, tmp_path):
    from tide.registry import UntrustedVersion

    root, uri = store
    cfg = RegistryConfig(tracking_uri=uri, registered_model_name=f"drafter-{uuid.uuid4().hex[:8]}",
                         artifact_location=(root / "artifacts").as_uri(), cache_dir=str(tmp_path / "cache"),
                         max_artifact_bytes=4096)  # below the tiny drafter's weights
    small = Registry(cfg, tmp_path / "home")
    version = _register(small, drafter_folders[1]).version
    with pytest.raises(UntrustedVersion, match="max_artifact_bytes"):
        small.download(version)
    assert not small.cache_dir.exists()  # refused before a byte was fetched


def test_a_run_outside_the_artifact_root_is_refused_at_start(store, tmp_path):
    root, uri = store
    name = f"exp-{uuid.uuid4().hex[:6]}"
    elsewhere = Registry(RegistryConfig(tracking_uri=uri, experiment_name=name,
                                        artifact_location=(tmp_path / "theirs").as_uri()), tmp_path / "a")
    elsewhere.start_run("theirs").finish()
    ours = Registry(RegistryConfig(tracking_uri=uri, experiment_name=name,
                                   artifact_location=(root / "artifacts").as_uri()), tmp_path / "b")
    with pytest.raises(RegistryError, match="not under the artifact root"):
        ours.start_run("retrain")
