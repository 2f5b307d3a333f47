"""The cost scheduler: how many tokens to draft this step, from expected accepted tokens per second.

A step with longest draft m costs ``verify(B, 1+m) + draft(B, m)`` (tide/spec/cost.py) and commits
``B + sum_b sum_{j<=m} P_b(j)`` tokens in expectation, where ``P_b(j)`` is the probability that row
b's draft j survives verification (all of drafts 1..j accepted). The verify forward is one padded
[B, 1+m] block, so its cost depends on the longest draft only: once one row drafts to depth m the
other rows' drafts up to m are free. Greedy prefix allocation under that cost therefore raises
every row's draft one depth at a time, the marginal gain of a depth being the sum of its rows'
survivals and its marginal cost the step's extra seconds; the level kept is the one with the most
expected tokens per second over all levels (a staircase in the cost curve can make depth 2 pay
where depth 1 alone does not, so no level is skipped because the one before it did not pay).

Where ``P_b(j)`` comes from:
- before drafting, from the workload's running per-depth acceptance (``AcceptanceTracker``):
  that is what lets a step that would not pay skip the drafter forward entirely;
- while drafting, each greedy row's live survival: the calibrated confidence head's chain when the
  drafter has one, else the product of the drafter's top probabilities scaled per depth by the
  ratio of observed accepts to predicted ones (raw top probabilities are over-confident); depths
  not drafted yet extend the live figure with the running acceptance;
- a peek: where the running acceptance says no draft pays, the drafter still runs one depth when
  the workload's recent drafted rows show that what the live signal keeps pays (``peek_rate``);
  the live signal then decides what is verified (the stop rule's strength, priced).
Truncating drafts never changes what is committed (tide/spec/decode.py accepts a prefix of the
draft), so any decision here is lossless.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# before a workload's first verified drafts: optimistic enough that speculation is tried (and
# measured) at low load, where it pays for any drafter worth serving
PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 4.0  # pseudo-observations behind the prior
TRACK_DECAY = 0.02  # weight of one observation in the running rates (~50 recent drafts)
# weight of one verified draft in the live signal's calibration (~200 recent drafts): the chain
# carries what moves from row to row; its calibration is a property of the drafter on the
# workload, and a noisy one feeds back: a low estimate drafts less, so it is corrected less often
CALIB_DECAY = 0.005
# drafting must promise this much more tokens/s than target-only: near break-even the estimates'
# noise (running acceptance, live step timings) decides, and a wrong guess to draft costs a whole
# verify while a wrong guess not to costs a fraction of a token per row
MIN_GAIN = 0.03
PEEK_HISTORY = 64  # recent drafted rows of a workload whose kept depth and accepts price a peek


def best_level(expected_per_depth: list[float], n_rows: int, costs_s: list[float], min_gain: float = MIN_GAIN) -> int:
    """The draft depth m (0..len(costs_s)-1) with the most expected tokens per second.

    ``expected_per_depth[j-1]`` = sum over rows of P_b(j); ``costs_s[m]`` = seconds of a step with
    longest draft m. Ties go to the shorter draft (the same tokens for less drafter work); any
    draft must beat drafting nothing by ``min_gain``.
    """
    best_m, best_rate, tokens = 0, n_rows / costs_s[0] * (1 + min_gain), float(n_rows)
    for m in range(1, len(costs_s)):
        tokens += expected_per_depth[m - 1] if m - 1 < len(expected_per_depth) else 0.0
        rate = tokens / costs_s[m]
        if rate > best_rate * (1 + 1e-9):
            best_m, best_rate = m, rate
    return best_m


def peek_rate(trackers: list["AcceptanceTracker"], caps: list[int], cost_at) -> float | None:
    """Expected tokens/s of a step that drafts and keeps only what the live signal keeps (a peek),
    from each row's workload's recent (kept depth, accepted) outcomes; None while a row has none.

    A workload whose average acceptance does not pay can still pay this way: the live signal keeps
    the few confident drafts and truncates the rest before they cost a verify. ``cost_at(ran)[m]``:
    step seconds with longest kept draft m after ``ran`` drafted depths; a draft kept to depth L
    ran L+1 depths (the one the signal stopped at). Rows' outcomes are taken as independent.
    """
    depth = max(caps)
    tokens, at_most = float(len(trackers)), [1.0] * (depth + 1)  # at_most[L]: P(longest kept <= L)
    summaries: dict[tuple[int, int], tuple[float, list[float]]] = {}  # rows of one workload share one
    for t, c in zip(trackers, caps):
        if c <= 0:
            continue
        key = (id(t), c)
        if key not in summaries:
            if not t.kept:
                return None
            summaries[key] = t.peek_summary(c, depth)
        accepted, cdf = summaries[key]
        tokens += accepted
        at_most = [a * f for a, f in zip(at_most, cdf)]
    seconds, below, costs = 0.0, 0.0, {}
    for level in range(depth + 1):
        ran = min(level + 1, depth)
        if ran not in costs:
            costs[ran] = cost_at(ran)
        seconds += (at_most[level] - below) * costs[ran][level]
        below = at_most[level]
    return tokens / seconds


@dataclass
class AcceptanceTracker:
    """Running acceptance of one drafter on one workload, per draft depth."""

    depth: int
    # conditional acceptance: P(draft j accepted | draft j-1 accepted), as (accepts, trials)
    cond: list[list[float]] = field(default_factory=list)
    # live-survival calibration: (observed accepts, predicted survival) per depth
    calib: list[list[float]] = field(default_factory=list)
    drafts_seen: int = 0
    # (depth kept, accepted) of recent drafted rows with a live signal: what a peek delivers; and
    # their counts by [kept][accepted], so pricing a peek costs the same however long the history
    kept: deque = field(default_factory=lambda: deque(maxlen=PEEK_HISTORY))
    kept_counts: list[list[int]] = field(default_factory=list)
    # raw live chains of recent drafted greedy rows (tide/spec/admission.py prices drafting on them)
    chains: deque = field(default_factory=lambda: deque(maxlen=PEEK_HISTORY))

    def __post_init__(self) -> None:
        self.cond = [[PRIOR_ACCEPTANCE * PRIOR_WEIGHT, PRIOR_WEIGHT] for _ in range(self.depth)]
        self.calib = [[PRIOR_WEIGHT, PRIOR_WEIGHT] for _ in range(self.depth)]
        self.kept_counts = [[0] * (self.depth + 1) for _ in range(self.depth + 1)]

    def conditional(self) -> list[float]:
        return [a / t for a, t in self.cond]

    def survival(self) -> list[float]:
        """P(draft j survives) for j = 1..depth from the running rates alone."""
        out, p = [], 1.0
        for a in self.conditional():
            p *= a
            out.append(p)
        return out

    def calibrate(self, depth: int, raw: float) -> float:
        obs, pred = self.calib[depth - 1]
        return min(1.0, raw * obs / pred)

    def observe(self, drafted: int, accepted: int, raw_chain: list[float] | None, ran: int = 0,
                chosen: int | None = None) -> None:
        """One verified row: ``drafted`` tokens kept, the first ``accepted`` of them accepted;
        ``raw_chain[j-1]`` the live survival predicted for draft j (None for rows without a live
        signal); ``ran`` the depths the drafter ran (>= drafted); ``chosen`` the depth the plan
        would have kept without a probe's forced minimum.

        A draft the live signal truncated is never verified; where the kept ones all survived, the
        first truncated depth counts as a trial with its calibrated conditional survival as a soft
        outcome, so a drafter whose own signal keeps truncating is learnt to be poor (and gated)
        instead of being run every step at its prior rate."""
        keep, keep_calib = 1.0 - TRACK_DECAY, 1.0 - CALIB_DECAY
        for j in range(1, min(drafted, self.depth) + 1):
            if accepted >= j - 1:  # draft j was a trial only if j-1 survived
                c = self.cond[j - 1]
                c[0], c[1] = c[0] * keep + (accepted >= j), c[1] * keep + 1.0
            if raw_chain is not None and j <= len(raw_chain):
                k = self.calib[j - 1]
                k[0], k[1] = k[0] * keep_calib + (accepted >= j), k[1] * keep_calib + raw_chain[j - 1]
        j = drafted + 1
        if raw_chain is not None and accepted == drafted and j <= min(ran, self.depth, len(raw_chain)):
            before = self.calibrate(j - 1, raw_chain[j - 2]) if j > 1 else 1.0
            soft = min(1.0, self.calibrate(j, raw_chain[j - 1]) / before) if before > 0 else 0.0
            c = self.cond[j - 1]
            c[0], c[1] = c[0] * keep + soft, c[1] * keep + 1.0
        self.drafts_seen += ran > 0
        if raw_chain is not None and ran > 0:
            kept = min(drafted if chosen is None else min(drafted, chosen), self.depth)
            self.remember(kept, min(accepted, kept))

    def remember(self, kept: int, accepted: int) -> None:
        """One drafted row's outcome: ``kept`` drafts verified, ``accepted`` of them accepted."""
        if len(self.kept) == self.kept.maxlen:
            old_kept, old_accepted = self.kept[0]
            self.kept_counts[old_kept][old_accepted] -= 1
        self.kept.append((kept, accepted))
        self.kept_counts[kept][accepted] += 1

    def peek_summary(self, cap: int, depth: int) -> tuple[float, list[float]]:
        """(mean accepted drafts, P(kept depth <= L) for L = 0..depth) of recent peeks, drafts
        beyond ``cap`` not counted."""
        n = len(self.kept)
        accepted = sum(c * min(a, cap) for row in self.kept_counts for a, c in enumerate(row) if c) / n
        cdf, total = [], 0
        for level in range(depth + 1):
            total += sum(self.kept_counts[level])
            cdf.append(total / n if level < cap else 1.0)
        return accepted, cdf


