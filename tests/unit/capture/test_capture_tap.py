"""The tap on the engine's hot path: never blocks, never raises, drops and counts when full."""
import time

import torch

from tide import metrics
from tide.capture.tap import CaptureTap
from tide.config import CaptureConfig, KafkaConfig
from tide.engine.base import CaptureMeta, StepCapture

torch.set_num_threads(1)
H = 8


def steps_for(rid, n_steps, workload=None):
    m = CaptureMeta(rid, "m", "v1", (1, 2, 3), workload, 2, time.time())
    out = [StepCapture(m, 0, torch.arange(2), torch.zeros(2, 3 * H), torch.zeros(2, H), True)]
    for i in range(n_steps):
        out.append(StepCapture(m, 2 + i, torch.tensor([i]), torch.zeros(1, 3 * H),
                               torch.zeros(1, H), False, i == n_steps - 1))
    return out


def counter(c, *labels):
    return (c.labels(*labels) if labels else c)._value.get()


def test_full_queue_drops_without_blocking_and_marks_the_request_broken():
    tap = CaptureTap(CaptureConfig(queue_max_items=5), KafkaConfig(), start=False)  # nobody drains the queue
    before = counter(metrics.CAPTURE_DROPPED_STEPS, "queue_full")
    worst = 0.0
    for s in steps_for("a", 20):
        t = time.perf_counter()
        tap.offer([s])
        worst = max(worst, time.perf_counter() - t)
    assert tap.queue_depth == 5
    # one drop marks the request broken: its later steps are skipped, not counted as full drops
    assert counter(metrics.CAPTURE_DROPPED_STEPS, "queue_full") - before == 1
    assert list(tap._aborted) == ["a"]
    assert worst < 0.01


def test_sampling_and_token_budget_limit_what_is_enqueued():
    tap = CaptureTap(CaptureConfig(queue_max_items=1000, max_tokens_per_request=5,
                                   workload_fractions={"skip": 0.0}), KafkaConfig(), start=False)
    for s in steps_for("b", 10):  # 2 prompt + 10 generated; budget 5 -> 4 steps (2+1+1+1)
        tap.offer([s])
    assert tap.queue_depth == 4
    for s in steps_for("c", 10, workload="skip"):
        tap.offer([s])
    assert tap.queue_depth == 4
    assert "b" not in tap._requests and "c" not in tap._requests  # finished: state released


def test_offer_swallows_errors():
    tap = CaptureTap(CaptureConfig(), KafkaConfig(), start=False)
    before = counter(metrics.CAPTURE_DROPPED_STEPS, "tap_error")
    tap.offer([object()])  # not a StepCapture: must not raise into the engine
    assert counter(metrics.CAPTURE_DROPPED_STEPS, "tap_error") - before == 1


def test_close_without_broker_returns_within_the_limit():
    cfg = CaptureConfig(connect_timeout_s=0.2, reconnect_backoff_s=0.2)
    tap = CaptureTap(cfg, KafkaConfig(bootstrap_servers="127.0.0.1:1"))
    before = counter(metrics.CAPTURE_DROPPED_RECORDS, "broker_unavailable")
    for s in steps_for("d", 3):
        tap.offer([s])
    t = time.monotonic()
    tap.close(timeout_s=3.0)
    assert time.monotonic() - t < 3.5
    assert counter(metrics.CAPTURE_DROPPED_RECORDS, "broker_unavailable") - before == 1
