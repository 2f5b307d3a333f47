"""Auto-promotion policy: when a ``challenger`` may become ``champion`` without an operator.

Promotion is manual by default (``ops.auto_promote`` off). When on, ``decide`` answers yes only if:
1. a complete challenger exists and is not already champion;
2. it was never rolled back (tag ``tide.rolled_back``: an operator or the collapse guard took it
   out of service once; only an operator brings it back);
3. its held-out simulated acceptance length and its baseline's, measured by the retrain on the
   same held-out slice, are both recorded, and the baseline is the current champion (with no
   champion: the static drafter). The baseline is the parent, or the patch the retrain rebased
   past (tide/train/lineage.py); versions registered before baselines were recorded name their
   parent. Otherwise the two numbers would describe different drafters or slices and comparing
   them would be meaningless;
4. challenger >= baseline x (1 + margin).
The alias owner (tide/ops/aliases.py ``AliasOwner.auto_promote``) applies the decision to the
aliases as they are under its lock, never to a copy read earlier; the operation is recorded with
actor ``auto-promotion`` and a reason carrying both numbers.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from tide.contracts import (
    TAG_BASELINE,
    TAG_BASELINE_SIM_ACCEPT,
    TAG_PARENT,
    TAG_PARENT_SIM_ACCEPT,
    TAG_ROLLED_BACK,
)
from tide.registry import VersionInfo

ACTOR = "auto-promotion"


@dataclass(frozen=True)
class PromotionDecision:
    promote: bool
    reason: str
    challenger: int | None = None
    champion: int | None = None
    challenger_sim: float | None = None
    baseline_sim: float | None = None  # the baseline's (= champion's) sim accept length, same slice

    def to_dict(self) -> dict:
        return asdict(self)


def _float(value: str | None) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except ValueError:
        return None


def decide(challenger: VersionInfo | None, champion: VersionInfo | None, margin: float) -> PromotionDecision:
    """The policy (steps in the module docstring); reads only registry tags."""
    if challenger is None:
        return PromotionDecision(False, "no challenger")
    cv, pv = challenger.version, champion.version if champion is not None else None
    if not challenger.complete:
        return PromotionDecision(False, f"challenger {cv} is not completely registered", cv, pv)
    if pv == cv:
        return PromotionDecision(False, f"challenger {cv} is already champion", cv, pv)
    if challenger.tags.get(TAG_ROLLED_BACK):
        return PromotionDecision(False, f"challenger {cv} was rolled back before "
                                        f"({challenger.tags[TAG_ROLLED_BACK]}); only an operator may promote it", cv, pv)
    tags = challenger.tags
    against, base_tag = (TAG_BASELINE, TAG_BASELINE_SIM_ACCEPT) if TAG_BASELINE in tags else (
        TAG_PARENT, TAG_PARENT_SIM_ACCEPT)
    sim, base = challenger.sim_accept_length, _float(tags.get(base_tag))
    if sim is None or base is None:
        return PromotionDecision(False, f"challenger {cv} lacks recorded sim accept lengths "
                                        "(its own and its baseline's)", cv, pv, sim, base)
    baseline = tags.get(against, "")
    expected = str(pv) if pv is not None else "static"
    if baseline != expected:
        how = "compared with" if against == TAG_BASELINE else "trained from"
        return PromotionDecision(False, f"challenger {cv} was {how} {baseline or '?'} but the champion is "
                                        f"{expected}: its held-out comparison is not against the "
                                        "serving drafter", cv, pv, sim, base)
    needed = base * (1.0 + margin)
    if sim >= needed - 1e-9:  # recorded values are rounded; exactly the margin counts
        return PromotionDecision(True, f"sim accept length {sim:.3f} >= {needed:.3f} "
                                       f"(champion {base:.3f} x (1 + {margin:g}))", cv, pv, sim, base)
    return PromotionDecision(False, f"sim accept length {sim:.3f} < {needed:.3f} "
                                    f"(champion {base:.3f} x (1 + {margin:g}))", cv, pv, sim, base)