class StepPlan:
    """One step's draft-length decisions; the step's planner (``tide.spec.decode.Planner``): one
    level for every row, verified padded to it.

    ``trackers[b]`` is row b's workload tracker, ``caps[b]`` the most row b may keep (0 for a
    workload whose speculation is off), ``cost_at(drafted)`` the step costs by level given the
    depths already drafted.
    """

    packed = False

    def __init__(self, trackers: list[AcceptanceTracker], caps: list[int], cost_at, max_depth: int,
                 min_level: int = 0) -> None:
        self.trackers, self.caps, self.cost_at, self.max_depth = trackers, caps, cost_at, max_depth
        self.min_level = min_level  # > 0 for a probe: verify at least this deep to refresh the rates
        self.prior = [t.survival() for t in trackers]
        self.cond = [t.conditional() for t in trackers]
        self.raw_chain: list[list[float] | None] = [None] * len(trackers)
        self.level = 0
        self.chosen = 0  # the last level chosen before a probe's forced minimum
        self.drafted = 0  # set by draft(): the depths the drafter ran

    def initial_level(self) -> int:
        """The level planned from running acceptance (or 1 where a peek pays: the live signal then
        decides what is kept); 0 = no drafter forward this step."""
        self.level = self._choose(0, self.prior)
        if self.level == 0:
            rate = peek_rate(self.trackers, self.caps, self.cost_at)
            if rate is not None and rate > len(self.trackers) / self.cost_at(0)[0] * (1 + MIN_GAIN):
                self.level = 1
        return self.level

    def after_depth(self, depth: int, raw: list[float | None]) -> int:
        """``depth`` drafts are done; ``raw[b]`` is row b's live chain survival of draft ``depth``
        (None: none). Returns the level to keep (the drafter goes on while it exceeds ``depth``)."""
        expected = []
        for b, t in enumerate(self.trackers):
            if raw[b] is not None:
                chain = self.raw_chain[b] = (self.raw_chain[b] or []) + [raw[b]]
                live = [t.calibrate(j + 1, v) for j, v in enumerate(chain)]
            else:
                live = self.prior[b][:depth]
            p = live[-1] if live else 1.0
            for a in self.cond[b][depth:]:
                p *= a
                live.append(p)
            expected.append(live)
        self.level = self._choose(depth, expected)
        return self.level

    def go_on(self, drafts) -> bool:
        """Planner: after ``drafts.depth`` depths, go on while the level chosen on the live signal
        (greedy rows' chains) is deeper."""
        chain = drafts.chain()[:, -1].tolist()
        depth = drafts.depth
        return self.after_depth(depth, [c if g else None for c, g in zip(chain, drafts.greedy)]) > depth

    def lengths(self, drafts) -> list[int]:
        self.drafted = drafts.depth  # the depths the drafter ran: its cost
        return [min(drafts.depth, self.level, cap) for cap in self.caps]

    def _choose(self, drafted: int, survival: list[list[float]]) -> int:
        sums = [sum(s[j] for b, s in enumerate(survival) if self.caps[b] > j) for j in range(self.max_depth)]
        self.chosen = best_level(sums, len(survival), self.cost_at(drafted))
        return max(self.chosen, min(self.min_level, self.max_depth))


