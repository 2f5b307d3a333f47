"""The engine's own step cost: seconds of a verify forward by (batch rows, query tokens), of a
packed verify by (batch rows, total drafts verified) and of drafting by (batch rows, draft depth),
measured at start-up and kept current from live steps.

Why measure instead of assuming a curve: on CPU the row kernel's cost grows with rows x tokens
once past its one-pass limit, so a verify of 4 rows x 5 tokens can cost several target-only steps
while 1 row x 5 tokens costs little more than one. The scheduler (tide/spec/schedule.py) decides
from these figures, so each cell is a measurement of that shape, never an extrapolation from
another batch size. Cells the profile did not measure take the nearest measured cell's value
until a live step of that shape lands; a packed verify's cells between two measured ones of the same
row count are interpolated (the profile measures a grid of total drafts, live steps fill the rest).
"""
from __future__ import annotations

import math
import time

import torch

from tide import metrics

# the drafter feed the draft cells are timed with (a steady step feeds its 1..1+depth committed
# tokens); longer feeds (the prompt after prefill, positions deferred by target-only steps) cost
# extra per position, paid once by the step that drafts next: the cost of switching drafting on
# (the schedulers spread it over the drafted steps it enables: tide/spec/policy.py, amortized_feed)
STEADY_FEED = 2
# weight of one live observation: ~20 steps of a shape replace its start-up figure, while one
# slow step (another process on the core) moves it by a tenth only
LIVE_EWMA = 0.1
# total drafts of a packed verify the start-up profile measures (with every row count's largest):
# each cell is one forward shape; the ones between are interpolated until live steps measure them
PACKED_GRID = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


