"""The online retrain job (``tide train --online``): one process, runs to completion.

Steps of ``run_retrain``:
1. clean up after killed predecessors (pending registrations, RUNNING runs, work folders);
2. plan the data on one pinned table version (``tide/train/window.py``); too few recent training or
   held-out requests -> "nothing to do" (nothing else happens, no run is logged);
3. parent = the registry's ``champion``, the baseline it is compared against; a champion that is
   a shift's patch is the baseline while its newest non-patch ancestor is the warm start
   (``train.rebase_patches``; tide/train/lineage.py); on an empty registry the static drafter is
   registered first as version 1 / champion; with versions but no champion, the static drafter
   file is both (lineage "static");
4. load the target's embeddings and lm_head (the drafter's frozen inputs; its layers are never
   run here), the parent drafter, and a copy of it as the candidate: its vocab mapping (t2d/d2t)
   stays fixed;
5. load the planned samples (and the plan's rehearsal: tide/train/rehearsal.py), their hidden states into a local file read back per batch
   (``tide/train/spill.py``: memory is set by ``train.batch_tokens``, not the window); open an MLflow run and log params (window, counts, hyperparameters,
   parent, code version);
6. evaluate the parent (and a baseline that is not the parent) on the held-out slice, train the
   candidate (warm start, time-capped), keep ``train.update_fraction`` of its change (less when a workload
   would lose too much: tide/train/fraction.py) and evaluate it on the same slice: simulated acceptance
   length at gamma = ``spec.draft_len`` and the EAGLE3 loss, overall and per workload tag; log the loss
   curve and both evaluations;
7. save the candidate, log the folder with its digest, register a version tagged with its
   lineage (the table version and URI it read among them) and both acceptance lengths, alias
   ``challenger`` (tide/train/lineage.py; ``Registry.register``: a killed job leaves no registered
   version), close the run.
The result (status, version, run id, metrics, the table version read) goes to ``--result-json``.
``train.data_version`` (``TIDE_TRAIN__DATA_VERSION``) re-runs a retrain on a registered version's
``tide.data_table_version``: the same window, replay and held-out requests.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tide.contracts import (
    CHALLENGER,
    CHAMPION,
    RESULT_DATA_WATERMARK,
    RETRAIN_FAILED,
    RETRAIN_NOTHING_TO_DO,
    RETRAIN_REGISTERED,
    TAG_KIND,
    TAG_PARENT,
)
from tide.dataset.location import Location
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.static import static_drafter_path
from tide.drafter.vocab import mapping_digest
from tide.registry import Registry, code_version
from tide.train.confidence import fit_for_retrain
from tide.train.lineage import WarmStart, register_candidate, resolve_warm_start
from tide.train.memory import PhaseMemory
from tide.train.ranks import announce, current_ranks, run_rank, start, train_kwargs
from tide.train.rehearsal import load_training, rehearsal_count, rehearsal_pool
from tide.train.window import WindowData, WindowPlan, WindowSpec, plan_window

log = logging.getLogger(__name__)


class RetrainInterrupted(BaseException):
    """SIGTERM arrived (the scheduler's timeout or shutdown): unwind, clean up, exit non-zero."""


@dataclass
class RetrainResult:
    status: str
    version: int | None = None
    run_id: str | None = None
    metrics: dict = field(default_factory=dict)
    reason: str = ""
    data_version: int | None = None  # the table version read (plan_window)

    def to_json(self) -> dict:
        data = asdict(self)
        data[RESULT_DATA_WATERMARK] = data.pop("data_version")
        return data

    def summary(self) -> dict:
        """What the scheduler records, small enough for a Kubernetes termination message (4 KiB)."""
        return {"status": self.status, "version": self.version, "run_id": self.run_id,
                "reason": self.reason[:1000], RESULT_DATA_WATERMARK: self.data_version}


def data_dir_of(cfg) -> Location:
    """The dataset table a retrain reads: ``train.data_dir``, else ingest's."""
    return Location.from_config(cfg, cfg.train.data_dir or None)


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


def plan_for(cfg, until_s: float | None = None, version: int | None = None) -> WindowPlan:
    spec = WindowSpec.from_config(cfg.train, target_model=cfg.model.model_id or None, until_s=until_s,
                                  version=version)
    plan = plan_window(data_dir_of(cfg), spec)
    plan.rehearsal = rehearsal_count(cfg.train, plan)
    return plan


def _eval_metrics(prefix: str, ev) -> dict[str, float]:
    out = {f"{prefix}_sim_accept_length": ev.accept_length, f"{prefix}_heldout_loss": ev.loss,
           f"{prefix}_replayed_accept_length": ev.replayed_accept_length}
    out.update({f"{prefix}_accept_rate_pos{i}": r for i, r in enumerate(ev.position_rates)})
    # per workload tag: what a candidate gains on the new traffic and gives up on the old; at most
    # heldout_max_samples tags, and tags ([A-Za-z0-9_.:-]) are valid in MLflow's metric names
    out.update({f"{prefix}_sim_accept_length.{tag}": acc for tag, (acc, _) in ev.by_group.items()})
    return out


def _by_workload(baseline, after) -> str:
    """"chat 2.31->2.25 (140), code 1.90->2.62 (2210)": champion -> candidate (held-out positions)."""
    return ", ".join(f"{tag} {baseline.by_group[tag][0]:.2f}->{acc:.2f} ({n})"
                     for tag, (acc, n) in sorted(after.by_group.items(), key=lambda kv: -kv[1][1]))


@dataclass
class _Inputs:
    """What a retrain reads before it trains: the window, its parent drafter and the target."""

    plan: WindowPlan
    start: WarmStart  # the parent (warm start) and the baseline (the champion it would replace)
    target: object  # TargetHeads: embeddings and lm_head, the drafter's frozen inputs
    champion: object  # Eagle3Drafter, the parent
    baseline: object | None  # Eagle3Drafter, the baseline when it is not the parent
    candidate: object  # a copy of the parent, trained in place; its vocab mapping stays fixed
    vocab: str
    data: WindowData
    loaded_at: float


@dataclass
class _Trained:
    before: object  # evaluation of the parent on the held-out slice
    baseline: object  # evaluation of the baseline on the same slice (``before`` when it is the parent)
    after: object  # evaluation of the candidate on the same slice
    loss_curve: list
    metrics: dict


def run_retrain(cfg, registry: Registry | None = None, until_s: float | None = None,
                progress: bool = False) -> RetrainResult:
    """One retrain: plan, load, train and evaluate, register (steps in the module docstring)."""
    t_start = time.monotonic()
    memory = PhaseMemory()
    with memory.phase("plan"):
        registry = registry or Registry.from_config(cfg)
        registry.reap_incomplete()
        _reap_work_dirs(_work_root(cfg))
        plan = plan_for(cfg, until_s)
    summary = plan.summary()
    short = _too_few(cfg.train, len(plan.recent), len(plan.heldout), "planned")
    if short:
        log.info("retrain: nothing to do: %s", short)
        announce(None, None)
        return RetrainResult(RETRAIN_NOTHING_TO_DO, metrics=summary, reason=short, data_version=plan.data_version)
    inputs = _load_inputs(cfg, registry, plan, memory)
    summary = plan.summary()  # the rehearsal the pool could give (tide/train/rehearsal.py)
    short = _too_few(cfg.train, len(inputs.data.train), len(inputs.data.heldout), "readable")
    if short:
        return RetrainResult(RETRAIN_NOTHING_TO_DO, metrics=summary, reason=short, data_version=plan.data_version)

    code = code_version()
    run = registry.start_run(f"retrain-from-{inputs.start.parent}", {TAG_KIND: "retrain", TAG_PARENT: inputs.start.parent})
    work = Path(tempfile.mkdtemp(prefix=f"work-{os.getpid()}-", dir=_mkdir(_work_root(cfg))))
    try:
        _log_params(run, cfg, inputs, summary, code)
        trained = _train_and_evaluate(cfg, inputs, run, progress, memory, work)
        trained.metrics["load_s"] = inputs.loaded_at - t_start
        with memory.phase("register"):
            info = register_candidate(cfg, registry, run, inputs, trained, code, work)
        trained.metrics.update({"total_s": time.monotonic() - t_start, **memory.metrics(), **_cpu_use()})
        run.log_metrics({"total_s": trained.metrics["total_s"], **memory.metrics(), "cpu_s": trained.metrics["cpu_s"]})
        run.finish("FINISHED")
    except BaseException as exc:
        _finish_quietly(run, "KILLED" if isinstance(exc, (RetrainInterrupted, KeyboardInterrupt)) else "FAILED")
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        inputs.data.close()
    log.info("retrain: registered %s version %d as %s", registry.model_name, info.version, CHALLENGER)
    metrics = {**summary, **trained.metrics, "auto_promotion": _auto_promote(registry, cfg)}
    return RetrainResult(RETRAIN_REGISTERED, info.version, run.run_id, metrics, data_version=plan.data_version)


def _cpu_use() -> dict:
    """CPU seconds this job used (its ranks and helpers included), the CPUs it may run on and its
    niceness: what it took from the machine it shares with the engine (schedule.local_cpus)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"cpu_s": own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime,
            "cpus": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0)}


def _too_few(tc, train: int, heldout: int, what: str) -> str:
    """Why there is nothing to do ('' when there is enough)."""
    if train >= tc.min_samples and heldout >= tc.min_heldout_samples:
        return ""
    return (f"{train} {what} training requests (need {tc.min_samples}), "
            f"{heldout} held-out (need {tc.min_heldout_samples})")


def _load_inputs(cfg, registry: Registry, plan: WindowPlan, memory: PhaseMemory) -> _Inputs:
    """Steps 3-5: the parent (warm start), the target, and the planned samples."""
    from tide.models.target import load_target_heads  # embeddings + lm_head only; no engine is built

    with memory.phase("target"):
        start = resolve_warm_start(cfg, registry)
        pool = rehearsal_pool(cfg) if plan.rehearsal else None  # cached before other ranks look for it
        announce(plan, start.folder)
        target = load_target_heads(cfg)
        spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
        champion = load_drafter(start.folder, spec)
        baseline = load_drafter(start.baseline_folder, spec) if start.rebased else None
    with memory.phase("window"):
        # hidden states to a local file, read back per batch: memory does not grow with the window
        data = load_training(cfg, data_dir_of(cfg), plan, _work_root(cfg), pool)
    log.info("retrain: parent %s%s, %d train samples (%d tokens; %d rehearsed), %d held-out (%d tokens)",
             start.parent, f" (rebased past patch {start.baseline})" if start.rebased else "",
             len(data.train), data.train_tokens, plan.rehearsal, len(data.heldout), data.heldout_tokens)
    return _Inputs(plan, start, target, champion, baseline, copy.deepcopy(champion),
                   mapping_digest(champion.d2t), data, time.monotonic())


def _log_params(run, cfg, inputs: _Inputs, summary: dict, code: str) -> None:
    data = inputs.data
    run.log_params({
        **summary, "parent_version": inputs.start.parent, "baseline_version": inputs.start.baseline, "code_version": code, "target_model": cfg.model.model_id,
        "data_dir": data_dir_of(cfg).describe(), "vocab_mapping": inputs.vocab, "gamma": cfg.spec.draft_len,
        "train_samples": len(data.train), "train_tokens": data.train_tokens,
        "heldout_samples": len(data.heldout), "missing_samples": data.missing,
        **{f"train.{k}": v for k, v in cfg.train.model_dump().items()},
    })


def _train_and_evaluate(cfg, inputs: _Inputs, run, progress: bool, memory: PhaseMemory, work: Path) -> _Trained:
    """Step 6: evaluate the parent, train the candidate, evaluate it on the same held-out slice."""
    from tide.train.fraction import keep_fraction
    from tide.train.trainer import evaluate, prepare, train

    tc, data = cfg.train, inputs.data
    device = start(cfg)
    embed, head = inputs.target.embed_weight, inputs.target.lm_head_weight
    eval_kw = dict(gamma=cfg.spec.draft_len, ttt_length=tc.ttt_length, step_weight=tc.step_weight_decay,
                   max_len=tc.max_seq_len, batch_tokens=tc.batch_tokens, device=device,
                   groups=data.heldout_workloads)
    t_eval = time.monotonic()
    with memory.phase("eval_parent"):
        before = evaluate(inputs.champion, embed, head, data.heldout, **eval_kw)
        baseline = before if inputs.baseline is None else evaluate(inputs.baseline, embed, head, data.heldout,
                                                                   **eval_kw)
    eval_s = time.monotonic() - t_eval
    log.info("retrain: training (parent sim accept length %.3f; peak RSS %.2f GiB)",
             before.accept_length, memory.process_peak_gib)
    with memory.phase("teacher"):  # the target's top tokens, once per training sample
        prepare(data.train, inputs.candidate, head.to(device))  # the full-vocab projection: on the GPU if any
    with memory.phase("train"):
        if tc.backend == "specforge":  # SpecForge's trainer; its result comes back validated
            from tide.train.specforge_backend import train_specforge
            inputs.candidate, trained = train_specforge(cfg, inputs, work, data_dir_of(cfg))
        else:
            trained = train(inputs.candidate, embed, head, data.train, device=device, **train_kwargs(tc, progress))
    t_eval = time.monotonic()
    with memory.phase("eval_candidate"):  # either backend's result; stored and served in bf16, as the
        # static drafter (half the bytes to stream per draft token): the metrics describe those weights
        kept = keep_fraction(inputs.candidate, inputs.champion,
                             lambda drafter: evaluate(drafter, embed, head, data.heldout, **eval_kw), before, tc)
    inputs.candidate, after = kept.drafter, kept.evaluation
    eval_s += time.monotonic() - t_eval
    if len(kept.tried) > 1:
        log.info("retrain: update fraction %g (workloads under %.2f of the parent's: %s)", kept.fraction,
                 tc.keep_workloads, kept.describe())
    with memory.phase("confidence"):
        inputs.candidate.confidence, confidence = fit_for_retrain(cfg, inputs.candidate, inputs.target, data)
    if mapping_digest(inputs.candidate.d2t) != inputs.vocab:
        raise RuntimeError("the vocab mapping changed during training")
    metrics = {**_eval_metrics("candidate", after), **_eval_metrics("champion", baseline),
               **(_eval_metrics("parent", before) if inputs.baseline is not None else {}),
               "accept_length_gain": after.accept_length - baseline.accept_length,
               "heldout_positions": after.positions, "train_steps": trained.steps,
               "update_fraction_kept": kept.fraction, "update_fractions_tried": len(kept.tried),
               **{f"heldout_positions.{tag}": n for tag, (_, n) in after.by_group.items()},
               "train_wall_s": trained.wall_s, "train_tokens_seen": trained.tokens_seen,
               "train_tokens_per_s": trained.tokens_seen / max(1e-9, trained.wall_s),
               "train_ranks": current_ranks().world, "train_on_gpu": int(device.type == "cuda"),
               "final_train_loss": trained.loss_curve[-1] if trained.loss_curve else float("nan"),
               "eval_s": eval_s, **confidence, **memory.metrics()}
    run.log_series("train_loss", trained.loss_curve)
    run.log_series("train_step0_acc", trained.step0_acc_curve)
    log.info("retrain: sim accept length %.3f (champion) -> %.3f on %d held-out positions; by workload: %s",
             baseline.accept_length, after.accept_length, after.positions, _by_workload(baseline, after))
    return _Trained(before, baseline, after, trained.loss_curve, metrics)


def _auto_promote(registry: Registry, cfg) -> dict:
    """ops.auto_promote, decided by the alias owner on the aliases as they are then (tide/ops/aliases.py):
    the registered version stands either way; a failed promotion is logged."""
    try:
        from tide.ops.alias_api import auto_promote_after_retrain
        return auto_promote_after_retrain(registry, cfg)
    except Exception as exc:  # noqa: BLE001
        log.exception("retrain: auto-promotion failed")
        return {"promote": False, "reason": f"auto-promotion failed: {type(exc).__name__}: {exc}"}


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

    if not current_ranks().is_main:  # torchrun's other ranks: train only; rank 0 reports
        return run_rank(cfg, data_dir_of(cfg), _work_root(cfg))
    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        start(cfg)  # the device first: a cuda retrain without a GPU fails before any work
        if cfg.train.backend == "specforge":  # so does a SpecForge one without SpecForge or a GPU
            from tide.train.specforge_backend import require
            require(current_ranks().world)
        result = run_retrain(cfg, progress=progress)
        code = 0
    except RetrainInterrupted as exc:
        result, code = RetrainResult(RETRAIN_FAILED, reason=f"interrupted ({exc})"), 143
    except Exception as exc:  # reported to the scheduler, which backs off
        log.exception("retrain failed")
        result, code = RetrainResult(RETRAIN_FAILED, reason=f"{type(exc).__name__}: {exc}"), 1
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