class WorkloadGate:
    """Speculation on/off per workload for the serving drafter.

    Off when the workload's running acceptance does not pay for drafting even for one row alone
    (the load where speculation pays most); while off its rows decode target-only and every
    ``probe_steps``-th step of the workload drafts anyway (a probe) so the rates stay current and
    the gate can switch back on, once the rates promise ``REOPEN_GAIN`` (hysteresis: near the
    threshold a few probes' outcomes would otherwise flip it each time). A new drafter starts with
    every workload on.
    """

    REOPEN_GAIN = 2 * MIN_GAIN

    # drafted steps before judging: about the prior's weight, so the prior alone never gates
    def __init__(self, probe_steps: int, min_drafts: int = 4) -> None:
        if probe_steps < 1:
            raise ValueError(f"spec.gate_probe_steps must be >= 1, got {probe_steps}")
        self.probe_steps, self.min_drafts = probe_steps, min_drafts
        self.state: dict[str, dict] = {}  # workload -> {"on", "reason", "since_probe"}

    def reset(self, reason: str) -> list[tuple[str, bool, str]]:
        changed = [(w, True, reason) for w, s in self.state.items() if not s["on"]]
        self.state = {w: {"on": True, "reason": reason, "since_probe": 0} for w in self.state}
        return changed

    def decide(self, workload: str, tracker: AcceptanceTracker, solo_cost_at,
               pays_at=None) -> tuple[bool, bool, str | None]:
        """(on, probe this step, reason if the state changed); ``solo_cost_at(ran)``: one row's
        step costs by level after ``ran`` drafted depths; ``pays_at(bar)`` (another scheduler's
        rule, instead of those costs): does drafting for one row alone beat target-only by ``bar``."""
        s = self.state.setdefault(workload, {"on": True, "reason": "default", "since_probe": 0})
        changed = None
        # judged again once the workload's acceptance has moved (a drafted step of it): between
        # those its figures, and so the verdict, stay as they were (the step costs drift slowly)
        judged = s.get("judged")  # (the tracker, its drafts_seen) last judged
        if tracker.drafts_seen >= self.min_drafts and (judged is None or judged[0] is not tracker
                                                       or judged[1] != tracker.drafts_seen):
            s["judged"] = (tracker, tracker.drafts_seen)
            bar = MIN_GAIN if s["on"] else self.REOPEN_GAIN
            pays = pays_at(bar) if pays_at is not None else best_level(tracker.survival(), 1, solo_cost_at(0), bar) > 0 \
                or ((peek := peek_rate([tracker], [tracker.depth], solo_cost_at)) is not None
                    and peek > (1 + bar) / solo_cost_at(0)[0])
            if pays != s["on"]:
                s["on"], s["reason"] = pays, "acceptance_pays" if pays else "acceptance_below_cost"
                changed = s["reason"]
        probe = False
        if not s["on"]:
            s["since_probe"] += 1
            if s["since_probe"] >= self.probe_steps:
                s["since_probe"], probe = 0, True
        return s["on"], probe, changed


