"""Step 7 of the online retrain (tide/train/online.py): the trained candidate becomes a registered
version. Saved in bf16 with its metadata (parent, run, data window, held-out acceptance lengths),
logged to the run with its digest and the plan's request ids, and registered as ``challenger`` with
its lineage tags: the window, request and token counts, both sim accept lengths, and the table
version and URI it read (``Registry.register``: a killed job leaves no registered version).
"""
from __future__ import annotations

from pathlib import Path

from tide.contracts import (
    CHALLENGER,
    TAG_CODE,
    TAG_DATA_URI,
    TAG_DATA_VERSION,
    TAG_HELDOUT_POSITIONS,
    TAG_HELDOUT_REQUESTS,
    TAG_KIND,
    TAG_PARENT,
    TAG_PARENT_SIM_ACCEPT,
    TAG_RECENT_REQUESTS,
    TAG_REGISTERED_VERSION,
    TAG_REPLAY_REQUESTS,
    TAG_RUN_ID,
    TAG_SIM_ACCEPT,
    TAG_TRAIN_TOKENS,
    TAG_WINDOW_END,
    TAG_WINDOW_START,
)
from tide.drafter.artifact import save_drafter
from tide.registry import Registry


def register_candidate(cfg, registry: Registry, run, inputs, trained, code: str, work: Path):
    """Save the candidate, log it with its digest, register it as ``challenger``; returns the version info.

    ``inputs`` and ``trained`` are the online retrain's ``_Inputs`` (plan, data, parent, candidate) and
    ``_Trained`` (both evaluations, loss curve, metrics); ``run`` is its open MLflow run."""
    import torch

    plan, data, before, after = inputs.plan, inputs.data, trained.before, trained.after
    lineage = {TAG_KIND: "retrain", TAG_PARENT: inputs.parent, TAG_CODE: code,
               TAG_WINDOW_START: plan.window_start_s, TAG_WINDOW_END: plan.window_end_s,
               TAG_RECENT_REQUESTS: len(plan.recent), TAG_REPLAY_REQUESTS: len(plan.replay),
               TAG_HELDOUT_REQUESTS: len(data.heldout), TAG_TRAIN_TOKENS: data.train_tokens,
               TAG_SIM_ACCEPT: round(after.accept_length, 4),
               TAG_PARENT_SIM_ACCEPT: round(before.accept_length, 4),
               TAG_HELDOUT_POSITIONS: after.positions, TAG_RUN_ID: run.run_id,
               TAG_DATA_VERSION: plan.data_version, TAG_DATA_URI: plan.data_uri}
    folder = save_drafter(inputs.candidate, work / "drafter", metadata={
        "version": f"run-{run.run_id}", "parent_version": inputs.parent, "run_id": run.run_id,
        "data_window": [plan.window_start_s, plan.window_end_s], "target": cfg.model.model_id,
        "heldout_sim_accept_length": round(after.accept_length, 4),
        "parent_heldout_sim_accept_length": round(before.accept_length, 4),
        "parent_recorded_sim_accept_length": inputs.parent_recorded, "code_version": code}, dtype=torch.bfloat16)
    run.log_json("retrain.json", {"plan": plan.summary(), "metrics": trained.metrics,
                                  "loss_curve": trained.loss_curve,
                                  "request_ids": {"recent": plan.recent, "replay": plan.replay,
                                                  "heldout": plan.heldout}})
    artifact = run.log_drafter(folder)
    run.log_metrics(trained.metrics)
    info = registry.register(artifact, lineage, alias=CHALLENGER,
                             description=f"retrain of {inputs.parent} on {len(data.train)} requests")
    run.set_tags({TAG_REGISTERED_VERSION: info.version})
    return info
