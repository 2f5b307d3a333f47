"""Capture inside SGLang: its batch/result objects -> TIDE ``StepCapture``s, off the critical path.

SGLang's scheduler carries a *device auxiliary output* through every generation result
(``LogitsProcessorOutput.auxiliary_device_output``, ``sglang/srt/managers/auxiliary_output.py``):
it copies it to pinned host memory on its copy stream right behind the forward (``copy_to_host``,
the same asynchronous D2H as the sampled tokens) and hands the host copy to ``consume(batch,
commits)`` in the batch-result processor, after the tokens are committed. The plugin's forward
hook (tide/engine/sglang/plugin.py) builds one per forward with ``from_verify`` / ``from_prefill``:
1. pick the sampled requests (CPU facts only: request id, ``custom_params``, the tap's policy);
2. gather their rows with ``index_select`` on the forward stream: the aux states (EAGLE3's three
   capture layers, [rows, 3H]) and the final normed states ([rows, H]). Under CUDA graphs both are
   views of the graph's static output buffers, which the next replay overwrites: the gather runs
   right behind this forward on the same stream, so it reads this forward's values; forward hooks
   would never run under graph replay at all;
3. ``consume`` (scheduler thread, host tensors): per request, the positions whose next token the
   client received: SGLang's ``commits[i]`` are the tokens it made visible this step (a verify may
   accept drafts past an EOS or ``max_new_tokens``; SGLang keeps them in ``output_ids`` but not in
   what it streams), so a verify gives the root (the previous output token) and the committed tokens
   but the last, one row each from the root's position; rejected draft rows were copied but are
   never offered. Prefill chunks give the prompt positions. A request thus gets prompt + output - 1
   positions, then an end marker. Then ``sink.offer`` (the tap only enqueues; bounded queue,
   drop-and-count) and the acceptance metrics of every request, sampled or not.
No sglang import here: the objects are used through the attributes SGLang 0.5.23 gives them.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from tide import metrics
from tide.capture.sampling import SamplingPolicy
from tide.engine.base import CaptureMeta, CaptureSink, StepCapture

log = logging.getLogger(__name__)

WORKLOAD_PARAM = "tide_workload"  # custom_params keys a request may carry (SGLang's custom_params)
CAPTURE_PARAM = "tide_capture"  # false: this request opts out of capture
_MAX_TRACKED = 8192  # requests whose meta the capture remembers (finished ones are dropped first)


@dataclass
class CaptureContext:
    """What the capture needs to know about the serving process; one per scheduler process."""

    sink: CaptureSink | None
    policy: SamplingPolicy
    target_model_id: str
    aux_layer_ids: tuple[int, ...]
    version: Callable[[], str]  # the drafter version serving now
    queue_full: Callable[[], bool] = lambda: False  # the tap cannot take more: skip the copy

    def __post_init__(self) -> None:
        self._metas: OrderedDict[str, CaptureMeta] = OrderedDict()
        self._refused: OrderedDict[str, None] = OrderedDict()
        self._prefix_hits: OrderedDict[str, None] = OrderedDict()  # sampled, refused for a cached prefix

    def meta_for(self, req: Any) -> CaptureMeta | None:
        """The request's capture meta, or None when it is not captured (opt-out, not sampled,
        or its prompt start never reached this process)."""
        rid = req.rid
        if rid in self._refused:
            return None
        meta = self._metas.get(rid)
        if meta is not None:
            return meta
        params = getattr(req.sampling_params, "custom_params", None) or {}
        workload = params.get(WORKLOAD_PARAM)
        workload = str(workload) if workload is not None else None
        if params.get(CAPTURE_PARAM) is False or self.sink is None or not self.policy.admits(rid, workload):
            self._remember(self._refused, rid, None)
            return None
        meta = CaptureMeta(request_id=rid, target_model_id=self.target_model_id, drafter_version=self.version(),
                           aux_layer_ids=tuple(self.aux_layer_ids), workload=workload,
                           prompt_len=len(req.origin_input_ids), started_at_s=time.time())
        self._remember(self._metas, rid, meta)
        return meta

    def seen(self, rid: str) -> bool:
        return rid in self._metas or rid in self._refused

    def refuse(self, rid: str) -> None:
        self._metas.pop(rid, None)
        self._remember(self._refused, rid, None)

    def refuse_prefix_hit(self, rid: str) -> None:
        self.refuse(rid)
        self._remember(self._prefix_hits, rid, None)

    def prefix_hit(self, rid: str) -> bool:
        return rid in self._prefix_hits

    def forget(self, rid: str) -> None:
        self._metas.pop(rid, None)
        self._refused.pop(rid, None)
        self._prefix_hits.pop(rid, None)

    @staticmethod
    def _remember(table: OrderedDict, rid: str, value: Any) -> None:
        table[rid] = value
        if len(table) > _MAX_TRACKED:
            table.popitem(last=False)


@dataclass
class _Slice:
    """One request's rows in the gathered tensors."""

    index: int  # position in batch.reqs
    meta: CaptureMeta
    row: int  # first gathered row
    rows: int  # rows gathered (decode: the whole verify block; prefill: the chunk)
    start_position: int = -1  # prefill: the chunk's first position
    tokens: torch.Tensor | None = None  # prefill: the chunk's token ids (CPU)


