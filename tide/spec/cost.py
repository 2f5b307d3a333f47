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

Live steps visit few shapes (at a steady load: the target-only step and a drafted one or two), while
the machine's pace and the requests' context length move every shape's time. So a live step moves
its group's speed (target forwards; the drafter's), which scales every cell of the group, and its
own cell's deviation from the rest more slowly: a shape timed at start-up is never compared with
one timed now as if both were current. Figures are bounded as the hardware is: a verify never costs
less for carrying more tokens or more rows.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Callable

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
# a live step moves its group's speed by the running average's weight and its own cell by this
# share of it: one shape timed slower than its figure is mostly the machine (every shape slows),
# and a shape's own deviation is learnt over its steps at this pace
CELL_SHARE = 0.25


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
        self._verify_rows: dict[int, list[float]] = {}  # per row count: every padded cell, bounded (cache)
        self._drafts_measured = False  # any draft cell (every plan asks: no scan of the table)
        # the cells above are each shape's seconds at speed 1; a figure is its cell x its group's
        # speed (target forwards: verify and packed; the drafter's: draft). A live step moves both
        # (see ``_observe``): the machine's pace and the context's length change every shape's
        # time together, and a cell no live step visits must follow, or the scheduler compares a
        # shape timed now with one timed at start-up and picks on the difference
        self._speed = {"target": 1.0, "drafter": 1.0}

    # --- observations -----------------------------------------------------------------------
    def observe_verify(self, rows: int, tokens: int, seconds: float, live: bool = True) -> None:
        self._observe(self._verify, "verify", rows, tokens, seconds, live)
        _forget_up_to(self._verify_rows, rows)

    def observe_packed(self, rows: int, drafts: int, seconds: float, live: bool = True) -> None:
        """A packed verify of ``rows`` rows carrying ``drafts`` drafts in all (each row's pending too)."""
        self._observe(self._packed, "packed", rows, drafts, seconds, live)
        _forget_up_to(self._packed_rows, rows)

    def observe_target_only(self, rows: int, seconds: float) -> None:
        """A live target-only forward: the padded verify's one-token cell and the packed verify's
        no-draft cell are that one shape (timed once, it moves the speed once)."""
        self.observe_verify(rows, 1, seconds)
        if 1 <= rows <= self.max_rows and seconds > 0:
            self._packed[rows][0] = self._verify[rows][1]
            _forget_up_to(self._packed_rows, rows)

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
        """One timing of a shape. Live, it moves its group's speed toward seconds over the cell's
        figure by ``ewma`` and the cell (its own deviation) toward the rest by ``CELL_SHARE`` of
        that: a steady seconds is the fixed point, reached by a cell its steps visit; every other
        cell of the group follows through the speed."""
        if not (1 <= rows <= self.max_rows and 0 <= n < len(table[rows])) or not seconds > 0:
            return
        group = "drafter" if kind == "draft" else "target"
        speed, old = self._speed[group], table[rows][n]
        if live and not math.isnan(old):
            speed = self._speed[group] = speed + self.ewma * (seconds / old - speed)
            metrics.ENGINE_STEP_COST_SPEED.labels(group).set(speed)
            table[rows][n] = old + self.ewma * CELL_SHARE * (seconds / speed - old)
        else:
            table[rows][n] = seconds / speed
        metrics.ENGINE_STEP_COST_SECONDS.labels(kind, str(rows), str(n)).set(table[rows][n] * speed)

    # --- figures ----------------------------------------------------------------------------
    def verify_s(self, rows: int, tokens: int) -> float:
        # one cell: planning asks for cells one at a time, every step (no list per call)
        return self._verify_cells(rows)[min(max(tokens, 1), self.max_depth + 1)] * self._speed["target"]

    def verify_costs(self, rows: int) -> list[float]:
        """Seconds of a padded verify of ``rows`` rows by tokens per row (index 0 unused, = 1's):
        each cell the nearest measured one, bounded by the same shape with more rows and made
        non-decreasing in tokens (see ``_bounded``)."""
        speed = self._speed["target"]
        return [v * speed for v in self._verify_cells(rows)]

    def _verify_cells(self, rows: int) -> list[float]:
        rows = min(max(rows, 1), self.max_rows)
        cached = self._verify_rows.get(rows)
        if cached is None:
            own = [_nearest(self._verify, rows, t, lo=1) for t in range(self.max_depth + 2)]
            more = self._verify_cells(rows + 1) if rows < self.max_rows else None
            cached = self._verify_rows[rows] = _bounded(own, more)
        return cached

    def draft_s(self, rows: int, depth: int) -> float:
        if depth <= 0 or not self._drafts_measured:
            return 0.0  # no drafter was profiled (none served at start-up): drafted steps measure it
        return _nearest(self._draft, rows, depth, lo=1) * self._speed["drafter"]

    def packed_costs(self, rows: int) -> list[float]:
        """Seconds of a packed verify of ``rows`` rows by total drafts 0..rows x max_depth: the
        measured cells made non-decreasing (a verify never costs less for carrying more: a cell
        above a later one is timing noise, pooled with it), linear between two measured ones, else
        the padded verify with as many tokens per row (an upper bound) or the nearest measured cell;
        then bounded by the same drafts over more rows (``_bounded``)."""
        speed = self._speed["target"]
        return [v * speed for v in self._packed_cells(rows)]

    def _packed_cells(self, rows: int) -> list[float]:
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
                padded = self._verify_cells(rows)[min(1 + -(-k // rows), self.max_depth + 1)]
                out.append(max(padded, cells[lo]) if lo is not None else padded)
            elif lo is not None:
                out.append(cells[lo])
            else:
                raise RuntimeError("step cost model has no measurement yet: profile it first")
        more = self._packed_cells(rows + 1) if rows < self.max_rows else None
        out = self._packed_rows[rows] = _bounded(out, more)
        return out

    def packed_s(self, rows: int, drafts: int) -> float:
        costs = self._packed_cells(rows)
        return costs[min(max(drafts, 0), len(costs) - 1)] * self._speed["target"]

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


def _bounded(cells: list[float], more_rows: list[float] | None) -> list[float]:
    """``cells`` (one row count's costs by drafts or tokens) capped by the next row count's at the
    same index, then each by every later one. A step never costs less for carrying more rows or
    more tokens, so a cell above either bound is a slow timing (another process on the core); left
    as measured, the scheduler would avoid that shape and never time it again."""
    out = [min(v, more_rows[k]) if more_rows is not None and k < len(more_rows) else v for k, v in enumerate(cells)]
    for k in range(len(out) - 2, -1, -1):
        out[k] = min(out[k], out[k + 1])
    return out


def _forget_up_to(cache: dict[int, list[float]], rows: int) -> None:
    """Drop the cached rows a new cell of ``rows`` rows bounds (its own and every smaller count).
    The health view fills the cache from another thread: iterate a copy, tolerate a missing key."""
    for r in list(cache):
        if r <= rows:
            cache.pop(r, None)


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


def profile(target, drafter, tcache, dcache, cost: StepCostModel, context_len: int, reps: int = 3,
            refeed_positions: int = 32, packed: bool = False, head=None) -> None:
    """Time verify forwards and drafts at every (rows, tokens) the engine can run, on the engine's
    own caches before any request uses them (the positions written are overwritten by prefills).
    ``packed``: the packed verify's grid (``PACKED_GRID`` total drafts) as well as the padded one
    (a packed step whose rows verify as many drafts each runs the padded shape's plain forward).
    ``head``: the confidence head the engine's drafts carry (its survivals are part of a draft's time).

    ``context_len`` is the position the timed tokens start at: attention's share of a step grows
    with it, so it should be a typical decode context. Every shape is run once to warm up, then the
    whole grid ``reps`` times over and each shape's fastest run kept: a slower run is another
    process's time on the core, not the shape's, and such a spell lasts longer than one shape's
    runs, so the grid's passes (not one shape's runs back to back) are what it hits only once.
    Live steps then move each cell to what steps of that shape take here.
    """
    shapes = profile_shapes(target, drafter, tcache, dcache, cost.max_rows, cost.max_depth, context_len,
                             refeed_positions, packed, head)
    seconds = fastest_over_passes([fn for _, fn in shapes], reps)
    for (shape, _), s in zip(shapes, seconds):
        kind, rows, n = shape
        if kind == "verify":
            cost.observe_verify(rows, n, s, live=False)
            if packed and (n == 1 or rows == 1):  # without drafts, or on one row, it is this forward
                cost.observe_packed(rows, n - 1, s, live=False)
        elif kind == "packed":
            cost.observe_packed(rows, n, s, live=False)
        elif kind == "draft":
            cost.observe_draft(rows, n, s, live=False)
    for (shape, _), s in zip(shapes, seconds):  # after the draft cells: the feed's cost is past a steady draft's
        kind, rows, n = shape
        if kind == "refeed":
            cost.observe_refeed(rows, n, s - cost.draft_s(rows, 1), live=False)


def profile_shapes(target, drafter, tcache, dcache, max_rows: int, max_depth: int, context_len: int,
                    refeed_positions: int, packed: bool, head) -> list[tuple[tuple[str, int, int], Callable]]:
    """((kind, rows, tokens | drafts | depth | extra feed), a run of that shape) for every shape profiled."""
    from tide.spec.decode import RowInput, draft
    from tide.spec.rules import FixedLength

    aux_dim, every = 3 * target.shape.hidden_size, FixedLength()  # each depth's top probabilities computed alike
    shapes: list[tuple[tuple[str, int, int], Callable]] = []
    for rows in range(1, max_rows + 1):
        slots, start = torch.arange(rows), torch.full((rows,), context_len)
        for tokens in range(1, max_depth + 2):  # rows verifying as many drafts each run this plain forward
            fed = torch.zeros(rows, tokens, dtype=torch.long)
            shapes.append((("verify", rows, tokens), functools.partial(target.forward, fed, start, tcache, slots)))
        if packed and rows > 1:  # one row's verify is always the plain forward, timed above
            most = rows * max_depth
            for drafts in sorted({k for k in PACKED_GRID if 0 < k < most} | {most}):
                # an even split runs the plain forward (timed above), but its total mostly splits
                # unevenly (the admission ranks rows): the packed cell is the packed path's
                lengths = packed_lengths(rows, drafts)
                fed = torch.zeros(rows, 1 + max(lengths), dtype=torch.long)
                run = functools.partial(target.forward, lengths=torch.tensor(lengths) + 1)
                shapes.append((("packed", rows, drafts), functools.partial(run, fed, start, tcache, slots)))
        if drafter is None:
            continue
        def feed(n: int, rows: int = rows) -> list[RowInput]:
            return [RowInput(slot=b, t_len=context_len, pending=0, feed_start=context_len - n,
                             feed_tokens=torch.zeros(n, dtype=torch.long), feed_aux=torch.zeros(n, aux_dim))
                    for b in range(rows)]
        for depth in range(1, max_depth + 1):
            shapes.append((("draft", rows, depth),
                           functools.partial(draft, drafter, target.embed_weight, dcache, feed(STEADY_FEED), depth,
                                             every, head)))
        shapes.append((("refeed", rows, refeed_positions),
                       functools.partial(draft, drafter, target.embed_weight, dcache,
                                         feed(STEADY_FEED + refeed_positions), 1, every, head)))
    return shapes


def fastest_over_passes(runs: list[Callable], reps: int) -> list[float]:
    """Each run's fastest of ``reps`` timings, taken in ``reps`` passes over all of them after one
    warm-up pass."""
    best = [math.inf] * len(runs)
    with torch.inference_mode():
        for fn in runs:
            fn()
        for _ in range(reps):
            for i, fn in enumerate(runs):
                t0 = time.perf_counter()
                fn()
                best[i] = min(best[i], time.perf_counter() - t0)
    return best
