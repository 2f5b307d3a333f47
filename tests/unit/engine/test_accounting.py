"""The engine's acceptance accounting: a drafter is judged only on rows whose drafts were verified."""
import torch
from prometheus_client import REGISTRY

from tide.contracts import VersionAcceptance
from tide.engine.accounting import EngineAccounting
from tide.spec.decode import RowResult, StepStats


def _row(n_accepted: int) -> RowResult:
    n = n_accepted + 1
    return RowResult(list(range(n)), n_accepted, torch.zeros(n, dtype=torch.long), torch.zeros(n, 6), torch.zeros(n, 2))


def _accept_count(version: str) -> float:
    return REGISTRY.get_sample_value("tide_engine_accept_length_tokens_count", {"drafter_version": version}) or 0.0


def test_rows_of_a_drafted_step_that_kept_no_draft_are_not_the_drafters():
    acct = EngineAccounting()
    before = _accept_count("acct-v1")
    # row 0 verified 3 drafts and accepted 2; row 1 kept none (its workload gated off, or the plan
    # truncated it): it commits one token, which says nothing about the drafter
    stats = StepStats(gamma=3, accepted=[2, 0], drafted=[3, 0])
    acct.step("acct-v1", [_row(2), _row(0)], stats, has_drafter=True)
    acct.step("acct-v1", [_row(0), _row(0)], None, has_drafter=True)  # a target-only step
    st = acct.stats()
    assert st.target_forwards == 4  # every row is a target forward ...
    assert st.acceptance["acct-v1"] == VersionAcceptance(forwards=1, accepted=2, committed=3)  # ... only the verified one is the drafter's
    assert _accept_count("acct-v1") - before == 1


def test_with_no_drafter_every_row_is_the_baseline():
    acct = EngineAccounting()
    acct.step("none-acct", [_row(0), _row(0)], None, has_drafter=False)
    assert acct.stats().acceptance["none-acct"] == VersionAcceptance(forwards=2, accepted=0, committed=2)
