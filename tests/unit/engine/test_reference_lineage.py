"""What the reference engine captures and reports when drafts are accepted: positions the client
received (none past a stop or the budget), the drafter version each position was drafted under,
and a decode loop that fails loudly instead of hanging its requests."""
import threading

import httpx
import pytest
import torch
from fake_engine import tiny_tokenizer

from tide.config import EngineConfig, ServerConfig
from tide.engine import base
from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine
from tide.engine.server import HttpServer, build_app
from tide.spec.generate import generate


class ListSink:
    """Keeps what the engine offers (the real sink is tide.capture.CaptureTap)."""

    def __init__(self):
        self.items = []

    def offer(self, captures):
        self.items.extend(captures)

    def of(self, rid):
        return [c for c in self.items if c.meta.request_id == rid and c.token_ids.numel()]


def new_engine(target, drafter, **kw):
    kw = {"draft_len": 4, "max_batch_size": 4, "max_seq_len": 200, **kw}
    return ReferenceEngine(target, None, drafter, "v1", target_model_id="tiny", **kw)


def output(engine, rid, prompt, **sampling):
    events = list(engine.submit(GenerationRequest(rid, tuple(prompt), SamplingParams(**sampling))))
    return [t for ev in events for t in ev.token_ids], events[-1].finish_reason


def assert_captured_what_was_sent(sink, rid, prompt, out):
    caps = sink.of(rid)
    tokens = torch.cat([c.token_ids.reshape(-1) for c in caps]).tolist()
    assert tokens == prompt + out[:-1]  # every fed token, the last output token never fed
    assert sum(c.aux_hidden.shape[0] for c in caps) == sum(c.final_hidden.shape[0] for c in caps) == len(tokens)
    starts = [c.start_position for c in caps]
    assert starts == [sum(c.token_ids.numel() for c in caps[:i]) for i in range(len(caps))]  # contiguous


def test_capture_stops_at_the_budget_and_at_a_stop_token_mid_draft(tiny_target, agreeing_drafter):
    drafter, prompts = agreeing_drafter
    engine = new_engine(tiny_target, drafter)
    sink = ListSink()
    engine.set_capture_sink(sink)
    try:
        prompt = prompts[0]
        full, _ = generate(tiny_target, None, prompt, 48)
        for budget in range(2, 30):  # some budgets end inside a step that accepted several drafts
            out, reason = output(engine, f"len-{budget}", prompt, max_new_tokens=budget)
            assert out == full[:budget] and reason == "length"
            assert_captured_what_was_sent(sink, f"len-{budget}", prompt, out)
        for at in range(2, 30):
            stop = full[at]
            if stop in full[:at]:
                continue
            out, reason = output(engine, f"stop-{at}", prompt, max_new_tokens=48, stop_token_ids=(stop,))
            assert out == full[:at + 1] and reason == "stop"
            assert_captured_what_was_sent(sink, f"stop-{at}", prompt, out)
        acc = engine.stats().acceptance["v1"]
        assert acc.accepted > acc.forwards / 2  # drafts were accepted: many steps committed several tokens
    finally:
        engine.close()


class GateSink(ListSink):
    """Holds the decode loop inside its first generated step's capture until ``release``, so a test
    can request a swap at a known point of a running request."""

    def __init__(self):
        super().__init__()
        self.held, self.released = threading.Event(), threading.Event()

    def offer(self, captures):
        super().offer(captures)
        if not self.held.is_set() and any(not c.is_prompt and c.token_ids.numel() for c in captures):
            self.held.set()
            self.released.wait(30)


def test_positions_after_a_swap_carry_the_new_version(tiny_target, agreeing_drafter):
    drafter, prompts = agreeing_drafter
    engine = new_engine(tiny_target, drafter, max_batch_size=2)
    sink = GateSink()
    engine.set_capture_sink(sink)
    try:
        stream = engine.submit(GenerationRequest("held", tuple(prompts[1]), SamplingParams(max_new_tokens=60)))
        assert sink.held.wait(30)  # one decode step done under v1; the loop waits inside it
        engine.swap_drafter(drafter, "v2")
        sink.released.set()
        out = [t for ev in stream for t in ev.token_ids]
        versions = [c.meta.drafter_version for c in sink.of("held") if not c.is_prompt]
        assert versions[0] == "v1" and versions[-1] == "v2"
        swapped_at = versions.index("v2")
        assert set(versions[:swapped_at]) == {"v1"} and set(versions[swapped_at:]) == {"v2"}
        assert engine.drafter_version == "v2"
        assert out == generate(tiny_target, None, prompts[1], 60)[0]
    finally:
        sink.released.set()
        engine.close()


