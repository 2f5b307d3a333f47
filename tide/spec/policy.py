"""How much the engine speculates each step: the configured scheduler, its state and its metrics.

``spec.scheduler`` (tide/config/):
- ``fixed``: every step drafts ``draft_len`` tokens per row (tide/spec/rules.py);
- ``stop_rule``: a row stops drafting below ``draft_stop_prob`` (tide/spec/rules.py), not cost-aware;
- ``cost``: the cost scheduler (tide/spec/schedule.py): one draft depth for the whole padded batch;
- ``dspark`` (the default): DSpark's admission (tide/spec/admission.py): every (request, position)
  candidate ranked by calibrated survival and admitted while expected tokens x steps per second
  rises, verified packed (each row its own drafts).
``cost`` and ``dspark`` decide over the engine's measured step cost (tide/spec/cost.py), switch
speculation off per workload where it does not pay (``WorkloadGate``), and check what drafted
steps delivered against target-only (``RealizedRate``). Under ``dspark`` a workload that went
``probe_steps`` of its steps without a verified draft (gated off, or nothing admitted at this
load) probes: its rows verify one draft at least, so its acceptance stays measured; until a new
drafter has ``judge_rows`` verified rows (the collapse guard's window) that interval is
``judge_probe_steps``, so a broken drafter is judged, and rolled back, within a bound.
The reference engine owns one ``SpecPolicy`` and touches none of the parts above directly.
"""
from __future__ import annotations

import time
from collections import deque

from tide import metrics
from tide.config import CHOICES
from tide.spec.admission import AdmissionPlan, drafting_gain
from tide.spec.cost import STEADY_FEED, StepCostModel
from tide.spec.decode import Planner, StepStats
from tide.spec.rules import FixedLength, StopRule
from tide.spec.schedule import AcceptanceTracker, RealizedRate, StepPlan, WorkloadGate

SCHEDULERS = CHOICES["spec.scheduler"]
COSTED = ("cost", "dspark")  # the schedulers that decide from measured step costs
DEFAULT_WORKLOAD = "default"  # the tag of requests that carry none
SETTLED_DRAFTS = 32  # verified drafts of a workload before its drafted steps count as realized rate
REFEED_STEPS = 8  # drafted steps a deferred feed is spread over (amortized_feed)
MAX_GATE_EVENTS = 256  # the health view's history of gate changes (a flapping gate keeps the latest)
# dspark: steps a priced decision to draft (drafting_gain: recent chains replayed through the
# admission) answers the same question again: its figures are running averages over ~50 drafts,
# and replaying every step costs a one-row step more than the cost scheduler's whole decision
REPRICE_STEPS = 4


def amortized_feed(feed_positions: int, room: list[int]) -> int:
    """The feed a step is charged for: positions deferred by target-only steps are fed once, by the
    first drafted step, and let the steps after it draft on a steady feed, so each of those (up to
    ``REFEED_STEPS``, within the rows' budgets) carries a share. Charged whole, the share grows
    with every step not drafted, and a load where drafting pays stays target-only."""
    if feed_positions <= STEADY_FEED:
        return feed_positions
    steps = max(1, min(REFEED_STEPS, max(room, default=1)))
    return STEADY_FEED + round((feed_positions - STEADY_FEED) / steps)


