"""The demo's live line reads ingest and scheduler state from their real /metrics pages (served
over HTTP here by prometheus_client from the same metric objects the services update)."""
import socket
import time

import pytest
from prometheus_client import REGISTRY, start_http_server

from tide import metrics
from tide.traffic import loop_status, metric_value, scrape


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def metrics_url():
    port = _free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=REGISTRY)
    yield f"http://127.0.0.1:{port}/metrics"
    server.shutdown()
    thread.join(timeout=5)


def test_metric_values_follow_the_services_metrics(metrics_url):
    before = scrape(metrics_url)
    metrics.INGEST_TOKENS.inc(1234)
    metrics.SCHED_RETRAINS_FINISHED.labels("failed").inc()
    after = scrape(metrics_url)
    assert metric_value(after, metrics.INGEST_TOKENS) - (metric_value(before, metrics.INGEST_TOKENS) or 0) == 1234
    failed = metric_value(after, metrics.SCHED_RETRAINS_FINISHED, outcome="failed")
    assert failed - (metric_value(before, metrics.SCHED_RETRAINS_FINISHED, outcome="failed") or 0) == 1
    assert metric_value(after, metrics.SCHED_RETRAINS_FINISHED, outcome="no-such-outcome") is None


def test_loop_status_says_waiting_then_running(metrics_url):
    metrics.SCHED_RUNNING.set(0)
    metrics.SCHED_NEW_SAMPLES.set(9100)
    metrics.SCHED_THRESHOLD.set(16000)
    line = loop_status(metrics_url, metrics_url)
    tokens = metric_value(scrape(metrics_url), metrics.INGEST_TOKENS)
    assert line.startswith(f"{tokens / 1000:.1f}k tokens in Parquet | retrain: waiting 9.1k/16.0k new samples")
    metrics.SCHED_RUNNING.set(1)
    assert "retrain: running" in loop_status(metrics_url, metrics_url)
    metrics.SCHED_RUNNING.set(0)


def test_loop_status_counts_retrains_with_nothing_to_do_among_the_successes(metrics_url):
    def counts():
        text = scrape(metrics_url)
        return (int(metric_value(text, metrics.SCHED_RETRAINS_FINISHED, outcome="succeeded") or 0),
                int(metric_value(text, metrics.SCHED_RETRAINS_NOTHING_TO_DO) or 0))
    metrics.SCHED_RETRAINS_FINISHED.labels("succeeded").inc(2)
    metrics.SCHED_RETRAINS_NOTHING_TO_DO.inc()
    succeeded, empty = counts()
    assert f"({succeeded} succeeded ({empty} with nothing to do)" in loop_status(metrics_url, metrics_url)


def test_loop_status_when_services_are_down():
    dead = f"http://127.0.0.1:{_free_port()}/metrics"
    assert loop_status(dead, dead) == "ingest metrics unavailable | scheduler metrics unavailable"


@pytest.fixture(scope="module")
def chat_url():
    """A minimal OpenAI-style HTTP endpoint (a stand-in for the engine, not the engine: it answers
    /health and /v1/chat/completions with a fixed completion) to drive ``replay`` over real HTTP."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def _send(self, body: dict, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._send({"status": "ok", "target_model": "m"})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body["messages"][0]["content"] == "too long":  # as the engine refuses a prompt over its limit
                return self._send({"error": {"message": "prompt has 900 tokens; the limit is 768"}}, 400)
            if body["messages"][0]["content"] == "crash":
                return self._send({"error": {"message": "internal error"}}, 500)
            self._send({"choices": [{"finish_reason": "length"}], "usage": {"completion_tokens": 3}})

        def log_message(self, *_):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def _prompts():
    import itertools

    from tide.workloads import Prompt
    return (Prompt(id=str(i), workload="chat", messages=[{"role": "user", "content": f"q{i}"}])
            for i in itertools.count())


def test_replay_of_endless_prompts_stops_on_the_event(chat_url):
    import threading

    from tide.traffic import replay

    stop = threading.Event()
    res = replay(chat_url, _prompts(), concurrency=4, max_tokens=3, until=lambda: stop.is_set(),
                 on_done=lambda r: r.ok >= 25 and stop.set())
    assert 25 <= res.sent <= 25 + 4 and res.failed == 0 and res.completion_tokens == 3 * res.sent


def test_replay_of_a_finite_list_sends_each_prompt_once(chat_url):
    import itertools

    from tide.traffic import replay

    res = replay(chat_url, list(itertools.islice(_prompts(), 7)), concurrency=3, max_tokens=3)
    assert (res.sent, res.ok) == (7, 7)


def test_a_prompt_refused_as_bad_input_is_counted_apart_from_failures(chat_url):
    from tide.traffic import replay
    from tide.workloads import Prompt

    prompts = [Prompt(id=str(i), workload="chat", messages=[{"role": "user", "content": text}])
               for i, text in enumerate(["q0", "too long", "q2", "crash"])]
    res = replay(chat_url, prompts, concurrency=2, max_tokens=3)
    assert (res.sent, res.ok, res.rejected, res.failed) == (4, 2, 1, 1)
    assert sorted(e[:3] for e in res.errors) == ["400", "500"]


def test_replay_passes_a_callback_error_to_the_caller(chat_url):
    from tide.traffic import replay

    def boom(_):
        raise RuntimeError("watcher failed")

    with pytest.raises(RuntimeError, match="watcher failed"):
        replay(chat_url, _prompts(), concurrency=2, max_tokens=3, on_done=boom)



def _rows(n: int, committed: int):
    import torch

    from tide.spec.decode import RowResult
    empty = torch.zeros(0)
    return [RowResult(committed=[1] * committed, n_accepted=committed - 1, fed_tokens=empty,
                      aux_hidden=empty, final_hidden=empty) for _ in range(n)]


def _drafted(n: int, committed: int):
    """A drafted step's stats: every row verified 4 drafts, ``committed - 1`` of them accepted."""
    from tide.spec.decode import StepStats
    return StepStats(gamma=4, accepted=[committed - 1] * n, drafted=[4] * n)


