"""The plugin SGLang loads: entry point ``tide`` of group ``sglang.srt.plugins`` (pyproject.toml).

SGLang's ``load_plugins()`` runs ``register`` in each of its processes (server, tokenizer,
scheduler, detokenizer) before any model load, then ``HookRegistry.apply_hooks()`` patches the
targets below. Inert unless the server was started by TIDE (``TIDE_SGLANG_CONFIG`` set, see
server_args.py), so installing TIDE next to SGLang changes nothing by itself. Hooks:
1. BEFORE ``Scheduler.__init__``: the start-up checks (server_args.py, and with capture on, that the
   speculative worker SGLang builds is the hooked ``EAGLEWorkerV2``; a clear error, the scheduler
   does not start), then this process's capture context: the TIDE config, the tap and producer
   thread (only on the capturing rank, see ``capture_rank``: the other ranks compute the same rows);
2. AFTER ``ModelRunner.init_attention_backends`` of the *target* runner (before its CUDA graphs
   are captured): its LogitsProcessor also returns the final normed hidden states
   (``last_hidden_states``, SGLang's own field for aux-capture mode), so the prefill and verify
   graphs write them into their static output buffers on every replay;
3. AFTER ``EAGLEWorkerV2.verify`` (``batch.spec_info`` is still the verify input there, and the
   target's verify outputs are not yet overwritten by the draft extend that follows) and AROUND
   ``EAGLEWorkerV2._forward_prefill_batch`` (the chunk lengths are read before the draft extend
   rewrites the batch's): the capture of this verify or prefill (capture.py), attached as the
   result's device auxiliary output.
``load_draft`` is the ``--custom-weight-loader`` of TIDE's draft-only swaps (weights.py): SGLang
calls it with ``update_weights_from_tensor(selector="draft")`` between scheduler iterations.
Nothing raised here may reach SGLang's loop after start-up: failures are logged and counted.
Module imports are standard library only: ``register`` runs in SGLang's main process *before* it
sets PROMETHEUS_MULTIPROC_DIR, and importing prometheus_client (tide.metrics) there would keep
that process's metrics out of the multiprocess registry. TIDE's modules load inside the hooks.
"""
from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

from tide.engine.sglang import server_args

log = logging.getLogger(__name__)

CONFIG_ENV, VERSION_ENV = server_args.CONFIG_ENV, server_args.VERSION_ENV
HOOK_TARGETS = {
    "startup": "sglang.srt.managers.scheduler.Scheduler.__init__",
    "final_hidden": "sglang.srt.model_executor.model_runner.ModelRunner.init_attention_backends",
    "verify": "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2.verify",
    "prefill": "sglang.srt.speculative.eagle_worker_v2.EAGLEWorkerV2._forward_prefill_batch",
}


class _Process:
    """What the plugin holds in one scheduler process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.version = os.environ.get(VERSION_ENV) or "unknown"
        self.ctx: Any = None  # capture.CaptureContext
        self.tap: Any = None


PROCESS = _Process()


def active() -> bool:
    return CONFIG_ENV in os.environ


def register() -> None:
    """The entry point: register the hooks with SGLang's HookRegistry (applied by SGLang)."""
    if not active():
        log.info("TIDE plugin installed but inactive (%s not set)", CONFIG_ENV)
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_TARGETS["startup"], on_scheduler_init, HookType.BEFORE)
    HookRegistry.register(HOOK_TARGETS["final_hidden"], after_attention_backends, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS["verify"], after_verify, HookType.AFTER)
    HookRegistry.register(HOOK_TARGETS["prefill"], around_prefill, HookType.AROUND)
    log.info("TIDE plugin registered its hooks")


def _load_config():
    from tide.config import load_config

    path = os.environ.get(CONFIG_ENV) or None
    return load_config(path)