class DeviceCapture:
    """SGLang's ``DeviceAuxiliaryOutput``: tensors this forward produced, gathered for the copy.
    ``skipped``: batch indices of sampled requests refused for a cached prefix (their commits are
    counted in consume)."""

    def __init__(self, ctx: CaptureContext, prefill: bool, rids: list[str], slices: list[_Slice],
                 tensors: dict[str, torch.Tensor], version: str, draft_tokens: int,
                 skipped: Sequence[int] = ()) -> None:
        self.ctx, self.prefill, self.rids, self.slices = ctx, prefill, rids, slices
        self.tensors, self.version, self.draft_tokens, self.skipped = tensors, version, draft_tokens, skipped

    def copy_to_host(self, copy_tensor: Callable[[torch.Tensor], torch.Tensor]) -> "HostCapture":
        host = {name: copy_tensor(t) for name, t in self.tensors.items()}
        return HostCapture(self.ctx, self.prefill, self.rids, self.slices, host, self.version, self.draft_tokens,
                           self.skipped)


class HostCapture:
    """SGLang's ``HostAuxiliaryOutput``: ``consume`` runs once the tokens are committed."""

    def __init__(self, ctx: CaptureContext, prefill: bool, rids: list[str], slices: list[_Slice],
                 tensors: dict[str, torch.Tensor], version: str, draft_tokens: int,
                 skipped: Sequence[int] = ()) -> None:
        self.ctx, self.prefill, self.rids, self.slices = ctx, prefill, rids, slices
        self.tensors, self.version, self.draft_tokens, self.skipped = tensors, version, draft_tokens, skipped

    def consume(self, batch: Any, commits: Sequence[Any]) -> None:
        try:
            if [r.rid for r in batch.reqs] != self.rids:
                metrics.CAPTURE_DROPPED_STEPS.labels("batch_mismatch").inc()
                return
            captures = self._prefill_captures(batch, commits) if self.prefill else \
                self._verify_captures(batch, commits)
            self._count_skipped(batch, commits)
            if captures and self.ctx.sink is not None:
                self.ctx.sink.offer(captures)
        except Exception:  # nothing may reach SGLang's result processor from here
            log.exception("TIDE capture: consume failed")
            metrics.CAPTURE_DROPPED_STEPS.labels("tap_error").inc()

    def _prefill_captures(self, batch: Any, commits: Sequence[Any]) -> list[StepCapture]:
        aux, final = self.tensors["aux"], self.tensors["final"]
        out = []
        for s in self.slices:
            rows = slice(s.row, s.row + s.rows)
            out.append(StepCapture(s.meta, s.start_position, s.tokens, aux[rows], final[rows], is_prompt=True))
            req = batch.reqs[s.index]
            if commits[s.index] is not None and req.finished():  # its first token was its last
                out.append(_end_marker(s.meta, s.start_position + s.rows, aux.shape[-1], final.shape[-1]))
                self.ctx.forget(req.rid)
        return out

    def _verify_captures(self, batch: Any, commits: Sequence[Any]) -> list[StepCapture]:
        t = self.tensors
        accept_lens = t["accept_lens"].tolist()
        self._count(batch, commits, accept_lens)
        out = []
        for j, s in enumerate(self.slices):
            req, commit = batch.reqs[s.index], commits[s.index]
            if commit is None or req.is_retracted:
                continue  # nothing committed (an overshoot row after the finish, a discarded output)
            # one row per token the client received: drafts accepted past a stop are not among them
            n = min(len(commit.token_ids), int(accept_lens[s.index]))
            rows = slice(s.row, s.row + n)
            tokens = torch.cat([t["roots"][j:j + 1].to(torch.int64),
                                torch.tensor(commit.token_ids[:n - 1], dtype=torch.int64)])
            out.append(StepCapture(s.meta, int(t["positions"][j]), tokens, t["aux"][rows], t["final"][rows],
                                   is_prompt=False))
            if req.finished():
                out.append(_end_marker(s.meta, int(t["positions"][j]) + n, t["aux"].shape[-1],
                                       t["final"].shape[-1]))
                self.ctx.forget(req.rid)
        return out

    def _count_skipped(self, batch: Any, commits: Sequence[Any]) -> None:
        """Committed tokens of requests refused for a cached prefix: positions capture would have had."""
        for i in self.skipped:
            if commits[i] is not None:
                metrics.CAPTURE_PREFIX_CACHED_POSITIONS.inc(len(commits[i].token_ids))
            if batch.reqs[i].finished():
                self.ctx.forget(batch.reqs[i].rid)

    def _count(self, batch: Any, commits: Sequence[Any], accept_lens: list[int]) -> None:
        """The reference engine's acceptance metrics, for every request that committed tokens."""
        v = self.version
        committed = [n for n, c in zip(accept_lens, commits) if c is not None]
        if not committed:
            return
        metrics.ENGINE_TARGET_FORWARDS.labels(v).inc(len(committed))
        metrics.ENGINE_DRAFT_TOKENS.labels(v).inc((self.draft_tokens - 1) * len(committed))
        metrics.ENGINE_ACCEPTED_TOKENS.labels(v).inc(sum(committed) - len(committed))
        metrics.ENGINE_TOKENS.labels(v).inc(sum(len(c.token_ids) for c in commits if c is not None))
        for n in committed:
            metrics.ENGINE_ACCEPT_LENGTH.labels(v).observe(n)