class RealizedRate:
    """What drafted steps actually delivered, by batch rows: committed tokens per second of whole
    steps (everything the cost model does not see included: tokens past a request's budget, cache
    effects), against the measured target-only step. The drafter's catch-up feed (a new prompt,
    positions deferred by target-only steps) counts as the schedulers charge it, spread over the
    drafted steps it enables (the caller takes the rest off ``wall_s``): counted whole, a figure
    taken from sporadic drafted steps (probes) reads each as a catch-up, and a load that steady
    drafting pays stays refused.

    The model above decides from expected figures; this is the check that keeps speculation from
    being slower than target-only when those figures are off: at a row count where drafted steps
    delivered more than ``TOLERANCE`` fewer tokens/s than a target-only step would, the step runs
    target-only, and every ``probe_steps``-th such step drafts anyway so the figure stays current.
    A row count without a figure of its own (a batch's tail as its requests finish, a load not
    seen yet) follows a refusal at fewer rows: drafting pays less as the batch grows.
    """

    EWMA = 0.05  # ~20 recent drafted steps per row count
    MIN_STEPS = 16  # drafted steps at a row count before its figure is trusted
    # refuse only where drafting was clearly slower: "never slower" means within 2% of target-only,
    # and a figure taken mostly at the prior's optimism must not switch a paying drafter off
    TOLERANCE = 0.02

    def __init__(self, probe_steps: int) -> None:
        self.probe_steps = probe_steps
        self.drafted: dict[int, list[float]] = {}  # rows -> [tokens, seconds (running averages), steps]
        self._since_probe: dict[int, int] = {}

    def observe(self, rows: int, tokens: int, wall_s: float) -> None:
        # averages that start from nothing: seeded with its first step, a figure would carry that
        # step at ~half weight when first trusted, and the first drafted step at a new load is the
        # unusual one (it feeds the drafter every new prompt)
        r = self.drafted.setdefault(rows, [0.0, 0.0, 0])
        r[0] += self.EWMA * (tokens - r[0])
        r[1] += self.EWMA * (wall_s - r[1])
        r[2] += 1

    def tokens_per_s(self, rows: int) -> float | None:
        r = self.drafted.get(rows)
        return r[0] / r[1] if r is not None and r[2] >= self.MIN_STEPS and r[1] > 0 else None

    def allows(self, rows: int, target_only_step_s) -> bool:
        """May a step with ``rows`` rows draft? ``target_only_step_s(n)``: what a target-only step
        with n rows costs."""
        refused = self._refuses(rows, target_only_step_s)
        if refused is None:
            refused = any(self._refuses(m, target_only_step_s) for m in list(self.drafted) if m < rows)
        if not refused:
            return True
        self._since_probe[rows] = self._since_probe.get(rows, 0) + 1
        if self._since_probe[rows] >= self.probe_steps:
            self._since_probe[rows] = 0
            return True
        return False

    def _refuses(self, rows: int, target_only_step_s) -> bool | None:
        """None: no trusted figure at ``rows``."""
        rate = self.tokens_per_s(rows)
        return None if rate is None else rate < (1 - self.TOLERANCE) * rows / target_only_step_s(rows)