class SpecPolicy:
    def __init__(self, scheduler: str, draft_len: int, stop_prob: float, cost: StepCostModel | None = None,
                 gate_probe_steps: int = 64, judge_rows: int = 200, judge_probe_steps: int = 4) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"spec.scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if scheduler in COSTED and cost is None:
            raise ValueError(f"the {scheduler} scheduler needs a step cost model")
        if judge_probe_steps < 1 or judge_rows < 0:
            raise ValueError(f"judge_probe_steps must be >= 1 and judge_rows >= 0, got {judge_probe_steps}, "
                             f"{judge_rows}")
        self.scheduler, self.draft_len, self.cost = scheduler, draft_len, cost
        self.stop_prob = stop_prob if scheduler == "stop_rule" else 0.0
        self.gate = WorkloadGate(gate_probe_steps)
        self.realized = RealizedRate(gate_probe_steps)
        self.judge_rows, self.judge_probe_steps = judge_rows, judge_probe_steps
        self.judged_rows = 0  # the serving drafter's verified drafted rows (what the guard judges)
        self._starved: dict[str, int] = {}  # workload -> its steps since a row of it verified a draft
        self._settled = False  # this step's rows have learnt acceptance (see plan)
        self._deferred_feed_s = 0.0  # this step's feed seconds charged to later steps (see plan)
        self._trackers: dict[str, AcceptanceTracker] = {}
        self._prices: dict[tuple, tuple[float, int]] = {}  # question -> (drafting gain, step priced at)
        self._steps = 0  # dspark plans made (the clock of _priced)
        self._version = "none"
        # (unix time, workload, drafter version, on, reason, acceptance by depth) per gate change
        self.events: deque[dict] = deque(maxlen=MAX_GATE_EVENTS)

    # --- per step ---------------------------------------------------------------------------
    def plan(self, workloads: list[str | None], gamma: int, feed_positions: int = 0,
             room: list[int] | None = None, greedy: list[bool] | None = None) -> tuple[bool, Planner | None]:
        """(draft this step, its planner). False = the step runs target-only.
        ``feed_positions``: the longest drafter feed a draft would consume first; ``room[b]``: the
        drafts row b can still use (its token budget less the step's own token); ``greedy[b]``:
        row b decodes greedily (the live signals are for greedy rows)."""
        if self.scheduler == "fixed":
            return True, FixedLength()
        if self.scheduler == "stop_rule":
            return True, StopRule(self.stop_prob)
        names = [w or DEFAULT_WORKLOAD for w in workloads]
        n = len(names)
        room = room if room is not None else [gamma] * n
        greedy = greedy if greedy is not None else [True] * n
        charged = amortized_feed(feed_positions, room)
        # the feed this step pays but charges to the drafted steps after it (observe_step_wall)
        self._deferred_feed_s = self.cost.refeed_s(n, feed_positions) - self.cost.refeed_s(n, charged)
        feed_positions = charged
        if self.scheduler == "dspark":
            return self._plan_admission(names, gamma, feed_positions, room, greedy)
        trackers = [self._tracker(w) for w in names]
        solo = lambda ran: self.cost.step_costs(1, gamma, ran)  # noqa: E731
        caps, probing = [], False
        decided: dict[str, tuple[bool, bool]] = {}
        for w, t, left in zip(names, trackers, room):
            if w not in decided:
                on, probe, changed = self.gate.decide(w, t, solo)
                decided[w] = (on, probe)
                if changed:
                    self._gate_metric(w, on, changed)
            on, probe = decided[w]
            caps.append(max(0, min(gamma, left)) if on or probe else 0)  # tokens past the budget are dropped
            probing |= probe
        # drafted steps count toward the realized rate once the rows' acceptance is learnt: steps
        # taken on the prior's optimism say little about what drafting delivers from here on
        self._settled = all(t.drafts_seen >= SETTLED_DRAFTS for t in trackers)
        plan = StepPlan(trackers, caps, lambda drafted: self.cost.step_costs(n, gamma, drafted, feed_positions), gamma,
                        min_level=1 if probing else 0)
        if not any(caps):  # every row's workload off, or no row with budget left for a draft
            metrics.ENGINE_TARGET_ONLY_STEPS.labels("cost" if any(on for on, _ in decided.values()) else "gated").inc()
            return False, None
        if plan.initial_level() == 0:
            metrics.ENGINE_TARGET_ONLY_STEPS.labels("cost").inc()
            return False, None
        if not probing and not self.realized.allows(n, lambda rows: self.cost.step_costs(rows, 0)[0]):
            metrics.ENGINE_TARGET_ONLY_STEPS.labels("measured").inc()
            return False, None
        return True, plan

    def _plan_admission(self, names: list[str], gamma: int, feed_positions: int, room: list[int],
                        greedy: list[bool]) -> tuple[bool, Planner | None]:
        trackers = [self._tracker(w) for w in names]
        n = len(names)
        self._steps += 1
        decided: dict[str, tuple[bool, bool]] = {}
        caps, min_lens = [], []
        for w, t, left, g in zip(names, trackers, room, greedy):
            if w not in decided:  # (one row alone: priced only when the gate judges again)
                pays = lambda bar, w=w, t=t, g=g: self._priced(  # noqa: E731
                    ("solo", w, g, gamma), [t], [gamma], [g], self._seconds(1, gamma, 0), gamma) > 1 + bar
                on, _, changed = self.gate.decide(w, t, None, pays_at=pays)
                if changed:
                    self._gate_metric(w, on, changed)
                self._starved[w] = self._starved.get(w, 0) + 1  # reset by a verified draft (observe_spec_step)
                decided[w] = (on, self._starved[w] >= self.probe_interval(on, t))
            on, probe = decided[w]
            caps.append(max(0, min(gamma, left)) if on or probe else 0)
            min_lens.append(1 if probe else 0)
        self._settled = all(t.drafts_seen >= SETTLED_DRAFTS for t in trackers)
        if not any(caps):
            metrics.ENGINE_TARGET_ONLY_STEPS.labels("cost" if any(on for on, _ in decided.values()) else "gated").inc()
            return False, None
        plan = AdmissionPlan(trackers, caps, greedy, self._seconds(n, gamma, feed_positions), gamma, min_lens)
        question = (tuple(names), tuple(caps), tuple(greedy), gamma, feed_positions)
        if not plan.worth_drafting(lambda *args: self._priced(question, *args)):
            metrics.ENGINE_TARGET_ONLY_STEPS.labels("cost").inc()
            return False, None
        if not plan.probing and not self.realized.allows(n, lambda rows: self.cost.step_costs(rows, 0)[0]):
            metrics.ENGINE_TARGET_ONLY_STEPS.labels("measured").inc()
            return False, None
        return True, plan

    def _priced(self, question: tuple, *args) -> float:
        """``drafting_gain(*args)``, the answer to ``question`` reused for ``REPRICE_STEPS`` steps."""
        hit = self._prices.get(question)
        if hit is None or self._steps - hit[1] >= REPRICE_STEPS:
            if len(self._prices) > 64:  # drop the stale (a batch's mix of rows makes many questions)
                self._prices = {q: h for q, h in self._prices.items() if self._steps - h[1] < REPRICE_STEPS}
            hit = self._prices[question] = (drafting_gain(*args), self._steps)
        return hit[0]

    def _seconds(self, rows: int, gamma: int, feed_positions: int):
        """seconds(k, ran, even) of a step of ``rows`` rows verifying k drafts after the drafter ran
        ``ran`` depths (0: a target-only step): packed, or with ``even`` drafts on every row the
        padded forward that runs then (tide/spec/admission.py ``Seconds``), from the measured tables
        as they are now."""
        c = self.cost
        packed, padded = c.packed_costs(rows), c.verify_costs(rows)
        drafted = [0.0] + [c.draft_s(rows, d) + c.refeed_s(rows, feed_positions) + c.overhead_s(rows, True)
                           for d in range(1, gamma + 1)]
        undrafted = c.overhead_s(rows, False)

        def seconds(k: int, ran: int, even: int) -> float:
            verify = padded[min(1 + even, len(padded) - 1)] if even else packed[min(k, len(packed) - 1)]
            return verify + (drafted[min(ran, gamma)] if ran > 0 else undrafted)
        return seconds

    def probe_interval(self, on: bool, tracker: AcceptanceTracker) -> int:
        """A starved workload's probe interval: ``judge_probe_steps`` while the serving drafter is
        not judged yet (fewer than ``judge_rows`` verified rows) and the workload is gated off or
        has too few drafts for its gate to judge, else ``gate_probe_steps``: a drafter the gate
        keeps on pays where it drafts, and one that drafts nothing at this load costs nothing."""
        young = self.judged_rows < self.judge_rows and (not on or tracker.drafts_seen < self.gate.min_drafts)
        return self.judge_probe_steps if young else self.gate.probe_steps

    def observe_target_step(self, n_rows: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.observe_target_only(n_rows, seconds)

    def observe_step_wall(self, n_rows: int, wall_s: float, forwards_s: float, drafted: bool, tokens: int) -> None:
        """A whole step took ``wall_s``, ``forwards_s`` of it in the verify and draft forwards, and
        committed ``tokens``."""
        if self.cost is not None:
            self.cost.observe_overhead(n_rows, drafted, wall_s - forwards_s)
        if drafted and self._settled:
            self.realized.observe(n_rows, tokens, wall_s - self._deferred_feed_s)

    def observe_spec_step(self, workloads: list[str | None], stats: StepStats, plan: Planner) -> None:
        self.judged_rows += sum(1 for d in stats.drafted if d > 0)
        if self.cost is not None:
            n = len(stats.drafted)
            # rows verifying as many drafts each ran the plain forward (tide/spec/decode.py verify)
            if stats.packed and min(stats.drafted) != max(stats.drafted):
                self.cost.observe_packed(n, sum(stats.drafted), stats.verify_s)
            elif max(stats.drafted) == 0:
                self.cost.observe_target_only(n, stats.verify_s)
            else:
                self.cost.observe_verify(n, 1 + max(stats.drafted), stats.verify_s)
            if stats.feed_positions <= 1 + stats.gamma:  # a steady feed: the draft cells' shape
                self.cost.observe_draft(n, stats.draft_depth, stats.draft_s)
            else:  # a long feed: what it cost beyond a steady draft
                self.cost.observe_refeed(n, stats.feed_positions - STEADY_FEED,
                                         stats.draft_s - self.cost.draft_s(n, stats.draft_depth))
        if isinstance(plan, AdmissionPlan):
            for b, w in enumerate(workloads):
                name, chain = w or DEFAULT_WORKLOAD, plan.raw_chain[b]
                tracker = self._tracker(name)
                tracker.observe(stats.drafted[b], stats.accepted[b], chain, plan.drafted, plan.chosen[b])
                if chain is not None:
                    tracker.chains.append(chain)
                if stats.drafted[b] > 0:
                    self._starved[name] = 0
        elif isinstance(plan, StepPlan):
            for b, w in enumerate(workloads):
                self._tracker(w or DEFAULT_WORKLOAD).observe(stats.drafted[b], stats.accepted[b], plan.raw_chain[b],
                                                             plan.drafted, plan.chosen)

    # --- drafter changes and views ----------------------------------------------------------
    def drafter_changed(self, version: str) -> None:
        """A new drafter serves: its acceptance is unknown, so every workload speculates again."""
        old = self._version
        for w in self.gate.state:
            metrics.ENGINE_SPEC_ENABLED.labels(w, old).set(0)
        self._version, self._trackers, self._prices = version, {}, {}
        self.realized = RealizedRate(self.gate.probe_steps)
        self.judged_rows, self._starved = 0, {}
        for w, on, reason in self.gate.reset("drafter_swapped"):
            metrics.ENGINE_SPEC_GATE_CHANGES.labels(w, version, reason).inc()
        for w in self.gate.state:  # the history shows every workload starting over with the new drafter
            metrics.ENGINE_SPEC_ENABLED.labels(w, version).set(1)
            self._event(w, True, "drafter_swapped", [])

    def view(self) -> dict:
        """JSON-ready state for the engine's health view."""
        # called from other threads while the decode thread updates: iterate over copies
        out = {"scheduler": self.scheduler,
               "speculation": {w: {"on": s["on"], "reason": s["reason"]} for w, s in list(self.gate.state.items())},
               "acceptance_by_depth": {w: [round(a, 3) for a in t.conditional()]
                                       for w, t in list(self._trackers.items())},
               "judged_rows": self.judged_rows,
               "speculation_events": list(self.events)}
        if self.cost is not None and self.cost.measured():
            out["step_cost"] = self.cost.table()
            out["drafted_tok_s_by_rows"] = {n: {"drafted": round(rate, 2),
                                                "target_only": round(n / self.cost.step_costs(n, 0)[0], 2)}
                                            for n in list(self.realized.drafted)
                                            if (rate := self.realized.tokens_per_s(n)) is not None}
        return out

    def _tracker(self, workload: str) -> AcceptanceTracker:
        t = self._trackers.get(workload)
        if t is None:
            t = self._trackers[workload] = AcceptanceTracker(self.draft_len)
            metrics.ENGINE_SPEC_ENABLED.labels(workload, self._version).set(1)
            if workload not in self.gate.state and self.scheduler in COSTED:
                self._event(workload, True, "default", [])  # a workload's first request: on until measured
        return t

    def _gate_metric(self, workload: str, on: bool, reason: str) -> None:
        metrics.ENGINE_SPEC_ENABLED.labels(workload, self._version).set(1 if on else 0)
        metrics.ENGINE_SPEC_GATE_CHANGES.labels(workload, self._version, reason).inc()
        self._event(workload, on, reason, self._tracker(workload).conditional())

    def _event(self, workload: str, on: bool, reason: str, acceptance: list[float]) -> None:
        self.events.append({"t_unix": round(time.time(), 3), "workload": workload, "drafter_version": self._version,
                            "on": on, "reason": reason, "acceptance_by_depth": [round(a, 3) for a in acceptance]})
