"""The service follows ``champion`` once for all its engines, and judges collapse per engine: the
acceptance each engine reports with its requests feeds that engine's own collapse guard; one
engine's collapse swaps the previous drafter back for every engine and refuses the version."""
import dataclasses

import torch

from tide.config import OpsConfig
from tide.drafting import wire
from tide.drafting.transport import EngineLink, wait_until
from tide.registry import RegistryError
from tide.services.drafter_follow import ServiceFollower


def _report(url: str, engine: str, hidden: int, acceptance: dict) -> None:
    """An engine's draft request carrying its acceptance counters, through the wire."""
    link = EngineLink(url)
    try:
        assert wait_until(lambda: link.send({"op": wire.HELLO, "engine": engine, "shm": None}), 10)
        assert link.recv(30)[0]["op"] == wire.WELCOME
        rows = [{"id": "r", "t_len": 3, "pending": 1, "feed_start": 0, "first_pos": 0, "n_feed": 3,
                 "temperature": 0.0, "seed": -1}]
        link.send({"op": wire.DRAFT, "engine": engine, "seq": 1, "gamma": 2, "stop_prob": 0.0, "rows": rows,
                   "acceptance": acceptance},
                  {"tokens": torch.tensor([4, 5, 6]).numpy(), "aux": torch.zeros(3, 3 * hidden).numpy()})
        assert link.recv(30)[0]["op"] == wire.DRAFTS
    finally:
        link.close()


def _unreachable():
    raise RegistryError("no registry in this test")


def test_one_engines_collapse_rolls_the_service_back_for_all(tiny_target, tiny_drafter, agreeing_drafter, service):
    ops = dataclasses.replace(OpsConfig(), guard_window_forwards=50, guard_floor=1.05)
    follower = ServiceFollower(service.server, ops, _unreachable, None, None)
    assert follower.watcher.swap_to("v2", tiny_drafter).status == "swapped"  # as a champion poll would
    assert service.server.host.drafter_version == "v2"
    hidden, url = tiny_target.shape.hidden_size, service.url("tcp")
    _report(url, "engine-a", hidden, {"v1": [300, 240, 540], "v2": [100, 80, 180]})  # 1.8 tokens/forward
    assert follower.check_engines() is None  # engine a's window is healthy
    _report(url, "engine-b", hidden, {"v2": [100, 1, 101]})  # 1.01: collapsed on b's traffic
    reason = follower.check_engines()
    assert reason is not None and "below floor" in reason
    assert wait_until(lambda: service.server.host.drafter_version == "v1", 30)  # served to every engine again
    assert "v2" in follower.watcher.refused and follower.health()["pending_registry_rollback"] == "v2"
    assert set(follower.guards) == {"engine-a", "engine-b"}
