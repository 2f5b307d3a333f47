"""The service follows ``champion`` once for all its engines, and judges collapse per engine: the
acceptance each engine reports with its requests feeds that engine's own collapse guard; one
engine's collapse swaps the previous drafter back for every engine and refuses the version."""
import torch

from tide.config import OpsConfig, replace
from tide.contracts import VersionAcceptance
from tide.drafting import wire
from tide.drafting.transport import EngineLink, wait_until
from tide.registry import RegistryError
from tide.services.drafter_follow import ServiceFollower


def _report(url: str, engine: str, hidden: int, *acceptances: dict) -> None:
    """An engine's draft requests, each carrying its acceptance counters, through the wire (one link)."""
    link = EngineLink(url)
    try:
        assert wait_until(lambda: link.send({"op": wire.HELLO, "engine": engine, "shm": None}), 10)
        assert link.recv(30)[0]["op"] == wire.WELCOME
        rows = [{"id": "r", "t_len": 3, "pending": 1, "feed_start": 0, "first_pos": 0, "n_feed": 3,
                 "temperature": 0.0, "seed": -1}]
        for seq, acceptance in enumerate(acceptances, 1):
            link.send({"op": wire.DRAFT, "engine": engine, "seq": seq, "gamma": 2, "stop_prob": 0.0, "rows": rows,
                       "acceptance": acceptance},
                      {"tokens": torch.tensor([4, 5, 6]).numpy(), "aux": torch.zeros(3, 3 * hidden).numpy()})
            assert link.recv(30)[0]["op"] == wire.DRAFTS
    finally:
        link.close()


def _counts(forwards: int, accepted: int, committed: int) -> dict:
    return wire.acceptance_field({"v": VersionAcceptance(forwards, accepted, committed)})["v"]


def _unreachable():
    raise RegistryError("no registry in this test")


def test_one_engines_collapse_rolls_the_service_back_for_all(tiny_target, tiny_drafter, agreeing_drafter, service):
    ops = replace(OpsConfig(), guard_window_forwards=50, guard_floor=1.05)
    follower = ServiceFollower(service.server, ops, _unreachable, None, None)
    assert follower.watcher.swap_to("v2", tiny_drafter).status == "swapped"  # as a champion poll would
    assert service.server.host.drafter_version == "v2"
    hidden, url = tiny_target.shape.hidden_size, service.url("tcp")
    _report(url, "engine-a", hidden, {"v1": _counts(300, 240, 540), "v2": _counts(100, 80, 180)})  # 1.8 tokens/forward
    assert follower.check_engines() is None  # engine a's window is healthy
    _report(url, "engine-b", hidden, {"v2": _counts(100, 1, 101)})  # 1.01: collapsed on b's traffic
    reason = follower.check_engines()
    assert reason is not None and "below floor" in reason
    assert wait_until(lambda: service.server.host.drafter_version == "v1", 30)  # served to every engine again
    assert "v2" in follower.watcher.refused and follower.health()["pending_registry_rollback"] == "v2"
    assert set(follower.guards) == {"engine-a", "engine-b"}


def test_the_wire_reads_acceptance_by_name_and_bounds_checks_it():
    good = {"forwards": 10, "accepted": 4, "committed": 14}
    assert wire.acceptance_field({"v1": VersionAcceptance(10, 4, 14)}) == {"v1": good}
    assert wire.check_acceptance({"v1": good}) == {"v1": VersionAcceptance(forwards=10, accepted=4, committed=14)}
    assert wire.check_acceptance({}) == {}  # no drafter version counted yet
    bad = [[10, 4, 14], {**good, "forwards": -1}, {**good, "accepted": True}, {**good, "committed": 1.5},
           {**good, "committed": 1 << 63}, {"forwards": 10, "accepted": 4}, {**good, "extra": 1}, None]
    for counts in bad:
        assert wire.check_acceptance({"v1": counts}) is None, counts  # nothing well-formed: keep the last
        assert wire.check_acceptance({"v1": good, "v2": counts}) == {"v1": VersionAcceptance(10, 4, 14)}, counts
    assert wire.check_acceptance([good]) is None
    many = {str(i): good for i in range(wire.MAX_ACCEPTANCE_VERSIONS + 5)}
    assert len(wire.check_acceptance(many)) == wire.MAX_ACCEPTANCE_VERSIONS


def test_the_service_keeps_an_engines_last_well_formed_report(tiny_target, service):
    hidden, url = tiny_target.shape.hidden_size, service.url("tcp")
    _report(url, "engine-c", hidden, {"v1": _counts(50, 20, 70)}, {"v1": [60, 25, 85]})  # then the list format
    assert service.server.acceptance_of("engine-c") == {"v1": VersionAcceptance(forwards=50, accepted=20, committed=70)}
    assert service.server.reporting_engines() == ["engine-c"]
