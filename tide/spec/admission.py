"""DSpark's admission: which (request, draft position) candidates a step verifies, packed.

Every (row b, depth j) is a candidate with P_b(j), the probability that row b's draft j survives
verification (drafts 1..j all accepted):
- a greedy row's drafted depths: its live chain (the confidence head's survivals multiplied when
  the drafter serves a calibrated head, else its top probabilities multiplied), scaled per depth
  by its workload's observed accepts over predicted ones (``AcceptanceTracker.calibrate``, as the
  cost scheduler scales it: ~1 for a calibrated head, well below 1 for raw top probabilities);
- depths not drafted yet: the last figure extended by the workload's running conditional
  acceptance; a sampled row: the running acceptance alone (no live signal for it).
Candidates are sorted by P (a row's prefix comes first: P never rises with depth) and admitted
one at a time; the count kept is the one with the most expected tokens per second: E[tokens] =
rows + the admitted P's, over the measured seconds of that step (a packed verify of rows +
admitted tokens, or the plain forward when every row verifies as many, the drafter to the deepest
admitted depth, the step's overhead; tide/spec/cost.py).
Drafting must beat none by ``MIN_GAIN``. Every count is scanned, not only up to the first fall:
the row kernel's passes make the verify cost a staircase, where a larger count can pay again.

Before the drafter runs the step drafts only where drafting and then admitting on the live signal
is expected to pay: recent live chains of each row's workload are replayed through the step as it
would run (``SAMPLED_ROWS`` rows' worth of draws; the drafter paid for the depths it would run, no
more) and their mean tokens over mean seconds compared with a target-only step. A probe row
(``min_lens``) verifies at least one draft whatever the figures say, so acceptance stays measured.
Which drafts are verified never changes what is committed beyond how many tokens a step commits:
lossless.
"""
from __future__ import annotations

from typing import Callable

from tide.spec.decode import Drafts
from tide.spec.schedule import MIN_GAIN, AcceptanceTracker

SAMPLED_ROWS = 16  # recent chains replayed per decision to draft (split over the step's rows)

# (total drafts verified k, depths the drafter ran, d when every row verifies d drafts else 0) -> step
# seconds: rows of one length verify in the plain forward (tide/spec/decode.py verify), others packed
Seconds = Callable[[int, int, int], float]


def admit(survival: list[list[float]], caps: list[int], seconds: Seconds, min_gain: float = MIN_GAIN,
          ran: int = 0) -> tuple[list[int], float, float]:
    """(drafts verified per row, expected tokens, seconds) of the best admission.

    ``survival[b][j-1]`` = P_b(j), non-increasing in j; ``caps[b]``: the most of row b's drafts
    that may be admitted; ``seconds``: see ``Seconds``; ``ran``: the depths the drafter has run
    already (a step pays at least those, verifying none)."""
    n = len(survival)
    cands = sorted((-p, j, b) for b, row in enumerate(survival) for j, p in enumerate(row[:max(0, caps[b])], 1))
    base_s = seconds(0, ran, 0)
    best_k, best_tokens, best_s, bar = 0, float(n), base_s, n / base_s * (1 + min_gain)
    tokens, deepest = float(n), 0
    for k, (neg_p, j, _) in enumerate(cands, 1):
        tokens -= neg_p
        deepest = max(deepest, j)
        # every row's drafts are a prefix, so k = n x deepest only when all rows verify deepest
        s = seconds(k, max(deepest, ran), deepest if k == n * deepest else 0)
        if tokens / s > bar * (1 + 1e-9):
            best_k, best_tokens, best_s, bar = k, tokens, s, tokens / s
    lengths = [0] * n
    for _, j, b in cands[:best_k]:
        lengths[b] = max(lengths[b], j)
    return lengths, best_tokens, best_s


def survival_of(tracker: AcceptanceTracker, raw_chain: list[float] | None, depth: int) -> list[float]:
    """P(j) for j = 1..depth from a live raw chain (scaled per depth, extended by running rates)
    or, with none, the running rates alone."""
    if not raw_chain:
        return tracker.survival()[:depth]
    out, p = [], 1.0
    for j, raw in enumerate(raw_chain[:depth], 1):
        p = min(p, tracker.calibrate(j, raw))
        out.append(p)
    for a in tracker.conditional()[len(out):depth]:
        p *= a
        out.append(p)
    return out


