"""The batched reference engine on a tiny model: lossless under batching, swaps and failures."""
import threading
import time

import pytest
import torch

from tide.engine.base import GenerationRequest, SamplingParams
from tide.engine.reference import ReferenceEngine
from tide.spec.generate import generate


def prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(3, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def run_all(engine, ps, max_new_tokens=24):
    outs = {}

    def one(i, p):
        req = GenerationRequest(f"r{i}", tuple(p), SamplingParams(max_new_tokens=max_new_tokens))
        outs[i] = [t for ev in engine.submit(req) for t in ev.token_ids]
    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(ps)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    return [outs[i] for i in range(len(ps))]


@pytest.fixture()
def engine(tiny_target, tiny_drafter):
    e = ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_len=3,
                        max_batch_size=4, max_seq_len=200)
    yield e
    e.close()


class ListSink:
    """A capture sink that keeps what it is offered (the real one is tide.capture.CaptureTap)."""

    def __init__(self):
        self.items = []

    def offer(self, captures):
        self.items.extend(captures)


def test_batched_requests_equal_single_request_greedy(engine, tiny_target):
    ps = prompts(10)
    outs = run_all(engine, ps)
    for p, out in zip(ps, outs):
        assert out == generate(tiny_target, None, p, 24)[0]
    stats = engine.stats()
    assert stats.requests_finished == 10 and stats.tokens_generated == 240
    assert stats.acceptance["v1"].forwards > 0


def test_swap_between_steps_keeps_outputs_identical(engine, tiny_target, tiny_drafter):
    from tide.train.offline import new_drafter

    other = new_drafter(tiny_target, 200, torch.arange(512), seed=5).eval()
    ps = prompts(8, seed=1)
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("outs", run_all(engine, ps, 40)))
    t.start()
    for i in range(6):
        time.sleep(0.05)
        engine.swap_drafter(other if i % 2 == 0 else tiny_drafter, f"v{i + 2}")
    t.join(timeout=120)
    for p, out in zip(ps, result["outs"]):
        assert out == generate(tiny_target, None, p, 40)[0]
    assert engine.drafter_version == "v7"


def test_capture_sink_sees_every_committed_position_once(engine):
    sink = ListSink()
    engine.set_capture_sink(sink)
    p = prompts(1, seed=2)[0]
    out = run_all(engine, [p], 20)[0]
    caps = [c for c in sink.items if c.meta.request_id == "r0"]
    assert caps[0].is_prompt and caps[0].token_ids.tolist() == p
    assert caps[-1].finished
    fed = [t for c in caps for t in c.token_ids.tolist()]
    positions = [c.start_position for c in caps if c.token_ids.numel()]
    assert fed == p + out[:len(fed) - len(p)]
    assert positions == sorted(positions) and len(set(positions)) == len(positions)
    for c in caps:
        assert c.aux_hidden.shape == (c.token_ids.numel(), 3 * 64)
        assert c.final_hidden.shape == (c.token_ids.numel(), 64)


def test_capture_opt_out(engine):
    sink = ListSink()
    engine.set_capture_sink(sink)
    req = GenerationRequest("nocap", (5, 6, 7), SamplingParams(max_new_tokens=5), capture=False)
    list(engine.submit(req))
    assert not [c for c in sink.items if c.meta.request_id == "nocap"]


def test_raising_sink_and_raising_drafter_do_not_fail_requests(engine, tiny_target):
    class Boom:
        def offer(self, captures):
            raise RuntimeError("sink broke")

    engine.set_capture_sink(Boom())

    class BadDrafter:
        """Raises on use, as a corrupt drafter would."""
        shape = None

        def new_cache(self, *a):
            return None

        def __getattr__(self, name):
            raise RuntimeError("drafter broke")

    engine.swap_drafter(BadDrafter(), "bad")
    p = prompts(1, seed=3)[0]
    assert run_all(engine, [p], 16)[0] == generate(tiny_target, None, p, 16)[0]


