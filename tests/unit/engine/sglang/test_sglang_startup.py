"""The plugin's scheduler start-up against SGLang 0.5.23's own Scheduler signature, hook wrapper,
runtime context (the ranks ``run_scheduler_process`` publishes before constructing the scheduler)
and speculative worker selection."""
from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY

from tide.engine.sglang import plugin, server_args

GOOD = dict(speculative_algorithm="EAGLE3", speculative_eagle_topk=1, custom_weight_loader=[server_args.LOADER])


def _server_args(**fields):
    from sglang.srt.server_args import ServerArgs

    return ServerArgs(model_path="dummy", **{**GOOD, **fields})


def _scheduler_context(args, world_rank: int):
    """What run_scheduler_process publishes for a scheduler at ``world_rank``, made active."""
    from sglang.srt.runtime_context import SpawnRanks, create_context, use_context

    return use_context(create_context(args, role="scheduler", ranks=SpawnRanks(world_rank=world_rank)))


@pytest.fixture
def capture_on(monkeypatch):
    monkeypatch.setenv(plugin.CONFIG_ENV, "")
    monkeypatch.setenv("TIDE_CAPTURE__ENABLED", "true")
    yield
    tap, plugin.PROCESS.tap = plugin.PROCESS.tap, None
    if tap is not None:  # a tap started where none should have: stop its worker
        tap.close(timeout_s=10.0)


def test_capture_rank_unknown_does_not_capture(sglang, capture_on, caplog):
    """No ranks published for this scheduler's arguments: no tap here, logged and counted (capturing
    on every rank would duplicate every record)."""
    from sglang.srt.runtime_context import ParallelContext, RuntimeContext, use_context

    args = _server_args()
    elsewhere = _scheduler_context(_server_args(), world_rank=0)  # another scheduler's arguments
    for context in (elsewhere, use_context(RuntimeContext(parallel=ParallelContext()))):  # nothing published
        unknown = REGISTRY.get_sample_value("tide_capture_rank_unknown_total") or 0.0
        with context, caplog.at_level(logging.ERROR, logger=plugin.__name__):
            plugin.on_scheduler_init(None, args, None)
        assert plugin.PROCESS.tap is None and plugin.PROCESS.ctx.sink is None
        assert REGISTRY.get_sample_value("tide_capture_rank_unknown_total") == unknown + 1
        assert "rank is unknown" in caplog.text
        caplog.clear()


def test_capture_rank_is_the_schedulers_published_rank(sglang):
    """Attention rank 0 captures, on the last pipeline stage (the one hosting the draft)."""
    args = _server_args(tp_size=2)
    for world_rank, captures in ((0, True), (1, False)):
        with _scheduler_context(args, world_rank):
            assert plugin.capture_rank(args) is captures
    args = _server_args(pp_size=2)
    for world_rank, captures in ((0, False), (1, True)):
        with _scheduler_context(args, world_rank):
            assert plugin.capture_rank(args) is captures


def test_scheduler_init_by_keyword(sglang, monkeypatch):
    """SGLang's BEFORE wrapper hands the hook the arguments as the caller passed them."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.plugins.hook_registry import HookType, _wrap_fn

    monkeypatch.setenv(plugin.CONFIG_ENV, "")
    monkeypatch.setenv("TIDE_CAPTURE__ENABLED", "false")
    init = _wrap_fn(Scheduler.__init__, plugin.on_scheduler_init, HookType.BEFORE)  # what apply_hooks installs
    with pytest.raises(server_args.SGLangPluginError, match="EAGLE3"):
        init(object.__new__(Scheduler), server_args=_server_args(speculative_algorithm="EAGLE"), port_args=None)
    plugin.PROCESS.ctx = None
    plugin.on_scheduler_init(None, server_args=_server_args(), port_args=None)
    assert plugin.PROCESS.ctx is not None and plugin.PROCESS.ctx.sink is None  # capture off: no sink


def test_non_v2_worker_fails_clearly(sglang, capture_on, monkeypatch):
    """With capture on, a server whose speculative worker is not the hooked EAGLEWorkerV2 does not
    start; overlap scheduling off still runs EAGLEWorkerV2 in 0.5.23 and starts."""
    multi_layer = _server_args(tp_size=2, enable_multi_layer_eagle=True)
    with _scheduler_context(multi_layer, world_rank=1):  # a rank without a tap
        with pytest.raises(server_args.SGLangPluginError, match="MultiLayerEagleWorkerV2.*nothing would be captured"):
            plugin.on_scheduler_init(None, multi_layer, None)
    no_overlap = _server_args(tp_size=2, disable_overlap_schedule=True)
    with _scheduler_context(no_overlap, world_rank=1):
        plugin.on_scheduler_init(None, no_overlap, None)
    monkeypatch.setenv("TIDE_CAPTURE__ENABLED", "false")  # nothing to capture: nothing to refuse
    with _scheduler_context(multi_layer, world_rank=1):
        plugin.on_scheduler_init(None, multi_layer, None)
