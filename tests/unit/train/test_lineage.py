"""Where a retrain starts and what it is compared against (tide/train/lineage.py), against a real
MLflow SQLite store."""
from __future__ import annotations

import pytest

from tide.config import load_config
from tide.contracts import (
    CHAMPION,
    TAG_KIND,
    TAG_PARENT,
    TAG_PATCH,
    TAG_SIM_ACCEPT,
)
from tide.drafter.artifact import save_drafter
from tide.drafter.static import static_drafter_path
from tide.train.lineage import resolve_warm_start


@pytest.fixture(scope="module")
def folder(tiny_drafter, tmp_path_factory):
    return save_drafter(tiny_drafter, tmp_path_factory.mktemp("drafter") / "d", metadata={"version": "x"})


def cfg_of(tmp_path, rebase: bool = True):
    return load_config(env={}, overrides={"home": str(tmp_path / "home"), "train": {"rebase_patches": rebase}})


def add(registry, folder, parent: str, sim: float, patch: bool = False, champion: bool = False) -> int:
    run = registry.start_run("test", {TAG_KIND: "retrain"})
    tags = {TAG_KIND: "retrain", TAG_PARENT: parent, TAG_SIM_ACCEPT: sim, **({TAG_PATCH: "true"} if patch else {})}
    info = registry.register(run.log_drafter(folder), tags, alias=CHAMPION if champion else None)
    run.finish()
    return info.version


def test_a_patch_champion_is_the_baseline_and_its_parent_the_warm_start(registry, folder, tmp_path):
    v1 = add(registry, folder, "static", 2.0)
    v2 = add(registry, folder, str(v1), 2.4, patch=True, champion=True)
    start = resolve_warm_start(cfg_of(tmp_path), registry)
    assert (start.parent, start.baseline, start.rebased, start.recorded) == (str(v1), str(v2), True, 2.0)
    assert (start.folder / "model.safetensors").exists() and (start.baseline_folder / "model.safetensors").exists()
    assert start.folder != start.baseline_folder


def test_a_chain_of_patches_rebases_to_the_newest_non_patch(registry, folder, tmp_path):
    v1 = add(registry, folder, "static", 2.0)
    v2 = add(registry, folder, str(v1), 2.2)
    v3 = add(registry, folder, str(v2), 2.4, patch=True)
    v4 = add(registry, folder, str(v3), 2.5, patch=True, champion=True)
    start = resolve_warm_start(cfg_of(tmp_path), registry)
    assert (start.parent, start.baseline, start.recorded) == (str(v2), str(v4), 2.2)


def test_a_patch_of_the_static_file_rebases_to_the_static_file(registry, folder, tmp_path):
    v1 = add(registry, folder, "static", 2.4, patch=True, champion=True)
    cfg = cfg_of(tmp_path)
    start = resolve_warm_start(cfg, registry)
    assert (start.parent, start.baseline, start.folder) == ("static", str(v1), static_drafter_path(cfg))


@pytest.mark.parametrize("case", ["not_a_patch", "rebase_off", "ancestor_deleted"])
def test_otherwise_the_champion_is_both(registry, folder, tmp_path, case):
    v1 = add(registry, folder, "static", 2.0)
    v2 = add(registry, folder, str(v1), 2.4, patch=case != "not_a_patch", champion=True)
    if case == "ancestor_deleted":
        registry.delete_version(v1)
    start = resolve_warm_start(cfg_of(tmp_path, rebase=case != "rebase_off"), registry)
    assert (start.parent, start.baseline, start.rebased, start.recorded) == (str(v2), str(v2), False, 2.4)