def on_scheduler_init(scheduler: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE ``Scheduler.__init__(self, server_args, port_args)``: raise on an unsupported server,
    else set up capture. Arguments are read by name: SGLang may pass them either way."""
    import sglang

    sargs = scheduler_arguments(scheduler, args, kwargs)["server_args"]
    cfg = _load_config()
    server_args.check_startup(sglang.__version__, sargs, cfg.capture.enabled)
    if cfg.capture.enabled:
        check_speculative_worker(sargs)
    start_capture(cfg, str(sargs.model_path), cfg.capture.enabled and capture_rank(sargs))


def scheduler_arguments(scheduler: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """``Scheduler.__init__``'s arguments by name, bound as Python binds them for the original (which
    raises itself for any it misses)."""
    import inspect

    from sglang.srt.managers.scheduler import Scheduler

    # the patched __init__ keeps the original's signature (functools.wraps sets __wrapped__)
    return inspect.signature(Scheduler.__init__).bind_partial(scheduler, *args, **kwargs).arguments


def check_speculative_worker(args: Any) -> None:
    """Capture hooks ``EAGLEWorkerV2``: refuse a server whose speculative worker (the class SGLang's
    scheduler builds from these arguments) would run other code, where nothing would be captured."""
    from sglang.srt.speculative.eagle_worker_v2 import EAGLEWorkerV2
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    worker = SpeculativeAlgorithm.from_string(args.speculative_algorithm).create_worker(args)
    hooked = isinstance(worker, type) and issubclass(worker, EAGLEWorkerV2) and \
        worker.verify is EAGLEWorkerV2.verify and worker._forward_prefill_batch is EAGLEWorkerV2._forward_prefill_batch
    if not hooked:
        name = f"{worker.__module__}.{worker.__qualname__}" if isinstance(worker, type) else repr(worker)
        raise server_args.SGLangPluginError(
            f"TIDE's SGLang plugin cannot run here: capture hooks EAGLEWorkerV2 (verify, _forward_prefill_batch) "
            f"but this server's speculative worker is {name}, so nothing would be captured; drop the option "
            "that selects it (e.g. --enable-multi-layer-eagle) or turn capture off (capture.enabled: false)")


def capture_rank(args: Any) -> bool:
    """Whether this scheduler captures: rank 0 of its attention group (the TP and context-parallel
    ranks of one attention-DP group hold the same rows) on the last pipeline stage (the one hosting
    the draft). The ranks are those SGLang published for this scheduler's own arguments before
    constructing it (``run_scheduler_process``); unreadable, no rank captures: said and counted."""
    from sglang.srt.runtime_context import assert_published, get_parallel

    from tide import metrics

    try:
        assert_published(args, role="scheduler")
        p = get_parallel()
        return p.attn_tp_rank == 0 and p.attn_cp_rank == 0 and p.pp_rank == p.pp_size - 1
    except (RuntimeError, ValueError, AttributeError) as exc:
        log.error("TIDE plugin: this scheduler's parallel rank is unknown (%s); capture is off in this process", exc)
        metrics.CAPTURE_RANK_UNKNOWN.inc()
        return False


def start_capture(cfg: Any, target_model_id: str, with_tap: bool, sink: Any = None) -> Any:
    """This process's capture context; the tap (and its producer thread) only on ``with_tap``."""
    from tide import metrics
    from tide.capture.sampling import SamplingPolicy
    from tide.engine.sglang.capture import CaptureContext

    with PROCESS.lock:
        if with_tap and cfg.capture.enabled and sink is None:
            from tide.capture.tap import CaptureTap

            PROCESS.tap = sink = CaptureTap(cfg.capture, cfg.kafka)
        limit = cfg.capture.queue_max_items
        tap = PROCESS.tap
        PROCESS.ctx = CaptureContext(
            sink=sink if with_tap else None,
            policy=SamplingPolicy(cfg.capture.sample_fraction, dict(cfg.capture.workload_fractions)),
            target_model_id=cfg.model.model_id or target_model_id, aux_layer_ids=(),
            version=lambda: PROCESS.version,
            queue_full=(lambda: tap.queue_depth >= limit) if tap is not None else (lambda: False))
        metrics.ENGINE_DRAFTER_INFO.labels(PROCESS.version).set(1)
        return PROCESS.ctx