class StepCostModel:
    """verify_s[rows][tokens] (tokens = pending + drafts, >= 1) and draft_s[rows][depth] (depth >= 1)."""

    def __init__(self, max_rows: int, max_depth: int, ewma: float = LIVE_EWMA) -> None:
        if not 0.0 <= ewma <= 1.0:  # 0: a pinned model that live steps never move (tests, a fixed profile)
            raise ValueError(f"cost ewma must be in [0, 1], got {ewma}")
        self.max_rows, self.max_depth, self.ewma = max_rows, max_depth, ewma
        self._verify = [[math.nan] * (max_depth + 2) for _ in range(max_rows + 1)]
        self._draft = [[math.nan] * (max_depth + 1) for _ in range(max_rows + 1)]
        # seconds of a whole step outside its forwards (feeds, sampling, commit, capture, emit), by
        # rows and [target-only, drafted]: tok/s is made of whole steps, so decisions count it too
        self._overhead = [[math.nan, math.nan] for _ in range(max_rows + 1)]
        self._refeed = [math.nan] * (max_rows + 1)  # drafter seconds per feed position past STEADY_FEED
        # packed verify seconds by rows and total drafts verified (0 = a target-only step's forward)
        self._packed = [[math.nan] * (max_rows * max_depth + 1) for _ in range(max_rows + 1)]
        self._packed_rows: dict[int, list[float]] = {}  # per row count: every cell, interpolated (cache)
        self._drafts_measured = False  # any draft cell (every plan asks: no scan of the table)

    # --- observations -----------------------------------------------------------------------
    def observe_verify(self, rows: int, tokens: int, seconds: float, live: bool = True) -> None:
        self._observe(self._verify, "verify", rows, tokens, seconds, live)

    def observe_packed(self, rows: int, drafts: int, seconds: float, live: bool = True) -> None:
        """A packed verify of ``rows`` rows carrying ``drafts`` drafts in all (each row's pending too)."""
        self._observe(self._packed, "packed", rows, drafts, seconds, live)
        self._packed_rows.pop(rows, None)

    def observe_draft(self, rows: int, depth: int, seconds: float, live: bool = True) -> None:
        if depth >= 1:
            self._observe(self._draft, "draft", rows, depth, seconds, live)
            self._drafts_measured = self._drafts_measured or any(not math.isnan(v) for row in self._draft for v in row)

    def observe_refeed(self, rows: int, extra_positions: int, seconds: float, live: bool = True) -> None:
        """``seconds`` of drafting beyond the steady draft cost for ``extra_positions`` more feed."""
        if 1 <= rows <= self.max_rows and extra_positions > 0 and (self.ewma > 0 or not live):
            per = max(0.0, seconds) / extra_positions
            old = self._refeed[rows]
            self._refeed[rows] = per if math.isnan(old) or not live else old + self.ewma * (per - old)
            metrics.ENGINE_STEP_COST_SECONDS.labels("refeed_per_position", str(rows), "0").set(self._refeed[rows])

    def refeed_s(self, rows: int, feed_positions: int) -> float:
        per = self._refeed[min(max(rows, 1), self.max_rows)]
        return 0.0 if math.isnan(per) else per * max(0, feed_positions - STEADY_FEED)

    def observe_overhead(self, rows: int, drafted: bool, seconds: float) -> None:
        """A live step's wall time minus its forwards (clamped at 0: timer noise)."""
        if 1 <= rows <= self.max_rows and self.ewma > 0:
            cell, seconds = self._overhead[rows], max(0.0, seconds)
            old = cell[drafted]
            cell[drafted] = seconds if math.isnan(old) else old + self.ewma * (seconds - old)
            metrics.ENGINE_STEP_COST_SECONDS.labels("overhead_drafted" if drafted else "overhead", str(rows),
                                                    "0").set(cell[drafted])

    def _observe(self, table, kind: str, rows: int, n: int, seconds: float, live: bool) -> None:
        if not (1 <= rows <= self.max_rows and 0 <= n < len(table[rows])) or not seconds > 0:
            return
        old = table[rows][n]
        table[rows][n] = seconds if math.isnan(old) or not live else old + self.ewma * (seconds - old)
        metrics.ENGINE_STEP_COST_SECONDS.labels(kind, str(rows), str(n)).set(table[rows][n])

    # --- figures ----------------------------------------------------------------------------
    def verify_s(self, rows: int, tokens: int) -> float:
        return _nearest(self._verify, rows, tokens, lo=1)

    def draft_s(self, rows: int, depth: int) -> float:
        if depth <= 0 or not self._drafts_measured:
            return 0.0  # no drafter was profiled (none served at start-up): drafted steps measure it
        return _nearest(self._draft, rows, depth, lo=1)

    def packed_costs(self, rows: int) -> list[float]:
        """Seconds of a packed verify of ``rows`` rows by total drafts 0..rows x max_depth: the
        measured cells made non-decreasing (a verify never costs less for carrying more: a cell
        above a later one is timing noise, pooled with it), linear between two measured ones, else
        the padded verify with as many tokens per row (an upper bound) or the nearest measured cell."""
        rows = min(max(rows, 1), self.max_rows)
        cached = self._packed_rows.get(rows)
        if cached is not None:
            return cached
        cells = _non_decreasing(self._packed[rows][:rows * self.max_depth + 1])
        known = [k for k, v in enumerate(cells) if not math.isnan(v)]
        any_padded = any(not math.isnan(v) for row in self._verify for v in row)
        out = []
        for k, v in enumerate(cells):
            if not math.isnan(v):
                out.append(v)
                continue
            lo = max((j for j in known if j < k), default=None)
            hi = min((j for j in known if j > k), default=None)
            if lo is not None and hi is not None:
                out.append(cells[lo] + (cells[hi] - cells[lo]) * (k - lo) / (hi - lo))
            elif hi is not None:
                out.append(cells[hi])
            elif any_padded:  # (looked up only here: every target-only step re-reads this row's cells)
                padded = self.verify_s(rows, 1 + -(-k // rows))
                out.append(max(padded, cells[lo]) if lo is not None else padded)
            elif lo is not None:
                out.append(cells[lo])
            else:
                raise RuntimeError("step cost model has no measurement yet: profile it first")
        self._packed_rows[rows] = out
        return out

    def packed_s(self, rows: int, drafts: int) -> float:
        costs = self.packed_costs(rows)
        return costs[min(max(drafts, 0), len(costs) - 1)]

    def step_costs(self, rows: int, max_depth: int, drafted: int = 0, feed_positions: int = 0) -> list[float]:
        """Seconds of a step whose longest draft is m, for m = 0..max_depth, when ``drafted`` depths
        are drafted already (their drafter time is spent whatever m is chosen now) and the longest
        drafter feed is ``feed_positions`` (any draft consumes it first)."""
        refeed = self.refeed_s(rows, feed_positions)
        return [self.verify_s(rows, 1 + m) + self.draft_s(rows, max(m, drafted))
                + (refeed if m > 0 or drafted > 0 else 0.0)
                + self.overhead_s(rows, m > 0 or drafted > 0) for m in range(max_depth + 1)]

    def overhead_s(self, rows: int, drafted: bool) -> float:
        """Not measured yet: a drafted step's as a target-only step's (it does at least that), else 0."""
        target_only, spec = self._overhead[min(max(rows, 1), self.max_rows)]
        value = spec if drafted and not math.isnan(spec) else target_only
        return 0.0 if math.isnan(value) else value

    def measured(self) -> bool:
        return not math.isnan(self._verify[1][1])

    def table(self) -> dict:
        """JSON-ready figures (ms) for health views and bench reports."""
        return {"verify_ms": {r: [round(self.verify_s(r, t) * 1e3, 2) for t in range(1, self.max_depth + 2)]
                              for r in range(1, self.max_rows + 1)},
                "draft_ms": {r: [round(self.draft_s(r, d) * 1e3, 2) for d in range(1, self.max_depth + 1)]
                             for r in range(1, self.max_rows + 1)},
                "refeed_ms_per_position": {r: round(self.refeed_s(r, STEADY_FEED + 1) * 1e3, 4)
                                           for r in range(1, self.max_rows + 1)},
                "overhead_ms": {r: [round(self.overhead_s(r, d) * 1e3, 2) for d in (False, True)]
                                for r in range(1, self.max_rows + 1)},
                "packed_verify_ms": {r: [round(v * 1e3, 2) for v in self.packed_costs(r)]
                                     for r in range(1, self.max_rows + 1)}}


def _non_decreasing(cells: list[float]) -> list[float]:
    """The measured (non-NaN) cells fitted non-decreasing in order (pool adjacent violators,
    least squares); NaN cells stay NaN."""
    at = [k for k, v in enumerate(cells) if not math.isnan(v)]
    blocks: list[list[float]] = []  # [mean, count]
    for k in at:
        blocks.append([cells[k], 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, n1), (m2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2]
    out, i = list(cells), 0
    for mean, count in blocks:
        for _ in range(int(count)):
            out[at[i]] = mean
            i += 1
    return out


def _nearest(table, rows: int, n: int, lo: int) -> float:
    rows = min(max(rows, 1), len(table) - 1)
    n = min(max(n, lo), len(table[rows]) - 1)
    if not math.isnan(table[rows][n]):
        return table[rows][n]
    # the nearest measured cell, preferring more rows/tokens (never optimistic about a bigger shape)
    cells = [(abs(r - rows) + abs(t - n), -r, -t, v) for r, row in enumerate(table) for t, v in enumerate(row)
             if not math.isnan(v)]
    if not cells:
        raise RuntimeError("step cost model has no measurement yet: profile it first")
    return min(cells)[3]


def packed_lengths(rows: int, drafts: int) -> list[int]:
    """``drafts`` spread over ``rows`` rows as evenly as they go (the shape a profile times)."""
    return [drafts // rows + (b < drafts % rows) for b in range(rows)]


def profile(target, drafter, tcache, dcache, cost: StepCostModel, context_len: int, reps: int = 2,
            refeed_positions: int = 32, packed: bool = False, head=None) -> None:
    """Time verify forwards and drafts at every (rows, tokens) the engine can run, on the engine's
    own caches before any request uses them (the positions written are overwritten by prefills).
    ``packed``: the packed verify's grid (``PACKED_GRID`` total drafts) instead of the padded one
    (whose one-token cells, a target-only step, are timed either way). ``head``: the confidence
    head the engine's drafts carry (its survivals are part of a draft's time).

    ``context_len`` is the position the timed tokens start at: attention's share of a step grows
    with it, so it should be a typical decode context. The median of ``reps`` runs after one
    warm-up run is kept.
    """
    from tide.spec.decode import RowInput, draft
    from tide.spec.rules import FixedLength

    aux_dim = 3 * target.shape.hidden_size
    for rows in range(1, cost.max_rows + 1):
        slots = torch.arange(rows)
        start = torch.full((rows,), context_len)
        for tokens in range(1, 2 if packed else cost.max_depth + 2):
            fed = torch.zeros(rows, tokens, dtype=torch.long)
            cost.observe_verify(rows, tokens, _median_s(lambda: target.forward(fed, start, tcache, slots), reps),
                                live=False)
        if packed:
            cost.observe_packed(rows, 0, cost.verify_s(rows, 1), live=False)
            most = rows * cost.max_depth
            for drafts in sorted({k for k in PACKED_GRID if 0 < k < most} | {most}):
                lengths = torch.tensor(packed_lengths(rows, drafts)) + 1
                fed = torch.zeros(rows, int(lengths.max()), dtype=torch.long)
                cost.observe_packed(rows, drafts, _median_s(
                    lambda: target.forward(fed, start, tcache, slots, lengths=lengths), reps), live=False)
        if drafter is None:
            continue
        def feed(n: int) -> list[RowInput]:
            return [RowInput(slot=b, t_len=context_len, pending=0, feed_start=context_len - n,
                             feed_tokens=torch.zeros(n, dtype=torch.long), feed_aux=torch.zeros(n, aux_dim))
                    for b in range(rows)]
        batch, every = feed(STEADY_FEED), FixedLength()  # each depth's top probabilities are computed alike
        for depth in range(1, cost.max_depth + 1):
            cost.observe_draft(rows, depth, _median_s(
                lambda: draft(drafter, target.embed_weight, dcache, batch, depth, every, head), reps), live=False)
        long_feed = feed(STEADY_FEED + refeed_positions)
        long_s = _median_s(lambda: draft(drafter, target.embed_weight, dcache, long_feed, 1, every, head), reps)
        cost.observe_refeed(rows, refeed_positions, long_s - cost.draft_s(rows, 1), live=False)


def _median_s(fn, reps: int) -> float:
    with torch.inference_mode():
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]