def drafting_gain(trackers: list[AcceptanceTracker], caps: list[int], greedy: list[bool], seconds: Seconds,
                  max_depth: int) -> float:
    """Expected tokens/s of drafting then admitting on the live signal, over a target-only step's.

    Each draw gives every row one of its workload's recent raw chains (rows without any, or
    sampled ones, their running rates) and plays the step as ``AdmissionPlan`` would: the drafter
    goes one depth deeper while the admission on what it has drafted so far admits deeper."""
    n = len(trackers)
    most = max(1, min(max_depth, max(caps)))
    draws = max(1, -(-SAMPLED_ROWS // n))
    tokens = secs = 0.0
    for r in range(draws):
        chains = [t.chains[-1 - (r * n + b) % len(t.chains)] if greedy[b] and t.chains and caps[b] > 0 else None
                  for b, t in enumerate(trackers)]  # the newest first
        longest = max((len(c) for c in chains if c), default=0)
        memo: dict[int, list[list[float]]] = {}

        def survival_at(d: int, chains=chains, longest=longest, memo=memo) -> list[list[float]]:
            d = min(d, longest)  # past the longest chain nothing more is known: the same figures
            if d not in memo:
                memo[d] = [survival_of(t, c[:d] if c else None, max_depth) if cap > 0 else []
                           for t, c, cap in zip(trackers, chains, caps)]
            return memo[d]
        tok, sec = planned_step(survival_at, caps, seconds, most)
        tokens, secs = tokens + tok, secs + sec
    return (tokens / secs) / (n / seconds(0, 0, 0))


def planned_step(survival_at: Callable[[int], list[list[float]]], caps: list[int], seconds: Seconds,
                 most: int) -> tuple[float, float]:
    """(expected tokens, seconds) of one drafted step as ``AdmissionPlan`` runs it: after depth d
    (``survival_at(d)``: what d drafted depths show) the drafter goes on where the admission
    admits deeper, else the step verifies what is admitted up to d and pays d drafted depths."""
    for d in range(1, most + 1):
        survival = survival_at(d)
        if d < most and max(admit(survival, caps, seconds, ran=d)[0]) > d:
            continue
        _, tokens, secs = admit(survival, [min(c, d) for c in caps], seconds, ran=d)
        return tokens, secs
    raise AssertionError("unreachable: the deepest depth always verifies")


class AdmissionPlan:
    """One step's admission; the step's planner (``tide.spec.decode.Planner``), verified packed.

    ``trackers[b]``: row b's workload tracker; ``caps[b]``: the most drafts row b may keep (0: its
    workload's speculation is off, or its token budget leaves none); ``greedy[b]``: row b has a
    live signal; ``seconds``: the step's seconds (``Seconds``); ``min_lens[b]``: drafts verified
    whatever the admission says (a probe).
    """

    packed = True

    def __init__(self, trackers: list[AcceptanceTracker], caps: list[int], greedy: list[bool], seconds: Seconds,
                 max_depth: int, min_lens: list[int] | None = None) -> None:
        self.trackers, self.caps, self.greedy, self.seconds = trackers, caps, greedy, seconds
        self.max_depth = max_depth
        self.min_lens = min_lens or [0] * len(trackers)
        self.raw_chain: list[list[float] | None] = [None] * len(trackers)
        self.chosen = [0] * len(trackers)  # per row: the admission's own choice (before a probe's minimum)
        self.drafted = 0  # the depths the drafter ran

    @property
    def probing(self) -> bool:
        return any(m > 0 and c > 0 for m, c in zip(self.min_lens, self.caps))

    def worth_drafting(self, price: Callable[..., float] = drafting_gain) -> bool:
        """Before the drafter runs: drafting pays by ``MIN_GAIN`` in expectation, or a row probes.
        ``price``: ``drafting_gain`` or a caller's reuse of its earlier answers."""
        if self.probing:
            return True
        return price(self.trackers, self.caps, self.greedy, self.seconds, self.max_depth) > 1 + MIN_GAIN

    def _survival(self, drafts: Drafts) -> list[list[float]]:
        chain = drafts.chain().tolist()
        for b, g in enumerate(self.greedy):
            if g:
                self.raw_chain[b] = chain[b]
        return [survival_of(t, self.raw_chain[b], self.max_depth) for b, t in enumerate(self.trackers)]

    def go_on(self, drafts: Drafts) -> bool:
        depth = drafts.depth
        lengths, _, _ = admit(self._survival(drafts), self.caps, self.seconds, ran=depth)
        return max(lengths) > depth

    def lengths(self, drafts: Drafts) -> list[int]:
        depth = self.drafted = drafts.depth
        caps = [min(c, depth) for c in self.caps]
        self.chosen, _, _ = admit(self._survival(drafts), caps, self.seconds, ran=depth)
        return [max(c, min(m, cap)) for c, m, cap in zip(self.chosen, self.min_lens, caps)]
