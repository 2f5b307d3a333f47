"""The reference engine: batched, lossless EAGLE3 speculative decoding on CPU.

One scheduler thread owns the model state. Each loop iteration:
1. apply a pending drafter swap (between decode steps): new drafter cache, and every running
   request re-feeds its whole history of target states to the new drafter on its next step;
2. admit waiting requests into free cache slots: prefill each, emit its first token;
3. run one batched step over all running requests (``speculative_step`` under the step's planner,
   or ``target_step`` when no drafter serves, the scheduler decides drafting does not pay
   (tide/spec/policy.py), or the drafter (or the drafter service: tide/drafting/) failed this step);
4. hand the committed positions to the capture sink (enqueue only), update stats/metrics;
5. finish requests on a stop token, their token budget or the context limit, and free slots.
Callers get a blocking iterator of TokenEvents; closing it early cancels the request.
Injected into the decoding core from here: the target kernel's pass width (it prices draft siblings)
and the confidence head that serves (none when its held-out ECE fails the bar: said in health).
Where committed tokens go (caller, capture, accounting) is ``tide/engine/outputs.py``.
"""
from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Iterator

import torch

from tide import metrics
from tide.config import MAX_DRAFT_SIBLINGS
from tide.drafter.artifact import DrafterError, TargetSpec, load_drafter, read_metadata
from tide.drafter.confidence import Confidence, serving_head
from tide.drafter.model import Eagle3Drafter, for_serving
from tide.drafter.static import static_drafter_path
from tide.drafter.vocab import mapping_digest
from tide.drafting.client import remote_drafter
from tide.engine.accounting import EngineAccounting
from tide.engine.base import (
    CaptureMeta,
    CaptureSink,
    Engine,
    EngineFailed,
    EngineStats,
    GenerationRequest,
    StepCapture,
    TokenEvent,
)
from tide.engine.outputs import RequestOutputs
from tide.engine.running import Events, Running, advance, build_feed, captured, check_request, new_running
from tide.models.llama import LlamaTarget
from tide.models.rowkernel import PASS_ROWS
from tide.models.target import eos_ids_of, load_target  # noqa: F401  (re-exported)
from tide.spec.cost import StepCostModel, profile
from tide.spec.decode import RowInput, filtered_probs, prefill, speculative_step, target_step
from tide.spec.generate import generate
from tide.spec.policy import COSTED, SpecPolicy

log = logging.getLogger(__name__)


