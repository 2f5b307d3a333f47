"""The engine's side of the drafter service: ask for drafts, never wait past a deadline, verify.

``RemoteDrafter.step`` stands in for ``tide.spec.decode.speculative_step`` in the reference engine's
remote mode (``spec.drafter_service``). One step:
1. send the step's rows (each request's id, lengths, sampling temperature and seed, and its drafter
   feed: the tokens and aux states of positions the service has not acknowledged) with the step's
   depth and stop rule, the ids of requests that ended (their sessions are freed) and this
   engine's acceptance counters per version (the service's per-engine collapse guard reads them);
2. wait for the reply at most ``deadline_s``. No reply, a failed send, or a service marked down:
   the step runs target-only (lossless) and is counted (``tide_engine_remote_drafter_fallback_steps_total
   {reason}``); the feed stays unacknowledged, so the next drafted step re-sends it. While down
   no step waits: each polls what arrived without blocking and pings every ``retry_s``, and any
   answer brings speculation back (a restarted service is greeted again: its sessions are new);
3. drafts tagged with a version other than the engine's: the engine is asked to switch
   (``on_version``: a swap applied between decode steps, with the usual re-feed), this step runs
   target-only;
4. otherwise the engine's planner picks what is verified, and the verify and accept are the
   engine's own (``tide.spec.decode.verify`` and ``accept_row``): outputs are the target's.
Depth-1 siblings are not drafted remotely (the service returns chains).
"""
from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from typing import Callable

import numpy as np
import torch

from tide import metrics
from tide.contracts import VersionAcceptance
from tide.drafting import wire
from tide.drafting.transport import EngineLink
from tide.spec.decode import Drafts, RowInput, RowResult, StepStats, accept_row, verify
from tide.spec.rules import FixedLength, StopRule

log = logging.getLogger(__name__)