def _end_marker(meta: CaptureMeta, position: int, aux_width: int, hidden: int) -> StepCapture:
    return StepCapture(meta, position, torch.empty(0, dtype=torch.long), torch.empty(0, aux_width),
                       torch.empty(0, hidden), is_prompt=False, finished=True)


def _unless_full(ctx: CaptureContext, slices: list[_Slice], starts: list[int]):
    """Drop-and-count when the tap's queue is full: those requests are not captured any more
    (a record with a hole would teach the drafter wrong transitions)."""
    if not slices or not ctx.queue_full():
        return slices, starts
    metrics.CAPTURE_DROPPED_STEPS.labels("queue_full").inc(len(slices))
    for s in slices:
        ctx.refuse(s.meta.request_id)
    return [], []


def _rows(starts: list[int], lengths: list[int], device: torch.device) -> torch.Tensor:
    """Row indices of the given segments, built on the CPU and sent without a sync."""
    idx = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]) if starts else \
        torch.empty(0, dtype=torch.long)
    if device.type == "cpu":
        return idx
    return idx.pin_memory().to(device, non_blocking=True)


def from_verify(ctx: CaptureContext, batch: Any, result: Any) -> DeviceCapture | None:
    """After an EAGLE3 verify (topk 1): gather the whole verify block of each sampled request.

    ``batch.spec_info`` is the ``EagleVerifyInput``: ``draft_token`` [bs*nd] (row i*nd is the root)
    and ``positions`` [bs*nd]; ``result`` the ``GenerationBatchResult``: ``accept_lens`` [bs]
    (accepted drafts + the bonus), ``logits_output.hidden_states`` [bs*nd, 3H] and
    ``logits_output.last_hidden_states`` [bs*nd, H]. The tokens come from SGLang's commits (consume).
    """
    lo = result.logits_output
    if lo is None or lo.hidden_states is None or lo.last_hidden_states is None or result.accept_lens is None:
        return None
    nd = int(result.speculative_num_draft_tokens)
    slices, starts, skipped = [], [], []
    for i, req in enumerate(batch.reqs):
        meta = ctx.meta_for(req)
        if meta is not None:
            slices.append(_Slice(i, meta, row=len(slices) * nd, rows=nd))
            starts.append(i * nd)
        elif ctx.prefix_hit(req.rid):
            skipped.append(i)
    tensors = {"accept_lens": result.accept_lens}
    slices, starts = _unless_full(ctx, slices, starts)
    if slices:
        device = lo.hidden_states.device
        rows = _rows(starts, [nd] * len(starts), device)
        roots = rows.view(-1, nd)[:, 0]
        tensors.update(aux=lo.hidden_states.index_select(0, rows), final=lo.last_hidden_states.index_select(0, rows),
                       roots=batch.spec_info.draft_token.index_select(0, roots),
                       positions=batch.spec_info.positions.index_select(0, roots))
    return DeviceCapture(ctx, False, [r.rid for r in batch.reqs], slices, tensors, ctx.version(), nd, skipped)


