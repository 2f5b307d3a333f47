"""The drafter service's loop: one drafter drafting for every engine it serves (StarSD).

One thread owns the drafter, its KV cache and the sessions. Each turn:
1. take every message waiting on the sockets (block up to 50 ms only when there is no work):
   hellos, pings, and draft requests into one global queue, an engine's newer request replacing
   its older one still queued (that engine gave up on it; the newer one re-feeds its positions);
2. apply a pending swap (the follower's: tide/ops/follower.py through ``DrafterHost``): a new
   cache, every session fresh, drafts tagged with the new version from here on;
3. draft one batch: queued requests in arrival order, across engines, up to ``max_batch_rows``
   rows, in one ``tide.spec.decode.draft`` call (each row its own session's cache slot, each
   request its own depth and stop rule), and reply to each engine. The loop is work-conserving:
   it drafts whenever any engine waits, so drafting for one engine overlaps the others' verifies.
The service keeps its own cost table (seconds of a batch by rows and depth, an EWMA) and its busy
fraction (utilisation); both are in ``health`` and /metrics.
"""
from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import numpy as np
import torch

from tide import metrics
from tide.contracts import VersionAcceptance
from tide.drafter.artifact import DrafterError, TargetSpec, load_drafter
from tide.drafter.confidence import serving_head
from tide.drafter.model import Eagle3Drafter, for_serving
from tide.drafting import wire
from tide.drafting.sessions import SessionTable
from tide.drafting.transport import ServiceSockets
from tide.spec.decode import Drafts, RowInput, draft

log = logging.getLogger(__name__)
IDLE_WAIT_S = 0.05
COST_EWMA = 0.2


class RowStops:
    """``draft``'s planner over a batch of requests: each request's rows draft up to its ``gamma``
    and stop below its ``stop_prob`` (the stop rule: a row stops after a draft it is unsure of)."""

    packed = False

    def __init__(self, gammas: list[int], stops: list[float]) -> None:
        self.gammas, self.stops = torch.tensor(gammas), torch.tensor(stops)

    def go_on(self, drafts: Drafts) -> bool:
        sure = (drafts.prob >= self.stops[:, None]).all(dim=1)
        return bool((sure & (self.gammas > drafts.depth)).any())

    def lengths(self, drafts: Drafts) -> list[int]:
        return [min(drafts.depth, int(g)) for g in self.gammas]


@dataclass
class EngineState:
    engine: str
    kind: str
    identity: bytes
    acceptance: dict[str, VersionAcceptance] = field(default_factory=dict)  # as the engine last reported it
    requests: int = 0


class DrafterHost:
    """What the follower swaps (the engine contract's drafter half): the serving drafter, its
    version, and a pending swap the loop applies between batches."""

    def __init__(self, drafter: Eagle3Drafter, version: str, spec: TargetSpec, embed: torch.Tensor,
                 vocab_digest: str | None) -> None:
        self._drafter, self._version = for_serving(drafter), version
        self.spec, self.embed, self.vocab_digest = spec, embed, vocab_digest
        self.pending: tuple[Eagle3Drafter, str] | None = None
        self.tokenizer = None

    @property
    def drafter_version(self) -> str:
        return self._version

    @property
    def drafter(self) -> Eagle3Drafter:
        return self._drafter

    def validate_drafter(self, folder, smoke_prompt_ids: list[int]) -> Eagle3Drafter:
        """Checksum, config bounds, shapes, aux layers and the vocab mapping (tide/drafter/artifact.py);
        then a smoke draft that must give finite probabilities (there is no target here: each
        engine's verify keeps output lossless whatever the drafts are)."""
        drafter = load_drafter(folder, self.spec, self.vocab_digest, require_checksum=True)
        n = len(smoke_prompt_ids)
        row = RowInput(slot=0, t_len=n, pending=smoke_prompt_ids[-1], feed_start=0,
                       feed_tokens=torch.tensor(smoke_prompt_ids), feed_aux=torch.zeros(n, 3 * self.spec.hidden_size))
        out = draft(drafter, self.embed, drafter.new_cache(1, n + 8), [row], 4)
        if not torch.isfinite(out.prob).all():
            raise DrafterError(f"{folder}: smoke draft gives non-finite probabilities")
        return drafter

    def swap_drafter(self, drafter: Eagle3Drafter, version: str) -> None:
        self.pending = (for_serving(drafter), version)

    def take_swap(self) -> tuple[Eagle3Drafter, str] | None:
        swap, self.pending = self.pending, None
        if swap is not None:
            self._drafter, self._version = swap
        return swap