class RemoteDrafter:
    def __init__(self, url: str, vocab_size: int, deadline_s: float = 0.2, retry_s: float = 1.0, connect_timeout_s: float = 2.0,
                 engine_id: str = "", ring_bytes: int = 32 << 20, stop_prob: float = 0.3) -> None:
        if deadline_s <= 0 or retry_s <= 0:
            raise ValueError(f"drafter service deadline and retry must be > 0, got {deadline_s}, {retry_s}")
        self.url, self.deadline_s, self.retry_s, self.stop_prob = url, deadline_s, retry_s, stop_prob
        self.vocab_size = vocab_size  # the target's: sampled rows' q spans it
        self.engine_id = engine_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.link = EngineLink(url, ring_bytes)
        self.on_version: Callable[[str], None] | None = None
        self.service: str | None = None  # the service process that welcomed us
        self.version = "none"  # the version its drafts carry
        self.up = False
        self.d2t: torch.Tensor | None = None
        self.fallbacks: dict[str, int] = {}
        self.drafted_steps = 0
        self._seq, self._probe_at = 0, 0.0
        self._known: set[str] = set()  # request ids the service holds a session of
        self._closed: list[str] = []
        self._acceptance: dict[str, VersionAcceptance] = {}
        deadline = time.monotonic() + connect_timeout_s
        while not self.up and time.monotonic() < deadline:  # a hello before the connection is made is lost
            self._hello()
            self._receive(min(0.05, max(0.0, deadline - time.monotonic())))

    # --- connection --------------------------------------------------------------------------
    def _hello(self) -> None:
        self._probe_at = time.monotonic()
        self.link.send({"op": wire.HELLO, "engine": self.engine_id, "shm": self.link.ring_name})

    def _receive(self, timeout_s: float):
        """Handle one message (within ``timeout_s``); returns it, or None."""
        msg = self.link.recv(timeout_s)
        if msg is None:
            return None
        header, arrays = msg
        op, service = header.get("op"), header.get("service")
        if op == wire.WELCOME:
            self.service, self.up, self._known = service, True, set()
            self.version = str(header.get("version", "none"))
            if "d2t" in arrays:
                self.d2t = torch.from_numpy(arrays["d2t"])
            metrics.ENGINE_REMOTE_DRAFTER_UP.set(1)
            log.info("drafter service %s at %s: drafter %s", service, self.url, self.version)
        elif service is not None and service != self.service or header.get("reason") == wire.UNKNOWN_ENGINE:
            self.link.reset_ring()  # a new service process: it never saw our ring's blocks
            self.up = False
            self._hello()
        elif op in (wire.PONG, wire.DRAFTS):
            self.up = True
            metrics.ENGINE_REMOTE_DRAFTER_UP.set(1)
        return header, arrays

    def _down(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        metrics.ENGINE_REMOTE_DRAFTER_FALLBACKS.labels(reason).inc()
        if reason in ("deadline", "send_failed", "down"):
            if self.up:
                log.warning("drafter service at %s: %s; decoding target-only until it answers", self.url, reason)
            self.up = False
            metrics.ENGINE_REMOTE_DRAFTER_UP.set(0)

    def _probe(self) -> None:
        """Down: take what arrived (without waiting); ping (or greet) every ``retry_s``."""
        while not self.up and self._receive(0) is not None:
            pass
        if not self.up and time.monotonic() - self._probe_at >= self.retry_s:
            if self.service is None:
                self._hello()
            else:
                self._probe_at = time.monotonic()
                self.link.send({"op": wire.PING})

    def retire(self, live_ids) -> None:
        """Requests no longer running: their sessions are freed with the next message."""
        live = set(live_ids)
        gone = self._known - live
        if gone:
            self._closed += sorted(gone)
            self._known &= live

    # --- one step ----------------------------------------------------------------------------
    def bind(self, running: dict, slots: list[int], version: str, switch: Callable[[object, str], None]):
        """This step's stand-in for ``speculative_step`` (its signature) over the engine's running
        requests by slot; ``switch(None, version)`` asks the engine to serve drafts of ``version``."""
        ids = [running[s].req.request_id for s in slots]
        self.retire(r.req.request_id for r in running.values())
        self.on_version = lambda v: switch(None, v)

        def step(target, _drafter, tcache, _dcache, rows, gamma, planner, *_):
            return self.step(target, tcache, rows, gamma, planner, ids, version)
        return step

    def step(self, target, tcache, rows: list[RowInput], gamma: int, planner, ids: list[str], version: str):
        """(results, stats) of a drafted step, or (None, None): the engine runs it target-only."""
        t0 = time.perf_counter()
        drafts = self.drafts(rows, gamma, planner, ids, version)
        if drafts is None:
            return None, None
        lengths = [max(0, min(n, drafts.depth)) for n in planner.lengths(drafts)]
        t1 = time.perf_counter()
        k = max(lengths)
        tokens = drafts.tokens[:, :k]
        fed, out = verify(target, tcache, rows, tokens, None, lengths if planner.packed else None)
        stats = StepStats(gamma=gamma, position_accepts=[0] * gamma, drafted=lengths, draft_depth=drafts.depth,
                          draft_s=t1 - t0, verify_s=time.perf_counter() - t1,
                          feed_positions=max(len(r.feed_tokens) for r in rows), packed=planner.packed)
        results = []
        for b, r in enumerate(rows):
            n_b = lengths[b]
            q = torch.stack(drafts.q_probs[b][:n_b]) if n_b and drafts.q_probs[b] else None
            n, nxt, _ = accept_row(r, tokens[b, :n_b], q, out.logits[b], [])
            stats.accepted.append(n)
            for i in range(n):
                stats.position_accepts[i] += 1
            results.append(RowResult(committed=tokens[b, :n].tolist() + [nxt], n_accepted=n,
                                     fed_tokens=fed[b, :n + 1], aux_hidden=out.aux_hidden[b, :n + 1],
                                     final_hidden=out.final_hidden[b, :n + 1]))
        self._count(version, lengths, stats.accepted)
        return results, stats

    def drafts(self, rows: list[RowInput], gamma: int, planner, ids: list[str], version: str) -> Drafts | None:
        if not self.up:
            self._probe()
            if not self.up:
                self._down("down")
                return None
        self._seq += 1
        stop = planner.stop_prob if isinstance(planner, StopRule) else 0.0 if isinstance(planner, FixedLength) \
            else self.stop_prob
        header = {"op": wire.DRAFT, "engine": self.engine_id, "seq": self._seq, "gamma": gamma, "stop_prob": stop,
                  "closed": self._closed, "acceptance": wire.acceptance_field(self._acceptance),
                  "rows": [{"id": i, "t_len": r.t_len, "pending": r.pending, "feed_start": r.feed_start,
                            "first_pos": r.drafter_first_pos, "n_feed": int(r.feed_tokens.numel()),
                            "temperature": float(r.temperature), "seed": _seed(r)} for i, r in zip(ids, rows)]}
        arrays = {"tokens": torch.cat([r.feed_tokens for r in rows]).to(torch.int64).numpy(),
                  "aux": torch.cat([r.feed_aux for r in rows]).float().numpy()}
        t0 = time.monotonic()
        if not self.link.send(header, arrays):
            self._down("send_failed")
            return None
        self._closed = []
        self._known |= set(ids)
        reply = self._await(self._seq, t0 + self.deadline_s)
        if reply is None:
            return None
        metrics.ENGINE_REMOTE_DRAFTER_SECONDS.observe(time.monotonic() - t0)
        head, arrays = reply
        if str(head.get("version")) != version:
            self.version = str(head.get("version"))
            self._down("version_change")
            if self.on_version is not None:
                self.on_version(self.version)
            return None
        self.drafted_steps += 1
        return self._as_drafts(rows, arrays)

    def _await(self, seq: int, deadline: float):
        while True:
            msg = self._receive(max(0.0, deadline - time.monotonic()))
            if msg is None:
                self._down("deadline")
                return None
            head = msg[0]
            if head.get("seq") == seq and head.get("op") == wire.DRAFTS:
                return msg
            if head.get("seq") == seq and head.get("op") == wire.ERROR:
                self._down("error")
                return None

    def _as_drafts(self, rows: list[RowInput], arrays: dict[str, np.ndarray]) -> Drafts:
        tokens = torch.from_numpy(arrays["tokens"])
        greedy = [r.temperature <= 0 for r in rows]
        q_probs: list[list[torch.Tensor]] = [[] for _ in rows]
        if "q" in arrays:
            q = torch.from_numpy(arrays["q"])
            vocab = self.vocab_size
            for j, b in enumerate(b for b, g in enumerate(greedy) if not g):
                full = torch.zeros(q.shape[1], vocab)
                full[:, self.d2t] = q[j]
                q_probs[b] = list(full)
        survival = torch.from_numpy(arrays["survival"]) if "survival" in arrays else None
        return Drafts(tokens, torch.from_numpy(arrays["prob"]), survival, greedy, q_probs, [[] for _ in rows])

    def _count(self, version: str, lengths: list[int], accepted: list[int]) -> None:
        """This engine's acceptance (rows with verified drafts), as the engine's accounting counts it."""
        verified = [a for n_b, a in zip(lengths, accepted) if n_b > 0]
        step = VersionAcceptance(len(verified), sum(verified), sum(verified) + len(verified))
        self._acceptance[version] = self._acceptance.get(version, VersionAcceptance()) + step

    def view(self) -> dict:
        return {"url": self.url, "engine_id": self.engine_id, "up": self.up, "service": self.service,
                "version": self.version, "drafted_steps": self.drafted_steps, "fallback_steps": dict(self.fallbacks)}

    def close(self) -> None:
        self.link.close()


def _seed(r: RowInput) -> int:
    """A seed for the service's draws of this row's sampled drafts (any: the verify keeps p)."""
    return int(r.generator.initial_seed()) & 0x7FFFFFFF if r.generator is not None else -1


def remote_drafter(cfg, vocab_size: int) -> RemoteDrafter | None:
    """The engine's client of ``spec.drafter_service`` (None when speculation is off or it is unset);
    it greets the service for up to 2 s, and the engine starts either way (target-only until it answers)."""
    if not (cfg.spec.enabled and cfg.spec.drafter_service):
        return None
    return RemoteDrafter(cfg.spec.drafter_service, vocab_size, cfg.spec.drafter_service_deadline_s,
                         cfg.spec.drafter_service_retry_s, stop_prob=cfg.spec.draft_stop_prob)
