"""The drafter service over both transports: engines in remote mode stay lossless (greedy equal to
target-only, sampling keeps the target's distribution), across a swap the service applies for every
engine it serves; sessions are bounded; a malformed request is refused and the engine goes on."""
import pytest
import torch
from harness import TRANSPORTS, Service, assert_same_distribution, prompts, remote_engine, submit_all

from tide.contracts import VersionAcceptance
from tide.engine.base import GenerationRequest, SamplingParams
from tide.spec.generate import generate


@pytest.mark.parametrize("kind", TRANSPORTS)
@pytest.mark.parametrize("scheduler", ["stop_rule", "dspark"])
def test_greedy_identical_to_target_only_over_each_transport(tiny_target, agreeing_drafter, service, kind, scheduler):
    train_prompts = agreeing_drafter[1]
    ps = train_prompts + prompts(tiny_target.shape.vocab_size, 2, seed=3)
    engine = remote_engine(tiny_target, service.url(kind), scheduler=scheduler)
    try:
        outs = submit_all(engine, [GenerationRequest(f"g{i}", tuple(p), SamplingParams(max_new_tokens=48))
                                   for i, p in enumerate(ps)])
        acc = engine.stats().acceptance["v1"]
        view = engine.health()["drafter_service"]
    finally:
        engine.close()
    for p, out in zip(ps, outs):
        assert out == generate(tiny_target, None, p, 48)[0]
    assert view["drafted_steps"] > 0 and view["fallback_steps"] == {}, view
    assert acc.forwards > 0  # the service's drafts were verified here
    if scheduler == "stop_rule":  # (dspark admits drafts by their measured cost: it may verify only probes)
        assert acc.accepted > 0


@pytest.mark.parametrize("kind", TRANSPORTS)
def test_sampled_distribution_matches_target_only(tiny_target, service, kind):
    prompt, n = (5, 17, 33, 2, 9), 500
    engine = remote_engine(tiny_target, service.url(kind))
    try:
        reqs = [GenerationRequest(f"s{seed}", prompt, SamplingParams(max_new_tokens=2, temperature=0.4, seed=seed))
                for seed in range(n)]
        outs = []
        for i in range(0, n, 40):
            outs += submit_all(engine, reqs[i:i + 40])
        drafted = engine.health()["drafter_service"]["drafted_steps"]
    finally:
        engine.close()
    assert drafted > 0
    spec, plain = {}, {}  # the 2nd token: a drafted step's (the first comes from the prefill)
    for seed, a in enumerate(outs):
        b, _ = generate(tiny_target, None, list(prompt), 2, temperature=0.4, seed=10_000 + seed)
        spec[a[1]] = spec.get(a[1], 0) + 1
        plain[b[1]] = plain.get(b[1], 0) + 1
    assert_same_distribution(spec, plain, n)


def test_a_swap_reaches_every_engine_and_outputs_stay_the_targets(tiny_target, tiny_drafter, agreeing_drafter,
                                                                  service):
    ps = agreeing_drafter[1] * 2
    engines = [remote_engine(tiny_target, service.url(k)) for k in TRANSPORTS]
    reqs = [GenerationRequest(f"w{i}", tuple(p), SamplingParams(max_new_tokens=120)) for i, p in enumerate(ps)]
    try:
        import threading

        results = {}
        runs = [threading.Thread(target=lambda e=e, k=k: results.__setitem__(k, submit_all(e, reqs)))
                for k, e in zip(TRANSPORTS, engines)]
        [t.start() for t in runs]
        from tide.drafting.transport import wait_until

        assert wait_until(lambda: all(e.stats().acceptance.get("v1", VersionAcceptance()).forwards > 0 for e in engines), 120)
        service.host.swap_drafter(tiny_drafter, "v2")  # what the follower's swap watcher calls
        [t.join(timeout=300) for t in runs]
        versions = [e.drafter_version for e in engines]
        served = [set(e.stats().acceptance) for e in engines]
    finally:
        [e.close() for e in engines]
    assert versions == ["v2", "v2"]
    assert all({"v1", "v2"} <= s for s in served), served
    for k in TRANSPORTS:
        for p, out in zip(ps, results[k]):
            assert out == generate(tiny_target, None, p, 120)[0]


def test_sessions_are_freed_when_requests_end(tiny_target, agreeing_drafter, tmp_path):
    svc = Service(tiny_target, agreeing_drafter[0], tmp_path, max_sessions=4, max_batch_rows=4)
    engine = remote_engine(tiny_target, svc.url("ipc"))
    try:
        ps = prompts(tiny_target.shape.vocab_size, 10, seed=5)
        outs = submit_all(engine, [GenerationRequest(f"b{i}", tuple(p), SamplingParams(max_new_tokens=24))
                                   for i, p in enumerate(ps)])
        # one more request: its first draft carries the ids of the ten that ended
        more = submit_all(engine, [GenerationRequest("last", tuple(ps[0]), SamplingParams(max_new_tokens=24))])
        health = svc.server.health()
    finally:
        engine.close()
        svc.stop()
    for p, out in zip(ps + ps[:1], outs + more):
        assert out == generate(tiny_target, None, p, 24)[0]
    assert health["evicted"] == 0  # 10 requests through 4 sessions: each freed when its request ended
    assert health["sessions"] == 1  # only the last request's is held