class ReferenceEngine(Engine):
    """Implements tide.engine.base.Engine with LlamaTarget + Eagle3Drafter."""

    def __init__(self, target: LlamaTarget, tokenizer, drafter: Eagle3Drafter | None, drafter_version: str,
                 *, target_model_id: str, draft_len: int = 4, draft_stop_prob: float = 0.0,
                 max_batch_size: int = 8, max_seq_len: int = 1024, eos_ids: tuple[int, ...] = (),
                 refeed_positions: int = 32, scheduler: str = "stop_rule", cost_model: StepCostModel | None = None,
                 gate_probe_steps: int = 64, profile_context: int = 128, draft_siblings: int = 0,
                 pass_rows: int = PASS_ROWS, judge_rows: int = 200, judge_probe_steps: int = 4, remote=None):
        self.target = target
        self.tokenizer = tokenizer
        self.target_model_id = target_model_id
        self.max_seq_len = max_seq_len
        self.draft_len = draft_len
        if not 0.0 <= draft_stop_prob <= 1.0:
            raise ValueError(f"spec.draft_stop_prob must be in [0, 1], got {draft_stop_prob}")
        self.draft_stop_prob = draft_stop_prob
        if not 0 <= draft_siblings <= MAX_DRAFT_SIBLINGS:
            raise ValueError(f"spec.draft_siblings must be in 0..{MAX_DRAFT_SIBLINGS}, got {draft_siblings}")
        self.draft_siblings = draft_siblings
        self.pass_rows = pass_rows  # query rows one pass of the target's kernel serves (prices siblings)
        self.max_batch_size = max_batch_size
        self.eos_ids = tuple(eos_ids)
        # every swapped-in drafter must keep the mapping the engine started with (t2d/d2t fixed)
        self._vocab_mapping = mapping_digest(drafter.d2t) if drafter is not None else None
        drafter = for_serving(drafter) if drafter is not None else None
        self._drafter, self._remote = drafter, remote  # remote: the drafter service's client, or None
        self._version = remote.version if remote is not None else drafter_version if drafter is not None else "none"
        self._head, self._head_reason = self._serving_head(drafter)
        self._pending_swap: tuple[Eagle3Drafter | None, str] | None = None
        self._cache_len = max_seq_len + draft_len + draft_siblings + 2
        self._tcache = target.new_cache(max_batch_size, self._cache_len)
        self._dcache = drafter.new_cache(max_batch_size, self._cache_len) if drafter is not None else None
        self._inbox: "queue.Queue[Running]" = queue.Queue()
        self._acct = EngineAccounting()
        self._out = RequestOutputs(self._acct, self.eos_ids, max_seq_len, target.shape.hidden_size)
        self._lock = threading.Lock()  # guards _pending_swap only (never held in a step)
        self._stop = threading.Event()
        self._failure: str | None = None  # why the decode loop died; set once, never cleared
        self._swap_error: str | None = None  # the last swap that could not be applied, and why
        self._last_swap_pause_s = 0.0
        self.refeed_positions = refeed_positions
        if scheduler in COSTED:
            cost_model = cost_model or StepCostModel(max_batch_size, draft_len)
            if not cost_model.measured():  # before the decode thread: the caches are not in use yet
                profile(target, drafter, self._tcache, self._dcache, cost_model,
                        min(profile_context, max_seq_len - draft_len - 2), refeed_positions=refeed_positions,
                        packed=scheduler == "dspark", head=self._head)
        self._policy = SpecPolicy(scheduler, draft_len, draft_stop_prob, cost_model, gate_probe_steps,
                                  judge_rows, judge_probe_steps)
        self._policy.drafter_changed(self._version)
        self._thread = threading.Thread(target=self._loop, name="tide-engine", daemon=True)
        self._thread.start()
        metrics.ENGINE_DRAFTER_INFO.labels(self._version).set(1)

    @property
    def drafter_version(self) -> str:
        return self._version

    @property
    def drafter(self) -> Eagle3Drafter | None:
        return self._drafter

    @property
    def last_swap_pause_s(self) -> float:
        return self._last_swap_pause_s

    @property
    def target_spec(self) -> TargetSpec:
        shape = self.target.shape
        return TargetSpec(shape.hidden_size, shape.vocab_size, self.target.aux_layer_ids, self.max_seq_len)

    def validate_drafter(self, folder: Path, smoke_prompt_ids: list[int]) -> Eagle3Drafter:
        drafter = load_drafter(folder, self.target_spec, self._vocab_mapping, require_checksum=True)
        # runs in the caller's thread on the shared weights (read-only), never inside a decode step
        want, _ = generate(self.target, None, smoke_prompt_ids, 8)
        got, _ = generate(self.target, drafter, smoke_prompt_ids, 8, gamma=self.draft_len)
        if got != want:
            raise DrafterError(f"{folder}: smoke decode differs from target-only output")
        return drafter

    @property
    def failure(self) -> str | None:
        return self._failure

    def submit(self, request: GenerationRequest) -> Iterator[TokenEvent]:
        if self._failure is not None:
            raise EngineFailed(f"engine failed: {self._failure}")
        if self._stop.is_set():
            raise RuntimeError("engine is closed")
        check_request(request, self.max_seq_len)
        meta = CaptureMeta(request_id=request.request_id, target_model_id=self.target_model_id,
                           drafter_version=self._version, aux_layer_ids=self.target.aux_layer_ids,
                           workload=request.workload, prompt_len=len(request.prompt_ids),
                           started_at_s=time.time())
        running = new_running(request, meta)
        self._inbox.put(running)
        metrics.ENGINE_QUEUE_DEPTH.set(self._inbox.qsize())
        if self._failure is not None:  # the loop died after the check above: nobody takes it now
            self._out.fail_all(self._inbox, f"engine failed: {self._failure}")
        return Events(running)

    def swap_drafter(self, drafter: Eagle3Drafter | None, version: str) -> None:
        # prepared here, in the caller's thread: the decode loop only switches references
        drafter = for_serving(drafter) if drafter is not None else None
        with self._lock:
            self._pending_swap = (drafter, version)

    def set_capture_sink(self, sink: CaptureSink | None) -> None:
        self._out.sink = sink

    def stats(self) -> EngineStats:
        return self._acct.stats()

    def health(self) -> dict:
        return {"drafter_version": self._version, "running": len(self._out.running),
                "waiting": self._inbox.qsize(), "target_model_id": self.target_model_id,
                "last_swap_pause_s": self._last_swap_pause_s, "swap_error": self._swap_error,
                "failure": self._failure, "confidence_head": {"in_use": self._head is not None,
                                                              "reason": self._head_reason},
                **self._policy.view(), "drafter_service": self._remote.view() if self._remote else None}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        if self._remote is not None: self._remote.close()  # noqa: E701

    def _serving_head(self, drafter: Eagle3Drafter | None) -> tuple[Confidence | None, str]:
        """The confidence head this drafter serves with (tide/drafter/confidence.py), said once."""
        try:
            offered = drafter.confidence if drafter is not None else None
        except Exception as exc:  # noqa: BLE001 - a broken drafter fails in its steps (target-only), not here
            log.warning("drafter %s: confidence head unreadable (%s)", self._version, exc)
            offered = None
        head, reason = serving_head(offered)
        if head is None and offered is not None:
            log.warning("drafter %s: %s; its drafts are ranked on the top-probability chain", self._version, reason)
        metrics.ENGINE_CONFIDENCE_HEAD.labels(self._version).set(1 if head is not None else 0)
        return head, reason

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._iterate()
        except Exception as exc:  # noqa: BLE001 - outside a step nothing may fail: serve no more, say why
            log.exception("decode loop failed; the engine stops serving")
            self._failure = f"decode loop failed: {type(exc).__name__}: {exc}"
            metrics.ENGINE_FAILED.set(1)
            self._out.fail_all(self._inbox, f"engine failed: {self._failure}")
            return
        for slot in list(self._out.running):
            self._out.finish(slot, "error", error="engine shutting down")

    def _iterate(self) -> None:
        self._apply_swap()
        self._admit()
        if not self._out.running:
            try:  # wait for work, put back: _admit takes it next iteration, in FIFO order
                self._inbox.put(self._inbox.get(timeout=0.05))
            except queue.Empty:
                pass
            return
        try:
            self._step()
        except Exception:  # a bug or one bad request must not fail the whole batch
            log.exception("decode step failed; stepping its requests one at a time")
            self._step_each()

    def _apply_swap(self) -> None:
        with self._lock:
            swap, self._pending_swap = self._pending_swap, None
        if swap is None:
            return
        t0 = time.perf_counter()
        drafter, version = swap
        try:  # allocate before switching anything: a failure leaves the old drafter serving
            dcache = drafter.new_cache(self.max_batch_size, self._cache_len) if drafter is not None else None
        except Exception as exc:  # noqa: BLE001 - e.g. out of memory; the swap is refused, serving goes on
            log.exception("swap to drafter %s failed; %s keeps serving", version, self._version)
            self._swap_error = f"swap to {version} failed: {type(exc).__name__}: {exc}"
            metrics.ENGINE_SWAP_FAILURES.inc()
            return
        old = self._version
        self._drafter, self._dcache = drafter, dcache
        self._version = version if drafter is not None or self._remote is not None else "none"
        self._head, self._head_reason = self._serving_head(drafter)
        self._swap_error = None
        self._policy.drafter_changed(self._version)
        for r in self._out.running.values():
            # the new drafter has seen nothing: feed it the recent history only, so the step
            # after a swap costs about one normal step; it attends from there on (lossless either way)
            r.row.feed_start = r.row.drafter_first_pos = max(0, r.row.t_len - self.refeed_positions)
            r.refeed = True
            # lineage: this request's later positions are drafted (and captured) under the new version
            r.meta = dataclasses.replace(r.meta, drafter_version=self._version)
        self._last_swap_pause_s = time.perf_counter() - t0
        metrics.ENGINE_SWAP_PAUSE_SECONDS.observe(self._last_swap_pause_s)
        metrics.ENGINE_DRAFTER_INFO.labels(old).set(0)
        metrics.ENGINE_DRAFTER_INFO.labels(self._version).set(1)
        log.info("drafter swapped %s -> %s in %.1f ms", old, self._version, self._last_swap_pause_s * 1e3)

    def _admit(self) -> None:
        free = [s for s in range(self.max_batch_size) if s not in self._out.running]
        while free:
            try:
                running = self._inbox.get_nowait()
            except queue.Empty:
                break
            if running.cancelled.is_set():  # its client left while it waited: never prefilled
                self._acct.outcome("cancelled")
                continue
            slot = free.pop(0)
            running.row.slot = slot
            try:
                self._prefill(slot, running)
            except Exception as exc:
                log.exception("prefill failed")
                running.out.put(TokenEvent((), True, "error", f"prefill failed: {exc}"))
                self._acct.outcome("error")
        metrics.ENGINE_QUEUE_DEPTH.set(self._inbox.qsize())
        metrics.ENGINE_BATCH_SIZE.set(len(self._out.running))

    def _prefill(self, slot: int, r: Running) -> None:
        prompt = list(r.req.prompt_ids)
        out = prefill(self.target, self._tcache, slot, prompt)
        logits = out.logits[0, -1]
        if r.row.temperature > 0:
            first = int(torch.multinomial(filtered_probs(logits, r.row.temperature, r.row.top_p,
                                                         r.row.top_k), 1, generator=r.row.generator))
        else:
            first = int(logits.argmax())
        r.meta = dataclasses.replace(r.meta, drafter_version=self._version)
        r.row.t_len, r.row.pending, r.row.feed_start = len(prompt), first, 0
        r.hist_tokens.append(first)
        r.hist_aux.append(out.aux_hidden[0])
        self._out.running[slot] = r
        if r.req.capture:
            self._out.offer([StepCapture(r.meta, 0, torch.tensor(prompt), out.aux_hidden[0], out.final_hidden[0],
                                     is_prompt=True)])
        self._out.emit(slot, [first], self._version)

    def _step_each(self) -> None:
        """After a failed batched step: step each request alone, fail only those that fail alone (safe:
        a step raises before it commits; a row stepped alone gets the tokens it would get batched)."""
        for slot in sorted(self._out.running):
            r = self._out.running.get(slot)
            if r is None:
                continue
            r.refeed = True  # the failed step may have consumed this row's refeed of its history
            try:
                self._step([slot])
            except Exception as exc:  # noqa: BLE001
                log.exception("request %s failed in a decode step", r.req.request_id)
                self._out.finish(slot, "error", error=f"decode step failed: {exc}")

    def _step(self, only: list[int] | None = None) -> None:
        t0 = time.perf_counter()
        slots = sorted(self._out.running) if only is None else [s for s in only if s in self._out.running]
        for s in slots:  # requests whose reader went away
            if self._out.running[s].cancelled.is_set():
                self._out.finish(s, "cancelled")
        slots = [s for s in slots if s in self._out.running]
        if not slots:
            return
        rows = [self._out.running[s].row for s in slots]
        # don't draft past the context limit
        gamma = min(self.draft_len, min(self._cache_len - 2 - self.draft_siblings - r.t_len for r in rows))
        version = self._version
        workloads = [self._out.running[s].req.workload for s in slots]
        results, stats = self._speculate(slots, rows, workloads, gamma)
        if results is None:
            t_target = time.perf_counter()
            results = target_step(self.target, self._tcache, rows)
            forwards_s = time.perf_counter() - t_target
            self._policy.observe_target_step(len(rows), forwards_s)
        else:
            forwards_s = stats.verify_s + stats.draft_s
        sent = [self._out.deliverable(self._out.running[s], res.committed)[0] for s, res in zip(slots, results)]
        self._commit(slots, results, sent, drafter_ran=stats is not None or self._drafter is self._remote is None)
        # only rows with verified drafts are the drafter's acceptance (tide/engine/accounting.py)
        self._acct.step(version, results, stats, has_drafter=self._drafter is not None or self._remote is not None)
        emitted = sum(self._out.emit(s, res.committed, self._version) for s, res in zip(slots, results))
        wall_s = time.perf_counter() - t0
        self._policy.observe_step_wall(len(slots), wall_s, forwards_s, stats is not None, emitted)
        metrics.ENGINE_STEP_SECONDS.observe(wall_s)

    def _speculate(self, slots: list[int], rows: list[RowInput], workloads: list[str], gamma: int):
        """A drafted step's (results, stats) if the policy drafts and the drafter does not fail, else (None, None)."""
        if self._drafter is self._remote is None or gamma <= 0:  # neither a drafter nor the drafter service
            return None, None
        # the switching cost a draft pays first: positions not fed to the drafter yet (a new
        # request's prompt, positions deferred by target-only steps or a swap); the policy spreads
        # it over the drafted steps it enables
        feed_positions = max(r.t_len - r.feed_start for r in rows)
        room = [r.req.sampling.max_new_tokens - r.generated - 1 for r in (self._out.running[s] for s in slots)]
        speculate, plan = self._policy.plan(workloads, gamma, feed_positions, room, [r.temperature <= 0 for r in rows])
        if not speculate:
            return None, None
        for s in slots:  # only a drafted step needs the feed (a deferred one can be long)
            build_feed(self._out.running[s])
        step = speculative_step if self._remote is None else self._remote.bind(  # drafts of another version:
            self._out.running, slots, self._version, self.swap_drafter)  # switched to between steps, as a swap
        try:
            results, stats = step(self.target, self._drafter, self._tcache, self._dcache, rows, gamma,
                                  plan, self._head, self.draft_siblings, self.pass_rows)
            if results is None:  # the drafter service did not serve this step in time
                return None, None
            self._policy.observe_spec_step(workloads, stats, plan)
        except Exception:
            log.exception("drafter step failed; this step runs target-only")
            metrics.ENGINE_DRAFTER_FAILURES.inc()
            return None, None
        return results, stats

    def _commit(self, slots: list[int], results, sent: list[int], drafter_ran: bool) -> None:
        """Each row's committed tokens and states into its history; the sent ones captured (enqueue only)."""
        caps = []
        for s, res, n in zip(slots, results, sent):
            r = self._out.running[s]
            if self._out.sink is not None and r.req.capture:
                caps.append(captured(r, res, n))
            advance(r, res, drafter_ran=drafter_ran, refeed_positions=self.refeed_positions)
        self._out.offer(caps)  # once per step, for all its requests