def from_prefill(ctx: CaptureContext, batch: Any, result: Any) -> DeviceCapture | None:
    """After a target prefill (one chunk per request): gather the chunk rows of sampled requests.

    Rows are concatenated per request in ``batch.reqs`` order, ``batch.extend_lens[i]`` each; the
    chunk starts at ``batch.prefix_lens[i]``. A request seen first with a prefix (a radix-cache hit,
    or a re-prefill after retraction) never had its start on the GPU here: it is not captured, and
    its positions are counted (``tide_capture_prefix_cached_positions_total``).
    """
    lo = result.logits_output
    if lo is None or lo.hidden_states is None or lo.last_hidden_states is None:
        return None
    slices, starts, offset = [], [], 0
    for i, req in enumerate(batch.reqs):
        prefix, n = int(batch.prefix_lens[i]), int(batch.extend_lens[i])
        fresh = not ctx.seen(req.rid)
        meta = ctx.meta_for(req)
        if meta is not None and fresh and (prefix > 0 or len(req.output_ids) > 0):
            ctx.refuse_prefix_hit(req.rid)
            metrics.CAPTURE_DROPPED_STEPS.labels("prefix_cached").inc()
            metrics.CAPTURE_PREFIX_CACHED_POSITIONS.inc(prefix)
            meta = None
        if meta is None and ctx.prefix_hit(req.rid):
            metrics.CAPTURE_PREFIX_CACHED_POSITIONS.inc(n)  # this chunk's prompt positions
        if meta is not None and n > 0:
            tokens = torch.tensor(list(req.full_untruncated_fill_ids[prefix:prefix + n]), dtype=torch.int64)
            slices.append(_Slice(i, meta, row=sum(s.rows for s in slices), rows=n, start_position=prefix,
                                 tokens=tokens))
            starts.append(offset)
        offset += n
    slices, starts = _unless_full(ctx, slices, starts)
    if not slices:
        return None
    rows = _rows(starts, [s.rows for s in slices], lo.hidden_states.device)
    tensors = {"aux": lo.hidden_states.index_select(0, rows), "final": lo.last_hidden_states.index_select(0, rows)}
    return DeviceCapture(ctx, True, [r.rid for r in batch.reqs], slices, tensors, ctx.version(), 0)
