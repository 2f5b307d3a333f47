"""A retrain's lineage (tide/train/online.py): where it starts, and what it registers.

Step 3, the warm start (``resolve_warm_start``): the registry's ``champion``, which is also the
baseline the candidate is compared against on held-out data. When the champion is a patch (a
shift's quick retrain, ``tide.patch``) and ``train.rebase_patches`` is on, the warm start is the
patch's newest non-patch ancestor instead (the static drafter file when that is "static"), while
the baseline stays the champion: the full retrain learns the new traffic from the window without
inheriting the patch's overfit to its small one, and goes in only if it beats what serves.

Step 7 (``register_candidate``): the trained candidate becomes a registered version. Saved in bf16
with its metadata (parent, baseline, run, data window, held-out acceptance lengths), logged to the
run with its digest and the plan's request ids, and registered as ``challenger`` with its lineage
tags: the window, request and token counts, the sim accept lengths (its own, its parent's, its
baseline's), whether it is a patch, and the table version and URI it read (``Registry.register``:
a killed job leaves no registered version).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    TAG_BASELINE,
    TAG_BASELINE_SIM_ACCEPT,
    TAG_CODE,
    TAG_DATA_URI,
    TAG_DATA_VERSION,
    TAG_HELDOUT_POSITIONS,
    TAG_HELDOUT_REQUESTS,
    TAG_KIND,
    TAG_PARENT,
    TAG_PARENT_SIM_ACCEPT,
    TAG_PATCH,
    TAG_RECENT_REQUESTS,
    TAG_REGISTERED_VERSION,
    TAG_REHEARSAL_POOL,
    TAG_REHEARSAL_REQUESTS,
    TAG_REPLAY_REQUESTS,
    TAG_RUN_ID,
    TAG_SIM_ACCEPT,
    TAG_TRAIN_TOKENS,
    TAG_WINDOW_END,
    TAG_WINDOW_START,
)
from tide.drafter.artifact import save_drafter
from tide.drafter.static import static_drafter_path
from tide.registry import Registry, RegistryError, VersionInfo
from tide.train.rehearsal import pool_path

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmStart:
    """Where a retrain starts (its parent) and what it is compared against (its baseline)."""

    parent: str  # lineage label of the warm start: "static" or a version
    folder: Path  # the parent's drafter folder
    recorded: float | None  # the parent's registered sim accept length
    baseline: str  # the champion the candidate would replace ("static" when there is none)
    baseline_folder: Path | None = None  # None: the parent is the baseline

    @property
    def rebased(self) -> bool:
        return self.baseline_folder is not None


def resolve_warm_start(cfg, registry: Registry) -> WarmStart:
    """Step 3 (module docstring). On an empty registry the static drafter is registered first as
    version 1 / champion; with versions but no champion, the static drafter file is both."""
    champion = registry.get_alias(CHAMPION)
    if champion is None and not registry.list_versions(include_incomplete=True, with_run=False):
        champion = registry.ensure_bootstrap(static_drafter_path(cfg))
    if champion is None:
        return WarmStart("static", static_drafter_path(cfg), None, "static")
    label, folder = str(champion.version), registry.download(champion.version)
    own = WarmStart(label, folder, champion.sim_accept_length, label)
    if not (cfg.train.rebase_patches and _is_patch(champion)):
        return own
    try:
        start = _before_patches(registry, champion)
        if start is None:
            return WarmStart("static", static_drafter_path(cfg), None, label, folder)
        return WarmStart(str(start.version), registry.download(start.version), start.sim_accept_length, label, folder)
    except (RegistryError, ValueError) as exc:  # an ancestor deleted or unreadable: start from the patch
        log.warning("retrain: champion %s is a patch but its ancestors cannot be read (%s): warm start from it",
                    label, exc)
        return own


def _is_patch(info: VersionInfo) -> bool:
    return info.tags.get(TAG_PATCH, "") == "true"


def _before_patches(registry: Registry, info: VersionInfo) -> VersionInfo | None:
    """The newest ancestor of ``info`` that is no patch (None: the static drafter file)."""
    seen = {info.version}
    while _is_patch(info):
        parent = info.parent_version
        if parent == "static":
            return None
        info = registry.get_version(int(parent))  # ValueError on a label that is no version
        if info.version in seen:
            raise ValueError(f"lineage cycle at version {info.version}")
        seen.add(info.version)
    return info


def register_candidate(cfg, registry: Registry, run, inputs, trained, code: str, work: Path):
    """Save the candidate, log it with its digest, register it as ``challenger``; returns the version info.

    ``inputs`` and ``trained`` are the online retrain's ``_Inputs`` (plan, data, parent, candidate) and
    ``_Trained`` (both evaluations, loss curve, metrics); ``run`` is its open MLflow run."""
    import torch

    plan, data, before, after = inputs.plan, inputs.data, trained.before, trained.after
    start = inputs.start
    lineage = {TAG_KIND: "retrain", TAG_PARENT: start.parent, TAG_CODE: code,
               TAG_WINDOW_START: plan.window_start_s, TAG_WINDOW_END: plan.window_end_s,
               TAG_RECENT_REQUESTS: len(plan.recent), TAG_REPLAY_REQUESTS: len(plan.replay),
               TAG_HELDOUT_REQUESTS: len(data.heldout), TAG_TRAIN_TOKENS: data.train_tokens,
               TAG_SIM_ACCEPT: round(after.accept_length, 4),
               TAG_PARENT_SIM_ACCEPT: round(before.accept_length, 4),
               TAG_BASELINE: start.baseline, TAG_BASELINE_SIM_ACCEPT: round(trained.baseline.accept_length, 4),
               TAG_HELDOUT_POSITIONS: after.positions, TAG_RUN_ID: run.run_id,
               TAG_DATA_VERSION: plan.data_version, TAG_DATA_URI: plan.data_uri}
    if plan.rehearsal:
        lineage.update({TAG_REHEARSAL_REQUESTS: plan.rehearsal, TAG_REHEARSAL_POOL: pool_path(cfg).name})
    if cfg.train.patch:
        lineage[TAG_PATCH] = "true"
    folder = save_drafter(inputs.candidate, work / "drafter", metadata={
        "version": f"run-{run.run_id}", "parent_version": start.parent, "baseline_version": start.baseline,
        "run_id": run.run_id,
        "data_window": [plan.window_start_s, plan.window_end_s], "target": cfg.model.model_id,
        "heldout_sim_accept_length": round(after.accept_length, 4),
        "parent_heldout_sim_accept_length": round(before.accept_length, 4),
        "parent_recorded_sim_accept_length": start.recorded, "code_version": code}, dtype=torch.bfloat16)
    run.log_json("retrain.json", {"plan": plan.summary(), "metrics": trained.metrics,
                                  "loss_curve": trained.loss_curve,
                                  "request_ids": {"recent": plan.recent, "replay": plan.replay,
                                                  "heldout": plan.heldout}})
    artifact = run.log_drafter(folder)
    run.log_metrics(trained.metrics)
    info = registry.register(artifact, lineage, alias=CHALLENGER,
                             description=f"retrain of {start.parent} on {len(data.train)} requests"
                             + (f", to replace {start.baseline}" if start.rebased else "")
                             + (" (a patch)" if cfg.train.patch else ""))
    run.set_tags({TAG_REGISTERED_VERSION: info.version})
    return info