def test_cancel_by_closing_the_stream_frees_the_slot(engine):
    req = GenerationRequest("long", (5, 6, 7), SamplingParams(max_new_tokens=150))
    stream = engine.submit(req)
    next(stream)
    stream.close()
    deadline = time.time() + 10
    while engine.health()["running"] and time.time() < deadline:
        time.sleep(0.05)
    assert engine.health()["running"] == 0


def test_too_long_request_rejected(engine):
    with pytest.raises(ValueError, match="max_new_tokens"):
        engine.submit(GenerationRequest("x", tuple(range(3, 190)), SamplingParams(max_new_tokens=50)))


def test_draft_stop_prob_out_of_range_is_refused(tiny_target, tiny_drafter):
    with pytest.raises(ValueError, match="draft_stop_prob"):
        ReferenceEngine(tiny_target, None, tiny_drafter, "v1", target_model_id="tiny", draft_stop_prob=1.5)


def collect(stream):
    """(tokens, the last event) of one request's stream."""
    events = list(stream)
    return [t for ev in events for t in ev.token_ids], events[-1]


def test_one_failing_request_does_not_fail_its_batch(engine, tiny_target, monkeypatch):
    import tide.engine.reference as reference

    def failing_for_poisoned_rows(step):
        def wrapped(*args, **kwargs):
            rows = next(a for a in args if isinstance(a, list))
            if any(r.top_p == 0.5 for r in rows):  # the poisoned request's marker
                raise RuntimeError("this row breaks the step")
            return step(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(reference, "speculative_step", failing_for_poisoned_rows(reference.speculative_step))
    monkeypatch.setattr(reference, "target_step", failing_for_poisoned_rows(reference.target_step))
    ps = prompts(4, seed=7)
    streams = [engine.submit(GenerationRequest(f"b{i}", tuple(p), SamplingParams(
        max_new_tokens=16, top_p=0.5 if i == 0 else 1.0))) for i, p in enumerate(ps)]
    results = [collect(s) for s in streams]
    assert results[0][1].finish_reason == "error"
    for p, (tokens, last) in zip(ps[1:], results[1:]):
        assert last.finish_reason == "length" and tokens == generate(tiny_target, None, p, 16)[0]


@pytest.mark.parametrize("sampling", [SamplingParams(max_new_tokens=20, temperature=1e-40),
                                      SamplingParams(max_new_tokens=20, temperature=1.0, top_k=1, seed=3)])
def test_tiny_temperature_and_top_k_1_are_greedy(engine, tiny_target, sampling):
    p = prompts(1, seed=11)[0]
    tokens, last = collect(engine.submit(GenerationRequest("g", tuple(p), sampling)))
    assert last.finish_reason == "length" and tokens == generate(tiny_target, None, p, 20)[0]


def test_ignore_eos_generates_past_the_eos_ids(tiny_target):
    p = prompts(1, seed=5)[0]
    greedy = generate(tiny_target, None, p, 12)[0]
    e = ReferenceEngine(tiny_target, None, None, "none", target_model_id="tiny", max_batch_size=1,
                        max_seq_len=200, eos_ids=(greedy[2],))
    try:
        stopped, _ = collect(e.submit(GenerationRequest("s", tuple(p), SamplingParams(max_new_tokens=12))))
        ignored, last = collect(e.submit(GenerationRequest("i", tuple(p), SamplingParams(
            max_new_tokens=12, ignore_eos=True))))
    finally:
        e.close()
    assert stopped == greedy[:greedy.index(greedy[2]) + 1]
    assert ignored == greedy and last.finish_reason == "length"


@pytest.mark.parametrize("sampling", [SamplingParams(temperature=float("nan")), SamplingParams(top_p=float("nan")),
                                      SamplingParams(temperature=float("inf"))])
def test_non_finite_sampling_values_are_refused_at_submit(engine, sampling):
    with pytest.raises(ValueError, match="finite"):
        engine.submit(GenerationRequest("nan", (5, 6, 7), sampling))