def after_attention_backends(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``ModelRunner.init_attention_backends``: the target keeps its final hidden states."""
    try:
        aux = runner.spec_aux_config
        if runner.is_draft_worker or not aux.eagle_use_aux_hidden_state:
            return
        runner.model.logits_processor.keep_last_hidden_states = True
        ids = aux.eagle_aux_hidden_state_layer_ids
        if PROCESS.ctx is not None and ids:
            # SGLang's ids name the layer whose output is captured; TIDE's, the layer it feeds
            PROCESS.ctx.aux_layer_ids = tuple(int(i) + 1 for i in ids)
    except Exception:  # noqa: BLE001 - serving goes on without final hidden states (nothing captured)
        log.exception("TIDE plugin: could not enable the final hidden states; capture is off")


def after_verify(result: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``EAGLEWorkerV2.verify``: attach this verify's capture."""
    from tide.engine.sglang.capture import from_verify

    ctx = PROCESS.ctx
    if ctx is None or result is None or worker._draft_worker is None or batch.forward_mode.is_idle():
        return
    _attach_safely(result, lambda: from_verify(ctx, batch, result))


def around_prefill(original: Any, worker: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``EAGLEWorkerV2._forward_prefill_batch``: the chunk layout before, the capture after."""
    from types import SimpleNamespace

    from tide.engine.sglang.capture import from_prefill

    ctx = PROCESS.ctx
    layout = None
    if ctx is not None and worker._draft_worker is not None and not batch.forward_mode.is_idle():
        layout = SimpleNamespace(reqs=list(batch.reqs), prefix_lens=list(batch.prefix_lens),
                                 extend_lens=list(batch.extend_lens))
    result = original(worker, batch, *args, **kwargs)
    if layout is not None and result is not None:
        _attach_safely(result, lambda: from_prefill(ctx, layout, result))
    return result


def _attach_safely(result: Any, build: Any) -> None:
    from tide import metrics

    try:
        capture = build()
        if capture is not None:
            attach(result, capture)
    except Exception:  # noqa: BLE001 - this step is not captured; serving goes on
        log.exception("TIDE plugin: capture hook failed; this step is not captured")
        metrics.CAPTURE_DROPPED_STEPS.labels("tap_error").inc()


def attach(result: Any, capture: Any) -> None:
    """Hand ``capture`` to SGLang's auxiliary-output path (kept beside any other plugin's)."""
    from sglang.srt.managers.auxiliary_output import append_auxiliary_output

    lo = result.logits_output
    lo.auxiliary_device_output = append_auxiliary_output(lo.auxiliary_device_output, capture)


def load_draft(model: Any, named_tensors: list) -> None:
    """SGLang's custom weight loader for TIDE swaps: check the manifest's folder against the serving
    draft model, then load it in place. Never raises (SGLang's updater would not catch it)."""
    from tide import metrics
    from tide.engine.sglang import weights

    try:
        if not hasattr(model, "get_hot_token_id"):
            log.error("TIDE loader called for %s, not the draft model; nothing loaded (use selector='draft')",
                      type(model).__name__)
            metrics.ENGINE_DRAFTER_LOADS.labels("refused").inc()
            return
        body = weights.read_manifest(named_tensors)
        drafter = weights.prepare(Path(body["folder"]), weights.serving_shape_of(model),
                                  weights.serving_mapping_of(model), body["sha256"])
        _synchronize(model)  # the overlap loop may still run the previous batch on the old weights
        weights.load_into(model, drafter)
        _synchronize(model)
        old, PROCESS.version = PROCESS.version, body["version"]
        metrics.ENGINE_DRAFTER_INFO.labels(old).set(0)
        metrics.ENGINE_DRAFTER_INFO.labels(PROCESS.version).set(1)
        metrics.ENGINE_DRAFTER_LOADS.labels("applied").inc()
        log.info("TIDE loader: drafter %s -> %s", old, PROCESS.version)
    except Exception:  # noqa: BLE001 - refused: the old drafter keeps serving
        log.exception("TIDE loader refused the drafter; the serving drafter is unchanged")
        metrics.ENGINE_DRAFTER_LOADS.labels("refused").inc()


def _synchronize(model: Any) -> None:
    import torch

    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
