"""Auto-promotion policy: a challenger replaces the champion only when its held-out simulated
acceptance beats the champion's (measured on the same slice) by the configured margin."""
import pytest

from tide.contracts import (
    TAG_BASELINE,
    TAG_BASELINE_SIM_ACCEPT,
    TAG_PARENT,
    TAG_PARENT_SIM_ACCEPT,
    TAG_REGISTRATION,
    TAG_SIM_ACCEPT,
)
from tide.ops.promotion import decide
from tide.registry import VersionInfo


def version(v, aliases=(), **tags):
    return VersionInfo(name="m", version=v, aliases=tuple(aliases), tags={k.replace("__", "."): str(x)
                                                                          for k, x in tags.items()},
                       run_id=None, source="", created_at_s=0.0)


def challenger(sim, parent_sim, parent="1", v=2, **extra):
    tags = {TAG_SIM_ACCEPT: sim, TAG_PARENT_SIM_ACCEPT: parent_sim, TAG_PARENT: parent, **extra}
    return VersionInfo(name="m", version=v, aliases=("challenger",), tags={k: str(x) for k, x in tags.items()},
                       run_id=None, source="", created_at_s=0.0)


CHAMPION = version(1, ("champion",), **{"tide__sim_accept_length": "9.9"})  # its own slice: not used


@pytest.mark.parametrize("sim,parent_sim,margin,promote", [
    (2.00, 1.50, 0.05, True),    # +33%
    (1.575, 1.50, 0.05, True),   # exactly the margin
    (1.57, 1.50, 0.05, False),   # just under
    (1.50, 1.50, 0.0, True),     # margin 0: equal is enough
    (1.40, 1.50, 0.0, False),    # worse
])
def test_margin_is_relative_to_the_parent_on_the_same_slice(sim, parent_sim, margin, promote):
    d = decide(challenger(sim, parent_sim), CHAMPION, margin)
    assert d.promote is promote, d.reason
    assert (d.challenger, d.champion, d.challenger_sim, d.baseline_sim) == (2, 1, sim, parent_sim)


def test_champion_sim_from_another_slice_is_never_compared():
    # the champion's own recorded 9.9 would block promotion if it were (wrongly) compared
    assert decide(challenger(1.8, 1.5), CHAMPION, 0.05).promote


def test_parent_must_be_the_serving_champion():
    d = decide(challenger(3.0, 1.0, parent="5"), CHAMPION, 0.05)
    assert not d.promote and "trained from 5" in d.reason


def test_no_champion_compares_against_static_parent():
    assert decide(challenger(2.0, 1.5, parent="static"), None, 0.05).promote
    assert not decide(challenger(2.0, 1.5, parent="1"), None, 0.05).promote


@pytest.mark.parametrize("case", ["none", "already", "rolled_back", "missing_sim", "pending"])
def test_refusals(case):
    if case == "none":
        ch = None
    elif case == "already":
        ch = challenger(2.0, 1.0, v=1)
    elif case == "rolled_back":
        ch = challenger(2.0, 1.0, **{"tide.rolled_back": "collapse guard: ..."})
    elif case == "missing_sim":
        ch = version(2, ("challenger",), **{"tide__parent_version": "1"})
    else:
        ch = challenger(2.0, 1.0, **{TAG_REGISTRATION: "pending"})
    d = decide(ch, CHAMPION, 0.05)
    assert not d.promote and d.reason


def test_a_rebased_challenger_is_compared_with_its_baseline_not_its_parent():
    # retrained from version 1 past the patch version 2 that serves: 2.6 beats its parent by 30%,
    # the champion it would replace by 4%
    rebased = {TAG_BASELINE: "2", TAG_BASELINE_SIM_ACCEPT: 2.5}
    d = decide(challenger(2.6, 2.0, parent="1", v=3, **rebased), version(2, ("champion",)), 0.05)
    assert not d.promote and (d.challenger_sim, d.baseline_sim) == (2.6, 2.5)
    ok = decide(challenger(2.6, 2.0, parent="1", v=3, **{**rebased, TAG_BASELINE_SIM_ACCEPT: 2.4}),
                version(2, ("champion",)), 0.05)
    assert ok.promote and ok.baseline_sim == 2.4
    stale = decide(challenger(2.6, 2.0, parent="1", v=3, **rebased), version(4, ("champion",)), 0.05)
    assert not stale.promote and "not against the serving drafter" in stale.reason