def test_sessions_are_bounded_across_engines(tiny_target, agreeing_drafter, tmp_path):
    """Two engines of 4 rows each through 4 sessions, one engine per batch: each batch evicts the
    other engine's sessions (least recently used), which then attend from what they are fed anew."""
    import threading

    svc = Service(tiny_target, agreeing_drafter[0], tmp_path, max_sessions=4, max_batch_rows=4)
    engines = [remote_engine(tiny_target, svc.url(k)) for k in TRANSPORTS]
    ps = prompts(tiny_target.shape.vocab_size, 4, seed=6)
    results = {}
    try:
        runs = [threading.Thread(target=lambda e=e, k=k: results.__setitem__(k, submit_all(e, [
            GenerationRequest(f"{k}{i}", tuple(p), SamplingParams(max_new_tokens=40)) for i, p in enumerate(ps)])))
            for k, e in zip(TRANSPORTS, engines)]
        [t.start() for t in runs]
        [t.join(timeout=300) for t in runs]
        health = svc.server.health()
    finally:
        [e.close() for e in engines]
        svc.stop()
    for k in TRANSPORTS:
        for p, out in zip(ps, results[k]):
            assert out == generate(tiny_target, None, p, 40)[0]
    assert health["sessions"] <= 4 and health["evicted"] > 0


def test_the_session_table_evicts_least_recently_used_and_expires_idle_ones():
    from tide.drafting.sessions import SessionTable

    table = SessionTable(2, idle_s=3600)
    a = table.get(("e", "a"), 0, 1, set())
    table.get(("e", "b"), 0, 1, set())
    table.get(("e", "a"), 5, 1, set())  # a used last: b goes first
    c = table.get(("e", "c"), 7, 1, {("e", "c")})
    assert len(table) == 2 and table.evicted == 1 and c.slot != a.slot and c.first_pos == 7
    assert a.first_pos == 0  # a's feed from 5 rewrote keys it already held: it still attends from 0
    table.reset()  # a swap: every session's keys are the old drafter's
    assert table.get(("e", "a"), 9, 1, set()).first_pos == 9
    table.idle_s = 0.0
    assert table.expire() == 2 and len(table) == 0


def test_a_malformed_request_is_refused_and_the_service_goes_on(tiny_target, service):
    from tide.drafting import wire
    from tide.drafting.transport import EngineLink, wait_until

    link = EngineLink(service.url("tcp"))
    try:
        assert wait_until(lambda: link.send({"op": wire.HELLO, "engine": "bad", "shm": None}), 10)
        assert link.recv(10)[0]["op"] == wire.WELCOME
        rows = [{"id": "x", "t_len": 3, "pending": 1, "feed_start": 0, "first_pos": 0, "n_feed": 3,
                 "temperature": 0.0, "seed": -1}]
        bad = torch.tensor([1, 2, 10 ** 6]).numpy()  # a token id outside the vocabulary
        link.send({"op": wire.DRAFT, "seq": 1, "gamma": 4, "stop_prob": 0.0, "rows": rows},
                  {"tokens": bad, "aux": torch.zeros(3, 3 * tiny_target.shape.hidden_size).numpy()})
        reply = link.recv(10)[0]
        assert reply["op"] == wire.ERROR and "vocabulary" in reply["reason"]
    finally:
        link.close()
    engine = remote_engine(tiny_target, service.url("tcp"))
    try:
        p = prompts(tiny_target.shape.vocab_size, 1, seed=8)[0]
        (out,) = submit_all(engine, [GenerationRequest("ok", tuple(p), SamplingParams(max_new_tokens=16))])
        drafted = engine.health()["drafter_service"]["drafted_steps"]
    finally:
        engine.close()
    assert out == generate(tiny_target, None, p, 16)[0] and drafted > 0


def test_the_loop_accounts_its_waiting_and_drafting_time(tiny_target, agreeing_drafter, tmp_path):
    """/health's idle_s (waiting with nothing queued) and busy_s (drafting) split the loop's wall
    time: an idle service waits nearly all of it; a serving one drafts, and the two never add up to
    more than the wall (bench/starsd_scaling.py reads both)."""
    import time

    svc = Service(tiny_target, agreeing_drafter[0], tmp_path)
    engine = remote_engine(tiny_target, svc.url("ipc"))
    try:
        h0, t0 = svc.server.health(), time.monotonic()
        time.sleep(0.5)
        h1, t1 = svc.server.health(), time.monotonic()
        ps = prompts(tiny_target.shape.vocab_size, 4, seed=9)
        submit_all(engine, [GenerationRequest(f"u{i}", tuple(p), SamplingParams(max_new_tokens=16))
                            for i, p in enumerate(ps)])
        h2, t2 = svc.server.health(), time.monotonic()
    finally:
        engine.close()
        svc.stop()
    assert h1["idle_s"] - h0["idle_s"] > 0.8 * (t1 - t0)  # nothing to do: waiting
    drafting, waiting = h2["busy_s"] - h1["busy_s"], h2["idle_s"] - h1["idle_s"]
    # a wait is counted when it ends: one that began before the snapshot may land after it
    from tide.drafting.server import IDLE_WAIT_S
    assert drafting > 0 and drafting + waiting <= (t2 - t1) + IDLE_WAIT_S + 0.01
    assert h2["cpu_s"] >= h1["cpu_s"]