def test_sampler_counts_gated_rows_as_served_not_as_drafted(metrics_url):
    """The demo's post-swap evidence: rows the cost gate ran target-only are forwards the drafter's
    engine served, but they say nothing of its acceptance (the engine's own accounting, scraped
    from a real /metrics page)."""
    from tide.engine.accounting import EngineAccounting
    from tide.traffic import AcceptanceSampler

    accounting, version = EngineAccounting(), "sampler-test-v7"
    sampler = AcceptanceSampler(metrics_url)
    accounting.step(version, _rows(3, 2), _drafted(3, 2), has_drafter=True)  # before the window: not counted
    sampler.sample()
    start_s = time.monotonic() - sampler.t0
    accounting.step(version, _rows(4, 3), _drafted(4, 3), has_drafter=True)
    accounting.step(version, _rows(5, 1), None, has_drafter=True)  # the gate ran these target-only
    sampler.sample()
    assert sampler.served_forwards_since(start_s, version) == 9
    assert sampler.forwards_since(start_s, version) == 4
    assert sampler.points[-1].tokens_per_forward == 3.0  # the drafted rows only
    assert sampler.served_forwards_since(start_s, "no-such-version") == 0


@pytest.mark.timeout(60)
def test_an_interrupt_of_the_caller_stops_every_worker(chat_url):
    """Ctrl-C (here: a signal handler's exception) while replay waits for its workers: they stop
    after their request and the exception reaches the caller, instead of the workers replaying
    endless prompts while the caller waits for them."""
    import signal
    import time

    from tide.traffic import TrafficResult, replay

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    result = TrafficResult()
    old = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.5)
    t0 = time.monotonic()
    try:
        with pytest.raises(Interrupted):
            replay(chat_url, _prompts(), concurrency=3, max_tokens=3, result=result)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 10
    sent = result.sent
    time.sleep(0.3)
    assert sent > 0 and result.sent == sent  # nothing sent after the caller left


@pytest.mark.timeout(60)
def test_an_interrupt_another_thread_receives_still_stops_the_workers(chat_url):
    """The kernel may hand a process signal (Ctrl-C) to any thread; Python runs its handler in the
    caller's thread, but only once that thread runs again: a caller blocked on its workers until
    they ran out would replay the whole source first (forever, for an endless one)."""
    import itertools
    import signal
    import threading
    import time

    from tide.traffic import TrafficResult, replay

    class Interrupted(Exception):
        pass

    def interrupt(signum, frame):
        raise Interrupted

    def deliver_here() -> None:
        time.sleep(0.5)
        signal.pthread_kill(threading.get_ident(), signal.SIGUSR1)  # this thread, not the caller's

    result, total = TrafficResult(), 20000
    old = signal.signal(signal.SIGUSR1, interrupt)
    threading.Thread(target=deliver_here, daemon=True).start()
    try:
        with pytest.raises(Interrupted):
            replay(chat_url, itertools.islice(_prompts(), total), concurrency=3, max_tokens=3, result=result)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert 0 < result.sent < total / 2