def build_engine(cfg) -> ReferenceEngine:
    """The reference engine from a TideConfig: target, tokenizer, and the configured drafter."""
    target, tokenizer, folder = load_target(cfg)
    drafter, version, remote = None, "none", remote_drafter(cfg, target.shape.vocab_size)  # spec.drafter_service
    if cfg.spec.enabled and remote is None:
        path = static_drafter_path(cfg) if cfg.drafter.path == "static" else Path(cfg.drafter.path)
        spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
        drafter = load_drafter(path, spec)
        version = str(read_metadata(path).get("version", path.name))
    return ReferenceEngine(target, tokenizer, drafter, version, target_model_id=cfg.model.model_id,
                           draft_len=cfg.spec.draft_len, draft_stop_prob=cfg.spec.draft_stop_prob,
                           max_batch_size=cfg.engine.max_batch_size, max_seq_len=cfg.model.max_seq_len,
                           eos_ids=eos_ids_of(tokenizer, folder), refeed_positions=cfg.ops.refeed_positions,
                           scheduler=cfg.spec.scheduler, gate_probe_steps=cfg.spec.gate_probe_steps,
                           draft_siblings=cfg.spec.draft_siblings, judge_rows=cfg.ops.guard_window_forwards,
                           judge_probe_steps=cfg.spec.judge_probe_steps, remote=remote)
