"""The demo's phase-2 stop rule waits for the retrain launched after the first swap: the first swap is
the shift retrain's own auto-promotion, which the engine serves before the scheduler counts that job
finished. Real HTTP: a local server answers the engine's /health and the scheduler's /metrics."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from tide.demo import DemoSettings
from tide.demo_watch import LoopWatch
from tide.traffic import AcceptanceSampler


class _Fleet:
    """What the engine serves and what the scheduler has counted, as their endpoints answer."""

    def __init__(self) -> None:
        self.version, self.launched, self.finished, self.empty = "1", 0, 0, 0

    def handler(self):
        fleet = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                if self.path == "/health":
                    body, kind = json.dumps({"drafter_version": fleet.version}), "application/json"
                else:
                    body = ("# TYPE tide_scheduler_retrains_launched_total counter\n"
                            f'tide_scheduler_retrains_launched_total{{launcher="local"}} {fleet.launched}\n'
                            "# TYPE tide_scheduler_retrains_finished_total counter\n"
                            f'tide_scheduler_retrains_finished_total{{status="succeeded"}} {fleet.finished}\n'
                            "# TYPE tide_scheduler_retrains_nothing_to_do_total counter\n"
                            f"tide_scheduler_retrains_nothing_to_do_total {fleet.empty}\n")
                    kind = "text/plain; version=0.0.4"
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *_):
                pass

        return Handler


@pytest.fixture
def fleet():
    state = _Fleet()
    server = ThreadingHTTPServer(("127.0.0.1", 0), state.handler())
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    state.stack = SimpleNamespace(endpoints={"engine": url, "scheduler metrics": f"{url}/metrics"})
    yield state
    server.shutdown()


def test_the_first_swaps_own_retrain_counted_late_is_not_the_final_one(fleet):
    settings = DemoSettings()
    watch = LoopWatch(fleet.stack, AcceptanceSampler(f"{fleet.stack.endpoints['engine']}/metrics"), "1", settings,
                      time.monotonic())
    fleet.launched = 1  # the shift's retrain runs, promotes its challenger, and the engine serves it
    fleet.version = "2"
    watch.on_done()
    assert watch.t_first_swap is not None
    fleet.finished = 1  # the scheduler reaps that job after the swap
    later = time.monotonic() + settings.not_promoted_grace_s + 1
    assert not watch._final_done(time.monotonic()) and not watch._final_done(later)
    fleet.launched = 2  # the full retrain: running, then finished without a promoted challenger
    assert not watch._final_done(later)
    fleet.finished = 2
    assert not watch._final_done(later)  # the grace for its challenger to swap in starts now
    assert watch._final_done(later + settings.not_promoted_grace_s + 1)
    assert watch.final_note == "the retrain after the first swap finished without a promoted challenger"


def test_a_second_swap_is_the_final_drafter(fleet):
    watch = LoopWatch(fleet.stack, AcceptanceSampler(f"{fleet.stack.endpoints['engine']}/metrics"), "1",
                      DemoSettings(), time.monotonic())
    fleet.launched, fleet.version = 1, "2"
    watch.on_done()
    fleet.launched, fleet.finished, fleet.version = 2, 1, "3"
    watch.on_done()
    assert watch._final_done(time.monotonic()) and watch.version == "3"


def test_a_swap_after_the_loop_closed_leaves_its_outcome_as_judged(fleet):
    # requests in flight when the loop closes still finish and report; a swap among them (a later
    # retrain's challenger) must not replace the version, swap time and count the loop was judged on
    watch = LoopWatch(fleet.stack, AcceptanceSampler(f"{fleet.stack.endpoints['engine']}/metrics"), "1",
                      DemoSettings(), time.monotonic())
    fleet.version = "2"
    for _ in range(9):
        watch.on_done()
    watch.closed, watch.t_closed = True, time.monotonic()
    fleet.version = "3"
    watch.on_done()
    watch.on_done()
    out = watch.outcome()
    assert watch.version == "2" and out["served_after_swap"] == 9 and out["post_swap_s"] >= 0 and out["swaps"] == 1


def test_retrains_that_found_too_little_data_are_not_challengers_refused(fleet):
    # a retrain whose window held no held-out request yet succeeds with nothing to do: the scheduler
    # launches the next once more traffic has come, so the loop is still open
    settings = DemoSettings()
    t0 = time.monotonic()
    watch = LoopWatch(fleet.stack, AcceptanceSampler(f"{fleet.stack.endpoints['engine']}/metrics"), "1", settings, t0)
    past_grace = t0 + settings.not_promoted_grace_s + 1
    fleet.launched = fleet.finished = fleet.empty = settings.max_unpromoted_retrains
    assert watch._no_swap_reason(t0) is None and watch._no_swap_reason(past_grace) is None
    fleet.launched = fleet.finished = fleet.empty + settings.max_unpromoted_retrains  # judged, none promoted
    assert watch._no_swap_reason(past_grace) is None  # the grace for a challenger to swap in starts now
    reason = watch._no_swap_reason(past_grace + settings.not_promoted_grace_s + 1)
    assert reason.startswith(f"{settings.max_unpromoted_retrains} retrains finished but no challenger")


def test_a_retrain_with_nothing_to_do_after_the_first_swap_is_not_the_final_one(fleet):
    settings = DemoSettings()
    watch = LoopWatch(fleet.stack, AcceptanceSampler(f"{fleet.stack.endpoints['engine']}/metrics"), "1", settings,
                      time.monotonic())
    fleet.launched = fleet.finished = fleet.empty = 1  # before the shift's retrain: one with too little data
    fleet.launched, fleet.version = 2, "2"
    watch.on_done()
    fleet.finished = 2
    fleet.launched, fleet.finished, fleet.empty = 3, 3, 2  # the next full retrain finds too little as well
    grace = settings.not_promoted_grace_s + 1
    later = time.monotonic() + 2 * grace
    assert not watch._final_done(later) and not watch._final_done(later + grace)
    fleet.launched = fleet.finished = 4  # then one that judged a candidate, not promoted
    assert not watch._final_done(later + grace) and watch._final_done(later + 2 * grace)