def test_a_failing_swap_allocation_keeps_the_old_drafter_serving(tiny_target, agreeing_drafter, monkeypatch):
    drafter, prompts = agreeing_drafter
    engine = new_engine(tiny_target, drafter)
    try:
        broken = type(drafter)(drafter.shape)
        broken.load_state_dict(drafter.state_dict())

        def no_memory(*_a, **_k):
            raise MemoryError("cannot allocate the drafter cache")
        monkeypatch.setattr(broken, "new_cache", no_memory)
        stream = engine.submit(GenerationRequest("in-flight", tuple(prompts[2]), SamplingParams(max_new_tokens=40)))
        engine.swap_drafter(broken, "v2")
        out = [t for ev in stream for t in ev.token_ids]
        assert out == generate(tiny_target, None, prompts[2], 40)[0]
        assert engine.drafter_version == "v1" and engine.failure is None
        assert "cannot allocate" in engine.health()["swap_error"]
        assert output(engine, "after", prompts[3], max_new_tokens=8)[1] == "length"
    finally:
        engine.close()


def test_a_dead_decode_loop_fails_its_requests_and_refuses_new_ones(tiny_target, agreeing_drafter, monkeypatch):
    """The loop dies outside a step: in-flight and queued requests end with the reason, /health
    answers 503 with it (Kubernetes' liveness probe restarts the pod), submit refuses."""
    drafter, prompts = agreeing_drafter
    engine = new_engine(tiny_target, drafter, max_batch_size=1)
    engine.tokenizer = tiny_tokenizer()  # the HTTP layer needs one; the requests here go in as ids
    server = HttpServer(build_app(engine, ServerConfig(host="127.0.0.1", port=0, control_token="t" * 32),
                                  EngineConfig(max_batch_size=1)), "127.0.0.1", 0, grace_s=1, log_level="warning")
    url = f"http://127.0.0.1:{server.start()}"
    try:
        assert httpx.get(f"{url}/health").status_code == 200
        running = engine.submit(GenerationRequest("running", tuple(prompts[0]), SamplingParams(max_new_tokens=150)))
        assert next(running).token_ids  # admitted and decoding
        queued = engine.submit(GenerationRequest("queued", tuple(prompts[1]), SamplingParams(max_new_tokens=8)))

        def broken_admit():
            raise RuntimeError("injected admission failure")
        monkeypatch.setattr(engine, "_admit", broken_admit)  # the loop calls it outside any step
        for stream in (running, queued):
            last = list(stream)[-1]
            assert last.finished and last.finish_reason == "error" and "injected admission failure" in last.error
        # the failure is recorded before any request is ended: health already says so
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "injected admission failure" in health.json()["reason"]
        control = httpx.get(f"{url}/control/health", headers={"Authorization": f"Bearer {'t' * 32}"})
        assert control.status_code == 503 and "injected admission failure" in control.json()["engine"]["failure"]
        with pytest.raises(base.EngineFailed):
            engine.submit(GenerationRequest("late", tuple(prompts[2]), SamplingParams(max_new_tokens=8)))
    finally:
        server.stop()
        engine.close()


def test_the_engine_service_stops_when_its_engine_failed():
    """tide.services.engine ends (and exits 1) once the engine reports a failure."""
    from tide.services.engine import _stop_when_failed

    class Failing:
        failure = None
    engine, stop = Failing(), threading.Event()
    watcher = threading.Thread(target=_stop_when_failed, args=(engine, stop, 0.01))
    watcher.start()
    assert not stop.wait(0.1)  # healthy: keeps serving
    engine.failure = "decode loop failed: boom"
    assert stop.wait(10)
    watcher.join(10)
