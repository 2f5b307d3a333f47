"""The online retrain job (``tide train --online``): one process, runs to completion.

Steps of ``run_retrain``:
1. clean up after killed predecessors (pending registrations, RUNNING runs, work folders);
2. plan the data from dataset metadata (``tide/train/window.py``); too few recent training or
   held-out requests -> "nothing to do" (nothing else happens, no run is logged);
3. parent = the registry's ``champion``; on an empty registry the static drafter is registered
   first as version 1 / champion; with versions but no champion, the static drafter file is the
   parent (lineage "static");
4. load the target (embeddings and lm_head are the drafter's frozen inputs), the parent drafter,
   and a copy of it as the candidate: its vocab mapping (t2d/d2t) stays fixed;
5. load the planned samples; open an MLflow run and log params (window, counts, hyperparameters,
   parent, code version);
6. evaluate the parent on the held-out slice, train the candidate (warm start, time-capped),
   evaluate it on the same slice: simulated acceptance length at gamma = ``spec.draft_len`` and
   the EAGLE3 loss; log the loss curve and both evaluations;
7. save the candidate, log the folder with its digest, register a version tagged with its
   lineage and both acceptance lengths, alias ``challenger`` (``Registry.register``: a killed job
   leaves no registered version), close the run.
The result (status, version, run id, metrics) goes to ``--result-json`` for the scheduler.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tide.drafter.artifact import TargetSpec, load_drafter, round_weights_, save_drafter
from tide.drafter.static import static_drafter_path
from tide.drafter.vocab import mapping_digest
from tide.registry import (
    CHALLENGER,
    CHAMPION,
    TAG_CODE,
    TAG_KIND,
    TAG_PARENT,
    TAG_PARENT_SIM_ACCEPT,
    TAG_SIM_ACCEPT,
    TAG_WINDOW_END,
    TAG_WINDOW_START,
    Registry,
    code_version,
)
from tide.train.window import WindowPlan, WindowSpec, load_window, plan_window

log = logging.getLogger(__name__)

REGISTERED, NOTHING_TO_DO, FAILED = "registered", "nothing_to_do", "failed"


class RetrainInterrupted(BaseException):
    """SIGTERM arrived (the scheduler's timeout or shutdown): unwind, clean up, exit non-zero."""


@dataclass
class RetrainResult:
    status: str
    version: int | None = None
    run_id: str | None = None
    metrics: dict = field(default_factory=dict)
    reason: str = ""

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """What the scheduler records, small enough for a Kubernetes termination message (4 KiB)."""
        return {"status": self.status, "version": self.version, "run_id": self.run_id,
                "reason": self.reason[:1000]}


def data_dir_of(cfg) -> Path:
    chosen = cfg.train.data_dir or cfg.ingest.data_dir
    return Path(chosen) if chosen else cfg.home_path / "dataset"


def _work_root(cfg) -> Path:
    return cfg.home_path / "retrain"


def _reap_work_dirs(root: Path) -> None:
    """Remove work folders of dead retrain processes (named work-<pid>-*)."""
    if not root.is_dir():
        return
    for path in root.glob("work-*"):
        pid = path.name.split("-")[1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            shutil.rmtree(path, ignore_errors=True)


from tide.process import pid_alive as _alive  # noqa: E402


def _resolve_parent(cfg, registry: Registry) -> tuple[str, Path, float | None]:
    """(lineage label, drafter folder, its recorded sim accept length) of the warm start."""
    champion = registry.get_alias(CHAMPION)
    if champion is None and not registry.list_versions(include_incomplete=True, with_run=False):
        champion = registry.ensure_bootstrap(static_drafter_path(cfg))
    if champion is None:
        return "static", static_drafter_path(cfg), None
    return str(champion.version), registry.download(champion.version), champion.sim_accept_length


def plan_for(cfg, until_s: float | None = None) -> WindowPlan:
    spec = WindowSpec.from_config(cfg.train, target_model=cfg.model.model_id or None, until_s=until_s)
    return plan_window(data_dir_of(cfg), spec)


def _eval_metrics(prefix: str, ev) -> dict[str, float]:
    out = {f"{prefix}_sim_accept_length": ev.accept_length, f"{prefix}_heldout_loss": ev.loss}
    out.update({f"{prefix}_accept_rate_pos{i}": r for i, r in enumerate(ev.position_rates)})
    return out


def run_retrain(cfg, registry: Registry | None = None, until_s: float | None = None,
                progress: bool = False) -> RetrainResult:
    """One retrain (steps in the module docstring)."""
    import torch

    from tide.models.target import load_target  # target loading only; no engine is built
    from tide.train.trainer import evaluate, train

    t_start = time.monotonic()
    tc = cfg.train
    registry = registry or Registry.from_config(cfg)
    registry.reap_incomplete()
    _reap_work_dirs(_work_root(cfg))
    plan = plan_for(cfg, until_s)
    summary = plan.summary()
    if len(plan.recent) < tc.min_samples or len(plan.heldout) < tc.min_heldout_samples:
        reason = (f"{len(plan.recent)} recent training requests (need {tc.min_samples}), "
                  f"{len(plan.heldout)} held-out (need {tc.min_heldout_samples})")
        log.info("retrain: nothing to do: %s", reason)
        return RetrainResult(NOTHING_TO_DO, metrics=summary, reason=reason)

    parent, parent_folder, parent_recorded = _resolve_parent(cfg, registry)
    target, _, _ = load_target(cfg)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    champion = load_drafter(parent_folder, spec)
    candidate = copy.deepcopy(champion)
    vocab = mapping_digest(champion.d2t)
    data = load_window(data_dir_of(cfg), plan, tc.train_on_prompt, tc.max_seq_len)
    t_loaded = time.monotonic()
    log.info("retrain: parent %s, %d train samples (%d tokens), %d held-out (%d tokens)",
             parent, len(data.train), data.train_tokens, len(data.heldout), data.heldout_tokens)
    if len(data.train) < tc.min_samples or len(data.heldout) < tc.min_heldout_samples:
        return RetrainResult(NOTHING_TO_DO, metrics=summary,
                             reason=f"only {len(data.train)}/{len(data.heldout)} planned samples readable")

    code = code_version()
    run = registry.start_run(f"retrain-from-{parent}", {TAG_KIND: "retrain", TAG_PARENT: parent})
    work = Path(tempfile.mkdtemp(prefix=f"work-{os.getpid()}-", dir=_mkdir(_work_root(cfg))))
    try:
        gamma = cfg.spec.draft_len
        run.log_params({
            **summary, "parent_version": parent, "code_version": code, "target_model": cfg.model.model_id,
            "data_dir": str(data_dir_of(cfg)), "vocab_mapping": vocab, "gamma": gamma,
            "train_samples": len(data.train), "train_tokens": data.train_tokens,
            "heldout_samples": len(data.heldout), "missing_samples": data.missing,
            **{f"train.{k}": v for k, v in asdict(tc).items()},
        })
        embed, head = target.embed_weight, target.lm_head_weight
        eval_kw = dict(gamma=gamma, ttt_length=tc.ttt_length, step_weight=tc.step_weight_decay,
                       max_len=tc.max_seq_len, batch_tokens=tc.batch_tokens)
        t_eval = time.monotonic()
        before = evaluate(champion, embed, head, data.heldout, **eval_kw)
        eval_s = time.monotonic() - t_eval
        log.info("retrain: training (parent sim accept length %.3f; peak RSS %.2f GiB)",
                 before.accept_length, _peak_rss_gib())
        trained = train(candidate, embed, head, data.train, epochs=tc.epochs, lr=tc.lr,
                        batch_tokens=tc.batch_tokens, max_len=tc.max_seq_len, ttt_length=tc.ttt_length,
                        step_weight=tc.step_weight_decay, seed=tc.seed, progress=progress,
                        max_wall_s=tc.max_train_s, feature_weight=tc.feature_weight,
                        ce_weight=tc.ce_weight, train_head=tc.train_head)
        # stored and served in bf16, as the static drafter (half the bytes to stream per draft
        # token); rounded before evaluation so the registered metrics describe those weights
        round_weights_(candidate, torch.bfloat16)
        t_eval = time.monotonic()
        after = evaluate(candidate, embed, head, data.heldout, **eval_kw)
        eval_s += time.monotonic() - t_eval
        if mapping_digest(candidate.d2t) != vocab:
            raise RuntimeError("the vocab mapping changed during training")
        metrics = {**_eval_metrics("candidate", after), **_eval_metrics("champion", before),
                   "accept_length_gain": after.accept_length - before.accept_length,
                   "heldout_positions": after.positions, "train_steps": trained.steps,
                   "train_wall_s": trained.wall_s, "train_tokens_seen": trained.tokens_seen,
                   "train_tokens_per_s": trained.tokens_seen / max(1e-9, trained.wall_s),
                   "final_train_loss": trained.loss_curve[-1] if trained.loss_curve else float("nan"),
                   "load_s": t_loaded - t_start, "eval_s": eval_s, "peak_rss_gib": _peak_rss_gib()}
        run.log_series("train_loss", trained.loss_curve)
        run.log_series("train_step0_acc", trained.step0_acc_curve)
        log.info("retrain: sim accept length %.3f -> %.3f on %d held-out positions",
                 before.accept_length, after.accept_length, after.positions)
        lineage = {TAG_KIND: "retrain", TAG_PARENT: parent, TAG_CODE: code,
                   TAG_WINDOW_START: plan.window_start_s, TAG_WINDOW_END: plan.window_end_s,
                   "tide.recent_requests": len(plan.recent), "tide.replay_requests": len(plan.replay),
                   "tide.heldout_requests": len(data.heldout), "tide.train_tokens": data.train_tokens,
                   TAG_SIM_ACCEPT: round(after.accept_length, 4),
                   TAG_PARENT_SIM_ACCEPT: round(before.accept_length, 4),
                   "tide.heldout_positions": after.positions, "tide.run_id": run.run_id}
        folder = save_drafter(candidate, work / "drafter", metadata={
            "version": f"run-{run.run_id}", "parent_version": parent, "run_id": run.run_id,
            "data_window": [plan.window_start_s, plan.window_end_s], "target": cfg.model.model_id,
            "heldout_sim_accept_length": round(after.accept_length, 4),
            "parent_heldout_sim_accept_length": round(before.accept_length, 4),
            "parent_recorded_sim_accept_length": parent_recorded, "code_version": code}, dtype=torch.bfloat16)
        run.log_json("retrain.json", {"plan": summary, "metrics": metrics, "loss_curve": trained.loss_curve,
                                      "request_ids": {"recent": plan.recent, "replay": plan.replay,
                                                      "heldout": plan.heldout}})
        artifact = run.log_drafter(folder)
        metrics["total_s"] = time.monotonic() - t_start
        run.log_metrics(metrics)
        info = registry.register(artifact, lineage, alias=CHALLENGER,
                                 description=f"retrain of {parent} on {len(data.train)} requests")
        run.set_tags({"tide.registered_version": info.version})
        run.finish("FINISHED")
    except BaseException as exc:
        _finish_quietly(run, "KILLED" if isinstance(exc, (RetrainInterrupted, KeyboardInterrupt)) else "FAILED")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    log.info("retrain: registered %s version %d as %s", registry.model_name, info.version, CHALLENGER)
    try:  # ops.auto_promote: the registered version stands either way; a failed promotion is logged
        from tide.ops.promotion import maybe_auto_promote
        promotion = maybe_auto_promote(registry, cfg).to_dict()
    except Exception as exc:  # noqa: BLE001
        log.exception("retrain: auto-promotion failed")
        promotion = {"promote": False, "reason": f"auto-promotion failed: {type(exc).__name__}: {exc}"}
    return RetrainResult(REGISTERED, version=info.version, run_id=run.run_id,
                         metrics={**summary, **metrics, "auto_promotion": promotion})


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _finish_quietly(run, status: str) -> None:
    try:
        run.finish(status)
    except Exception as exc:  # the store may be what failed; reap_incomplete closes it later
        log.warning("retrain: could not mark run %s %s: %s", run.run_id, status, exc)


def export_window(cfg, out_dir: Path, include_heldout: bool = False) -> dict:
    """The current training window in SpecForge's offline format, with the champion's vocab."""
    from tide.train.specforge_export import export_specforge

    registry = Registry.from_config(cfg)
    champion = registry.get_alias(CHAMPION)
    folder = registry.download(champion.version) if champion else static_drafter_path(cfg)
    drafter = load_drafter(folder)
    return export_specforge(data_dir_of(cfg), plan_for(cfg), out_dir, drafter.d2t, drafter.t2d,
                            all_positions=cfg.train.train_on_prompt, include_heldout=include_heldout,
                            max_seq_len=cfg.train.max_seq_len)


def run_cli(cfg, result_json: str | None, progress: bool = False, summary_json: str | None = None) -> int:
    """``tide train --online``: exit 0 when a version was registered or there was nothing to do,
    1 on failure, 143 on SIGTERM; the result JSON is written in every case, and the summary
    (status, version, run id, reason) to ``summary_json`` (a Job's ``/dev/termination-log``)."""
    def on_term(signum, frame):
        raise RetrainInterrupted(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        result = run_retrain(cfg, progress=progress)
        code = 0
    except RetrainInterrupted as exc:
        result, code = RetrainResult(FAILED, reason=f"interrupted ({exc})"), 143
    except Exception as exc:  # reported to the scheduler, which backs off
        log.exception("retrain failed")
        result, code = RetrainResult(FAILED, reason=f"{type(exc).__name__}: {exc}"), 1
    finally:
        signal.signal(signal.SIGTERM, previous)
    payload = json.dumps(result.to_json(), indent=1, default=str)
    if result_json:
        path = Path(result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(payload)
        os.replace(tmp, path)
    if summary_json:  # written in place: a termination log cannot be replaced by rename
        try:
            Path(summary_json).write_text(json.dumps(result.summary(), default=str))
        except OSError as exc:  # the result JSON and the exit code still say how it went
            log.warning("cannot write the summary to %s (%s)", summary_json, exc)
    print(payload, file=sys.stdout)
    return code
