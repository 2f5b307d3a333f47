"""How much the engine speculates each step: the configured scheduler, its state and its metrics.

``spec.scheduler`` (tide/config.py):
- ``fixed``: every step drafts ``draft_len`` tokens per row;
- ``stop_rule``: a row stops drafting below ``draft_stop_prob`` (tide/spec/decode.py), not cost-aware;
- ``cost``: the cost scheduler (tide/spec/schedule.py) over the engine's measured step cost
  (tide/spec/cost.py), with speculation switched off per workload where it does not pay
  (``WorkloadGate``).
The reference engine owns one ``SpecPolicy`` and touches none of the parts above directly.
"""
from __future__ import annotations

import time
from collections import deque

from tide import metrics
from tide.config import CHOICES
from tide.spec.cost import STEADY_FEED, StepCostModel
from tide.spec.decode import StepStats
from tide.spec.schedule import AcceptanceTracker, RealizedRate, StepPlan, WorkloadGate

SCHEDULERS = CHOICES["spec.scheduler"]
DEFAULT_WORKLOAD = "default"  # the tag of requests that carry none
SETTLED_DRAFTS = 32  # verified drafts of a workload before its drafted steps count as realized rate
MAX_GATE_EVENTS = 256  # the health view's history of gate changes (a flapping gate keeps the latest)


class SpecPolicy:
    def __init__(self, scheduler: str, draft_len: int, stop_prob: float, cost: StepCostModel | None = None,
                 gate_probe_steps: int = 64) -> None:
        if scheduler not in SCHEDULERS:
            raise ValueError(f"spec.scheduler must be one of {SCHEDULERS}, got {scheduler!r}")
        if scheduler == "cost" and cost is None:
            raise ValueError("the cost scheduler needs a step cost model")
        self.scheduler, self.draft_len, self.cost = scheduler, draft_len, cost
        self.stop_prob = stop_prob if scheduler == "stop_rule" else 0.0
        self.gate = WorkloadGate(gate_probe_steps)
        self.realized = RealizedRate(gate_probe_steps)
        self._settled = False  # this step's rows have learnt acceptance (see plan)
        self._trackers: dict[str, AcceptanceTracker] = {}
        self._version = "none"
        # (unix time, workload, drafter version, on, reason, acceptance by depth) per gate change
        self.events: deque[dict] = deque(maxlen=MAX_GATE_EVENTS)

    # --- per step ---------------------------------------------------------------------------
    def plan(self, workloads: list[str | None], gamma: int, feed_positions: int = 0,
             room: list[int] | None = None) -> tuple[bool, StepPlan | None]:
        """(draft this step, planner for the drafter). False = the step runs target-only.
        ``feed_positions``: the longest drafter feed a draft would consume first; ``room[b]``: the
        drafts row b can still use (its token budget less the step's own token)."""
        if self.scheduler != "cost":
            return True, None
        names = [w or DEFAULT_WORKLOAD for w in workloads]
        trackers = [self._tracker(w) for w in names]
        solo = lambda ran: self.cost.step_costs(1, gamma, ran)  # noqa: E731
        caps, probing = [], False
        decided: dict[str, tuple[bool, bool]] = {}
        room = room if room is not None else [gamma] * len(names)
        for w, t, left in zip(names, trackers, room):
            if w not in decided:
                on, probe, changed = self.gate.decide(w, t, solo)
                decided[w] = (on, probe)
                if changed:
                    self._gate_metric(w, on, changed)
            on, probe = decided[w]
            caps.append(max(0, min(gamma, left)) if on or probe else 0)  # tokens past the budget are dropped
            probing |= probe
        n = len(names)
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

    def observe_target_step(self, n_rows: int, seconds: float) -> None:
        if self.cost is not None:
            self.cost.observe_verify(n_rows, 1, seconds)

    def observe_step_wall(self, n_rows: int, wall_s: float, forwards_s: float, drafted: bool, tokens: int) -> None:
        """A whole step took ``wall_s``, ``forwards_s`` of it in the verify and draft forwards, and
        committed ``tokens``."""
        if self.cost is not None:
            self.cost.observe_overhead(n_rows, drafted, wall_s - forwards_s)
        if drafted and self._settled:
            self.realized.observe(n_rows, tokens, wall_s)

    def observe_spec_step(self, workloads: list[str | None], stats: StepStats, plan: StepPlan | None) -> None:
        if self.cost is not None:
            n = len(stats.drafted)
            self.cost.observe_verify(n, 1 + max(stats.drafted), stats.verify_s)
            if stats.feed_positions <= 1 + stats.gamma:  # a steady feed: the draft cells' shape
                self.cost.observe_draft(n, stats.draft_depth, stats.draft_s)
            else:  # a long feed: what it cost beyond a steady draft
                self.cost.observe_refeed(n, stats.feed_positions - STEADY_FEED,
                                         stats.draft_s - self.cost.draft_s(n, stats.draft_depth))
        if plan is None:
            return
        for b, w in enumerate(workloads):
            self._tracker(w or DEFAULT_WORKLOAD).observe(stats.drafted[b], stats.accepted[b], plan.raw_chain[b],
                                                         plan.drafted, plan.chosen)

    # --- drafter changes and views ----------------------------------------------------------
    def drafter_changed(self, version: str) -> None:
        """A new drafter serves: its acceptance is unknown, so every workload speculates again."""
        old = self._version
        for w in self.gate.state:
            metrics.ENGINE_SPEC_ENABLED.labels(w, old).set(0)
        self._version, self._trackers = version, {}
        self.realized = RealizedRate(self.gate.probe_steps)
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
            if workload not in self.gate.state and self.scheduler == "cost":
                self._event(workload, True, "default", [])  # a workload's first request: on until measured
        return t

    def _gate_metric(self, workload: str, on: bool, reason: str) -> None:
        metrics.ENGINE_SPEC_ENABLED.labels(workload, self._version).set(1 if on else 0)
        metrics.ENGINE_SPEC_GATE_CHANGES.labels(workload, self._version, reason).inc()
        self._event(workload, on, reason, self._tracker(workload).conditional())

    def _event(self, workload: str, on: bool, reason: str, acceptance: list[float]) -> None:
        self.events.append({"t_unix": round(time.time(), 3), "workload": workload, "drafter_version": self._version,
                            "on": on, "reason": reason, "acceptance_by_depth": [round(a, 3) for a in acceptance]})
