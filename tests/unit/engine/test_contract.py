"""The engine contract (tide/engine/base.py): what every engine must do, whichever runs it.

Each test talks to engines only through ``Engine``. An engine joins the suite by adding a builder
to ENGINE_BUILDERS that returns an EngineUnderTest for a tiny model. Every contract test runs for
every engine except those NOT_RUN lists for it, each with its reason: for SGLang, the tests that
need a running SGLang server (a GPU); scripts/gpu_check_sglang.sh covers them on one.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch

from tide.drafter.artifact import DrafterError, save_drafter
from tide.engine.base import Engine, GenerationRequest, SamplingParams, StepCapture
from tide.engine.reference import ReferenceEngine
from tide.train.offline import new_drafter


@dataclass
class EngineUnderTest:
    engine: Engine  # serves drafter version "1"
    target_only: Engine  # the same target without a drafter: the lossless reference
    candidate: Path  # a valid drafter folder for this target, a different drafter than "1"
    misfit: Path  # a drafter folder for another target shape: must be refused
    prompts: list[list[int]]

    def close(self) -> None:
        self.engine.close()
        self.target_only.close()


def _drafters(tiny_target, tiny_drafter, tmp: Path) -> tuple[Path, Path, list[list[int]]]:
    """A valid candidate (another drafter, same vocab mapping), a misfit, and prompts."""
    other = new_drafter(tiny_target, tiny_drafter.shape.draft_vocab_size, torch.zeros(512), seed=7)
    other.set_vocab_mapping(tiny_drafter.d2t.clone())
    candidate = save_drafter(other.eval(), tmp / "candidate")
    misfit = save_drafter(other, tmp / "misfit")
    cfg = json.loads((misfit / "config.json").read_text())
    cfg["target_hidden_size"] = 2 * cfg["target_hidden_size"]
    (misfit / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]
    return candidate, misfit, prompts


def _reference(tiny_target, tiny_drafter, tmp: Path) -> EngineUnderTest:
    def engine(drafter, version):
        return ReferenceEngine(tiny_target, None, drafter, version, target_model_id="tiny", draft_len=3,
                               max_batch_size=4, max_seq_len=200)

    candidate, misfit, prompts = _drafters(tiny_target, tiny_drafter, tmp)
    return EngineUnderTest(engine(tiny_drafter, "1"), engine(None, "none"), candidate, misfit, prompts)


def _sglang(tiny_target, tiny_drafter, tmp: Path) -> EngineUnderTest:
    """SGLangEngine with its serving drafter but no server behind it (none runs without a GPU)."""
    from tide.engine.sglang.engine import SGLangEngine

    candidate, misfit, prompts = _drafters(tiny_target, tiny_drafter, tmp)
    serving = save_drafter(tiny_drafter, tmp / "serving")
    engine = SGLangEngine("http://127.0.0.1:9", serving, "1", target_model_id="tiny", max_seq_len=200,
                          timeout_s=5.0)
    return EngineUnderTest(engine, engine, candidate, misfit, prompts)


ENGINE_BUILDERS: dict[str, Callable[..., EngineUnderTest]] = {"reference": _reference, "sglang": _sglang}
_SERVER = "needs a running SGLang server (GPU): scripts/gpu_check_sglang.sh"
NOT_RUN: dict[str, dict[str, str]] = {"sglang": {
    "test_greedy_output_is_the_target_alone_in_a_batch": _SERVER,
    "test_capture_offers_every_fed_position_once_and_never_a_rejected_one":
        _SERVER + "; the conversion itself: tests/unit/engine/sglang/test_sglang_capture.py",
    "test_a_swap_applies_between_steps_of_a_running_request_and_stays_lossless":
        _SERVER + "; the weight path itself: tests/unit/engine/sglang/test_sglang_weights.py",
    "test_serving_goes_on_after_a_refused_drafter": _SERVER,
}}


def pytest_generate_tests(metafunc):
    if "eut" in metafunc.fixturenames:
        name = metafunc.function.__name__
        engines = [e for e in sorted(ENGINE_BUILDERS) if name not in NOT_RUN.get(e, {})]
        metafunc.parametrize("eut", engines, indirect=True)


def test_every_engine_runs_every_contract_test_it_does_not_list():
    tests = {n for n in globals() if n.startswith("test_") and "eut" in globals()[n].__code__.co_varnames}
    for engine, listed in NOT_RUN.items():
        assert engine in ENGINE_BUILDERS and set(listed) <= tests, engine
        assert set(listed) != tests  # an engine that runs nothing is not in the suite


@pytest.fixture
def eut(request, tiny_target, tiny_drafter, tmp_path):
    built = ENGINE_BUILDERS[request.param](tiny_target, tiny_drafter, tmp_path)
    yield built
    built.close()


def _run(engine: Engine, rid: str, prompt: list[int], max_new_tokens: int = 24) -> list[int]:
    req = GenerationRequest(rid, tuple(prompt), SamplingParams(max_new_tokens=max_new_tokens))
    return [t for ev in engine.submit(req) for t in ev.token_ids]


def _run_concurrently(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = [[] for _ in prompts]

    def one(i: int) -> None:
        out[i] = _run(engine, f"r{i}", prompts[i])
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    return out


def test_greedy_output_is_the_target_alone_in_a_batch(eut):
    want = [_run(eut.target_only, f"t{i}", p) for i, p in enumerate(eut.prompts)]
    assert _run_concurrently(eut.engine, eut.prompts) == want
    assert all(len(w) == 24 for w in want)
    stats = eut.engine.stats()
    assert stats.requests_finished == len(eut.prompts) and stats.tokens_generated == 24 * len(eut.prompts)
    assert stats.acceptance["1"].committed > 0  # committed tokens are counted under the serving version


class ListSink:
    def __init__(self) -> None:
        self.seen: list[StepCapture] = []

    def offer(self, captures: list[StepCapture]) -> None:
        self.seen.extend(captures)


def test_capture_offers_every_fed_position_once_and_never_a_rejected_one(eut):
    sink = ListSink()
    eut.engine.set_capture_sink(sink)
    prompt = eut.prompts[1]
    out = _run(eut.engine, "cap", prompt)
    steps = [c for c in sink.seen if c.meta.request_id == "cap"]
    fed = [c for c in steps if c.token_ids.numel()]
    positions = [c.start_position + i for c in fed for i in range(c.token_ids.numel())]
    # the prompt, then every generated token but the last (it is never fed to the target)
    assert positions == list(range(len(prompt) + len(out) - 1))
    assert torch.cat([c.token_ids for c in fed]).tolist() == prompt + out[:-1]
    assert all(c.aux_hidden.shape[0] == c.final_hidden.shape[0] == c.token_ids.numel() for c in fed)
    assert [c.is_prompt for c in fed][0] and not fed[-1].is_prompt
    assert steps[-1].finished and not any(c.finished for c in steps[:-1])
    assert {c.meta.drafter_version for c in steps} == {"1"}


class GateSink:
    """Holds the engine inside its first capture hand-off until released, so a test can act while
    a request is known to be mid-decode (a real sink never blocks)."""

    def __init__(self) -> None:
        self.reached, self.release = threading.Event(), threading.Event()

    def offer(self, captures: list[StepCapture]) -> None:
        self.reached.set()
        assert self.release.wait(30)


def test_a_swap_applies_between_steps_of_a_running_request_and_stays_lossless(eut):
    prompt = eut.prompts[2]
    want = _run(eut.target_only, "t", prompt, 40)
    before = eut.engine.drafter
    handle = eut.engine.validate_drafter(eut.candidate, eut.prompts[0][:4])
    gate = GateSink()
    eut.engine.set_capture_sink(gate)
    stream = eut.engine.submit(GenerationRequest("swap", tuple(prompt), SamplingParams(max_new_tokens=40)))
    assert gate.reached.wait(30)  # the prefill is done, the request is running
    eut.engine.swap_drafter(handle, "2")
    gate.release.set()
    got = [t for ev in stream for t in ev.token_ids]
    assert got == want
    assert eut.engine.drafter_version == "2" and eut.engine.last_swap_pause_s > 0
    assert "2" in eut.engine.stats().acceptance  # steps after the swap counted under the new version
    eut.engine.swap_drafter(before, "1")  # a rollback re-serves the handle read before
    assert _run(eut.engine, "after", prompt, 40) == want
    assert eut.engine.drafter_version == "1" and eut.engine.drafter is before


def test_a_drafter_for_another_target_is_refused(eut):
    with pytest.raises(DrafterError, match="hidden"):
        eut.engine.validate_drafter(eut.misfit, eut.prompts[0][:4])
    with pytest.raises(DrafterError):
        eut.engine.validate_drafter(eut.misfit.parent / "missing", eut.prompts[0][:4])
    assert eut.engine.drafter_version == "1"
    assert eut.engine.validate_drafter(eut.candidate, eut.prompts[0][:4]) is not None  # a fitting one passes


def test_serving_goes_on_after_a_refused_drafter(eut):
    with pytest.raises(DrafterError):
        eut.engine.validate_drafter(eut.misfit, eut.prompts[0][:4])
    assert eut.engine.drafter_version == "1"
    assert len(_run(eut.engine, "still", eut.prompts[0], 8)) == 8


def test_health_is_json_and_names_the_serving_version(eut):
    body = eut.engine.health()
    assert json.loads(json.dumps(body)) == body
    assert body["drafter_version"] == eut.engine.drafter_version == "1"
    assert eut.engine.target_model_id and eut.engine.max_seq_len > 0


def test_a_request_past_the_context_is_refused_at_submit(eut):
    with pytest.raises(ValueError):
        eut.engine.submit(GenerationRequest("long", (5,) * eut.engine.max_seq_len, SamplingParams(max_new_tokens=8)))