class DraftServer:
    def __init__(self, host: DrafterHost, sockets: ServiceSockets, limits: wire.Limits, max_sessions: int = 256,
                 idle_s: float = 600.0, max_batch_rows: int = 32) -> None:
        if max_sessions < max_batch_rows:
            raise ValueError(f"max_sessions ({max_sessions}) must be >= max_batch_rows ({max_batch_rows})")
        self.host, self.sockets, self.limits = host, sockets, limits
        self.max_batch_rows = max_batch_rows
        self.service_id = uuid.uuid4().hex[:12]
        self.sessions = SessionTable(max_sessions, idle_s)
        self.engines: dict[bytes, EngineState] = {}
        self._queue: dict[bytes, tuple[str, dict, dict, float]] = {}  # identity -> (kind, header, arrays, t)
        self._cache_len = limits.max_seq_len + limits.max_depth + 4
        self._cache = host.drafter.new_cache(max_sessions, self._cache_len)
        self._head = serving_head(host.drafter.confidence)[0]
        self._d2t = host.drafter.draft_to_target.numpy().astype(np.int64)
        self.cost: dict[tuple[int, int], float] = {}  # (rows, depth) -> seconds of a batch
        self.busy_s, self.started = 0.0, time.monotonic()
        self.idle_s = 0.0  # waiting for a message with nothing queued: the loop's only non-work
        self._window = [time.monotonic(), 0.0]  # utilisation over the last few seconds
        self.utilisation = 0.0
        self._served = host.drafter_version
        metrics.DRAFTER_SERVICE_INFO.labels(self._served).set(1)

    # --- the loop ----------------------------------------------------------------------------
    def serve(self, stop) -> None:
        last_expire = time.monotonic()
        while not stop.is_set():
            try:
                self.turn()
            except Exception:  # noqa: BLE001 - one bad batch must not end the service: its engines time out
                log.exception("drafter service: a turn failed; continuing")
            if time.monotonic() - last_expire > 5.0:
                self.sessions.expire()
                last_expire = time.monotonic()

    def turn(self) -> None:
        wait_s, t0 = (0.0 if self._queue else IDLE_WAIT_S), time.monotonic()
        messages = self.sockets.poll(wait_s)
        if wait_s:
            self.idle_s += time.monotonic() - t0
        for kind, identity, header, arrays in messages:
            self._on_message(kind, identity, header, arrays)
        self._apply_swap()
        if self._queue:
            self._batch()
        self._gauges()

    def _on_message(self, kind: str, identity: bytes, header: dict, arrays: dict) -> None:
        op = header.get("op")
        if op == wire.HELLO:
            engine = str(header.get("engine", ""))[:200]
            old = self.engines.get(identity)
            if old is not None and old.engine != engine:
                self.sessions.close_engine(old.engine)
            try:
                self.sockets.attach(kind, identity, header.get("shm"))
            except (OSError, ValueError) as exc:  # a ring this process cannot map: frames only
                log.warning("engine %s: cannot attach its ring (%s); it must send frames", engine, exc)
            self.engines[identity] = EngineState(engine, kind, identity)
            self.sockets.send(kind, identity, {"op": wire.WELCOME, "service": self.service_id,
                                               "version": self.host.drafter_version}, {"d2t": self._d2t})
        elif op == wire.PING:
            self.sockets.send(kind, identity, {"op": wire.PONG, "service": self.service_id,
                                               "version": self.host.drafter_version})
        elif op == wire.DRAFT:
            if identity not in self.engines:
                metrics.DRAFTER_SERVICE_REQUESTS.labels("unknown_engine").inc()
                self._error(kind, identity, header, wire.UNKNOWN_ENGINE)
                return
            if identity in self._queue:  # that engine moved on without this reply
                metrics.DRAFTER_SERVICE_REQUESTS.labels("superseded").inc()
            self._queue[identity] = (kind, header, arrays, time.monotonic())
            self._queue[identity] = self._queue.pop(identity)  # arrival order
        else:
            metrics.DRAFTER_SERVICE_REQUESTS.labels("invalid").inc()
            self._error(kind, identity, header, header.get("reason", f"unknown op {op!r}"))

    def _error(self, kind: str, identity: bytes, header: dict, reason: str) -> None:
        self.sockets.send(kind, identity, {"op": wire.ERROR, "seq": header.get("seq"), "reason": reason,
                                           "service": self.service_id})

    def _apply_swap(self) -> None:
        swap = self.host.take_swap()
        if swap is None:
            return
        drafter, version = swap
        metrics.DRAFTER_SERVICE_INFO.labels(self._served).set(0)
        self._served = version
        self._cache = drafter.new_cache(self.sessions.max_sessions, self._cache_len)
        self._head = serving_head(drafter.confidence)[0]
        self.sessions.reset()
        metrics.DRAFTER_SERVICE_INFO.labels(version).set(1)
        log.info("drafter service: serving drafter %s for every engine", version)

    # --- one batch across engines ------------------------------------------------------------
    def _batch(self) -> None:
        taken, rows_n = [], 0
        for identity in list(self._queue):
            rows = self._queue[identity][1].get("rows")
            n = len(rows) if isinstance(rows, list) else 0
            if taken and rows_n + n > self.max_batch_rows:
                break
            taken.append((identity, *self._queue.pop(identity)))
            rows_n += n
        batch, requests = [], []
        protect = {(self.engines[t[0]].engine, r.get("id")) for t in taken for r in t[2].get("rows") or []
                   if isinstance(r, dict)}
        for identity, kind, header, arrays, t_in in taken:
            state = self.engines[identity]
            closed = header.get("closed")  # before this batch takes sessions: ended requests make room
            self.sessions.close((state.engine, str(i)) for i in (closed if isinstance(closed, list) else []))
            try:
                rows = self._rows(state, header, arrays, protect)
            except (wire.WireError, RuntimeError) as exc:
                metrics.DRAFTER_SERVICE_REQUESTS.labels("invalid").inc()
                self._error(kind, identity, header, str(exc))
                continue
            state.requests += 1
            reported = wire.check_acceptance(header.get("acceptance"))
            state.acceptance = state.acceptance if reported is None else reported
            metrics.DRAFTER_SERVICE_QUEUE_SECONDS.observe(time.monotonic() - t_in)
            requests.append((identity, kind, header, len(batch), len(rows)))
            batch += rows
        if not batch:
            return
        gammas = [h["gamma"] for _, _, h, _, n in requests for _ in range(n)]
        stops = [float(h["stop_prob"]) for _, _, h, _, n in requests for _ in range(n)]
        t0 = time.perf_counter()
        drafts = draft(self.host.drafter, self.host.embed, self._cache, batch, max(gammas), RowStops(gammas, stops),
                       self._head)
        spent = time.perf_counter() - t0
        self._observe_cost(len(batch), drafts.depth, spent)
        for identity, kind, header, at, n in requests:
            self._reply(identity, kind, header, drafts, at, n)
            metrics.DRAFTER_SERVICE_REQUESTS.labels("drafted").inc()

    def _rows(self, state: EngineState, header: dict, arrays: dict, protect: set) -> list[RowInput]:
        rows = wire.check_draft(header, arrays, self.limits)
        tokens, aux = torch.from_numpy(arrays["tokens"]), torch.from_numpy(arrays["aux"])
        out, at = [], 0
        for r in rows:
            s = self.sessions.get((state.engine, r["id"]), r["feed_start"], r["seed"], protect)
            n = r["n_feed"]
            out.append(RowInput(slot=s.slot, t_len=r["t_len"], pending=r["pending"], feed_start=r["feed_start"],
                                feed_tokens=tokens[at:at + n], feed_aux=aux[at:at + n],
                                temperature=float(r["temperature"]), generator=s.generator,
                                drafter_first_pos=max(r["first_pos"], s.first_pos)))
            at += n
        return out

    def _reply(self, identity: bytes, kind: str, header: dict, drafts: Drafts, at: int, n: int) -> None:
        depth = min(drafts.depth, header["gamma"])
        part = slice(at, at + n)
        arrays = {"tokens": drafts.tokens[part, :depth].numpy(), "prob": drafts.prob[part, :depth].float().numpy()}
        if drafts.survival is not None:
            arrays["survival"] = drafts.survival[part, :depth].float().numpy()
        sampled = [b for b in range(at, at + n) if not drafts.greedy[b]]
        if sampled:  # each sampled row's q over the draft vocab (the rest of the target vocab is 0)
            d2t = self.host.drafter.draft_to_target
            arrays["q"] = torch.stack([torch.stack(drafts.q_probs[b][:depth])[:, d2t] for b in sampled]).numpy()
        self.sockets.send(kind, identity, {"op": wire.DRAFTS, "seq": header.get("seq"), "service": self.service_id,
                                           "version": self.host.drafter_version, "depth": depth}, arrays)

    # --- cost table and utilisation ----------------------------------------------------------
    def _observe_cost(self, rows: int, depth: int, seconds: float) -> None:
        old = self.cost.get((rows, depth))
        self.cost[(rows, depth)] = seconds if old is None else old + COST_EWMA * (seconds - old)
        self.busy_s += seconds
        self._window[1] += seconds
        metrics.DRAFTER_SERVICE_BATCH_ROWS.observe(rows)
        metrics.DRAFTER_SERVICE_DRAFT_SECONDS.observe(seconds)

    def _gauges(self) -> None:
        now = time.monotonic()
        if now - self._window[0] >= 2.0:
            self.utilisation = min(1.0, self._window[1] / (now - self._window[0]))
            self._window = [now, 0.0]
            metrics.DRAFTER_SERVICE_UTILISATION.set(self.utilisation)
            metrics.DRAFTER_SERVICE_SESSIONS.set(len(self.sessions))
            metrics.DRAFTER_SERVICE_ENGINES.set(len(self.engines))
            metrics.DRAFTER_SERVICE_EVICTED.set(self.sessions.evicted)

    def reporting_engines(self) -> list[str]:
        """Engines that reported acceptance (any thread: a snapshot)."""
        return [s.engine for s in list(self.engines.values()) if s.acceptance]

    def acceptance_of(self, engine: str) -> dict[str, VersionAcceptance]:
        for s in list(self.engines.values()):
            if s.engine == engine:
                return dict(s.acceptance)
        return {}

    def health(self) -> dict:
        return {"service": self.service_id, "drafter_version": self.host.drafter_version,
                "engines": {s.engine: {"sessions": self.sessions.engines().get(s.engine, 0), "requests": s.requests}
                            for s in list(self.engines.values())},
                "sessions": len(self.sessions), "evicted": self.sessions.evicted,
                "utilisation": round(self.utilisation, 3), "busy_s": round(self.busy_s, 3),
                "idle_s": round(self.idle_s, 3), "cpu_s": round(time.process_time(), 3),
                "cost_ms": {f"{r}x{d}": round(s * 1e3, 3) for (r, d), s in sorted(self.cost.items())}}
