"""The tap on the engine's hot path and its worker process: never blocks, never raises, drops and
counts when the staging ring is full or the worker is gone, restarts a dead worker."""
import os
import signal
import statistics
import threading
import time

import numpy as np
import pytest
import torch

from tide import metrics
from tide.capture.ring import StagingRing, bf16_from_float32
from tide.capture.tap import CaptureTap
from tide.config import CaptureConfig, KafkaConfig
from tide.contracts import CaptureMeta, StepCapture

torch.set_num_threads(1)
H = 8
NO_BROKER = KafkaConfig(bootstrap_servers="127.0.0.1:1")
# offers take microseconds, close(1 s) a few seconds; one that waits on a stopped or missing worker
# never returns in time
RETURN_TIMEOUT_S = 20.0
# a dropping offer does less work than a staging one: generous, as single offers get descheduled
DROP_VS_STAGE_RATIO = 10.0


def steps_for(rid, n_steps, workload=None, h=H):
    m = CaptureMeta(rid, "m", "v1", (1, 2, 3), workload, 2, time.time())
    out = [StepCapture(m, 0, torch.arange(2), torch.zeros(2, 3 * h), torch.zeros(2, h), True)]
    for i in range(n_steps):
        out.append(StepCapture(m, 2 + i, torch.tensor([i]), torch.zeros(1, 3 * h),
                               torch.zeros(1, h), False, i == n_steps - 1))
    return out


def counter(c, *labels):
    return (c.labels(*labels) if labels else c)._value.get()


def wait_for(cond, timeout_s, what):
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.05)


def offer_each(tap, steps):
    """Offer each step from another thread, like a decode loop; each offer's seconds.
    Fails when the offers do not all return within RETURN_TIMEOUT_S (a blocked offer)."""
    costs_s, done = [], threading.Event()

    def loop():
        for s in steps:
            t = time.perf_counter()
            tap.offer([s])
            costs_s.append(time.perf_counter() - t)
        done.set()
    threading.Thread(target=loop, name="decode-loop", daemon=True).start()
    assert done.wait(RETURN_TIMEOUT_S), f"an offer blocked: {len(costs_s)} of {len(steps)} returned"
    return costs_s


def assert_drops_cost_no_more_than_staging(drop_costs_s, stage_costs_s):
    """Medians: a drop that waited (even briefly) on the worker costs many staging offers."""
    drop_s, stage_s = statistics.median(drop_costs_s), statistics.median(stage_costs_s)
    assert drop_s < DROP_VS_STAGE_RATIO * stage_s, f"drop {drop_s * 1e6:.0f} us vs staging {stage_s * 1e6:.0f} us"


def quick(**kw):
    return CaptureConfig(connect_timeout_s=0.2, reconnect_backoff_s=0.2, **kw)


def test_worker_bf16_rounding_matches_torchs_cast():
    """The tap stages float32 rows raw; the worker's rounding must give torch's bf16 bits exactly."""
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(-2**31, 2**31 - 1, (200_000,), dtype=torch.int64, generator=gen).to(torch.int32)
    values = torch.cat([bits.view(torch.float32), torch.randn(10_000, generator=gen) * 1e-3,
                        torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4028235e38, 1e-45,
                                      1.00390625, 1.01171875])])  # exact ties round to even
    expected = values.to(torch.bfloat16)
    got = torch.from_numpy(bf16_from_float32(values.numpy()).view(np.int16)).view(torch.bfloat16)
    nan = torch.isnan(values)
    assert torch.equal(got[~nan], expected[~nan])
    assert torch.isnan(got[nan]).all() and nan.sum() > 100


def test_ring_reserves_without_wrapping_and_refuses_when_full():
    ring = StagingRing.create(1024)
    try:
        a = ring.reserve(600)
        assert a == 0
        ring.commit(a, 600)  # 640 bytes used (aligned)
        assert ring.reserve(600) is None  # would need the next lap, whose start is still unread
        ring.set_tail(640)  # the worker took the first block
        b = ring.reserve(600)
        assert b == 1024 and ring.offset(b) == 0  # skipped the 384-byte tail end: blocks never wrap
        ring.commit(b, 600)
        # the skipped 384 bytes count as used until the worker passes them: 1024 - (1664 - 640) = 0 free
        assert ring.reserve(64) is None
        ring.set_tail(b + 640)  # the worker took the second block: the ring is empty
        assert ring.reserve(64) == 1664  # right after the second block, in the same lap
        assert ring.reserve(2048) is None  # larger than the ring: never fits
    finally:
        ring.close()


def test_full_ring_drops_without_blocking_and_marks_the_request_broken():
    tap = CaptureTap(quick(staging_bytes=8192), NO_BROKER)
    os.kill(tap.worker_pid, signal.SIGSTOP)  # a stalled worker: nothing consumes the ring
    try:
        before = counter(metrics.CAPTURE_DROPPED_STEPS, "queue_full")
        staged0 = counter(metrics.CAPTURE_STEPS)
        costs_s = offer_each(tap, steps_for("a", 200, h=64))  # one position: ~1 kB staged as float32
        # one drop marks the request broken: its later steps are skipped, not counted as drops
        assert counter(metrics.CAPTURE_DROPPED_STEPS, "queue_full") - before == 1
        n_staged = int(counter(metrics.CAPTURE_STEPS) - staged0)
        assert 1 < n_staged < 20
        assert "a" not in tap._requests  # finished: state released
        # new requests find the ring still full: each first step is dropped at once, not waited on
        drop_costs_s = offer_each(tap, [steps_for(f"a{i}", 1, h=64)[0] for i in range(100)])
        assert counter(metrics.CAPTURE_DROPPED_STEPS, "queue_full") - before == 101
        assert_drops_cost_no_more_than_staging(drop_costs_s, costs_s[:n_staged])
    finally:
        os.kill(tap.worker_pid, signal.SIGCONT)
        tap.close(timeout_s=3.0)


def test_sampling_and_token_budget_limit_what_is_staged():
    tap = CaptureTap(quick(max_tokens_per_request=5, workload_fractions={"skip": 0.0}), NO_BROKER)
    try:
        staged0 = counter(metrics.CAPTURE_STEPS)
        for s in steps_for("b", 10):  # 2 prompt + 10 generated; budget 5 -> 4 steps (2+1+1+1)
            tap.offer([s])
        assert counter(metrics.CAPTURE_STEPS) - staged0 == 4
        for s in steps_for("c", 10, workload="skip"):
            tap.offer([s])
        assert counter(metrics.CAPTURE_STEPS) - staged0 == 4
        assert "b" not in tap._requests and "c" not in tap._requests  # finished: state released
    finally:
        tap.close(timeout_s=3.0)


def test_offer_swallows_errors():
    tap = CaptureTap(quick(), NO_BROKER)
    try:
        before = counter(metrics.CAPTURE_DROPPED_STEPS, "tap_error")
        tap.offer([object()])  # not a StepCapture: must not raise into the engine
        assert counter(metrics.CAPTURE_DROPPED_STEPS, "tap_error") - before == 1
    finally:
        tap.close(timeout_s=3.0)


def test_close_without_broker_lets_the_worker_count_the_lost_record_and_report_it_to_the_engine():
    tap = CaptureTap(quick(), NO_BROKER)
    before = counter(metrics.CAPTURE_DROPPED_RECORDS, "broker_unavailable")
    for s in steps_for("d", 3):
        tap.offer([s])
    tap.close(timeout_s=3.0)
    # counted in the worker process, reported to this one
    assert counter(metrics.CAPTURE_DROPPED_RECORDS, "broker_unavailable") - before == 1


def test_close_keeps_its_own_limit_when_the_worker_never_answers():
    # the config's limit is 600 s: a close that waited for the worker or took that limit never returns in time
    tap = CaptureTap(quick(flush_timeout_s=600.0), NO_BROKER)
    for s in steps_for("d", 3):
        tap.offer([s])
    pid = tap.worker_pid
    os.kill(pid, signal.SIGSTOP)  # it neither drains nor answers the close
    closing = threading.Thread(target=tap.close, kwargs={"timeout_s": 1.0}, daemon=True)
    closing.start()
    closing.join(RETURN_TIMEOUT_S)
    try:
        assert not closing.is_alive(), "close waited past its 1 s limit"
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # killed and reaped, not left stopped behind
    finally:
        if closing.is_alive():
            os.kill(pid, signal.SIGCONT)


def test_offers_drop_without_blocking_while_a_dead_worker_is_not_replaced():
    # an hour's backoff keeps the worker down for the whole test: an offer that waited for it never returns
    tap = CaptureTap(CaptureConfig(connect_timeout_s=0.2, reconnect_backoff_s=3600.0), NO_BROKER)
    try:
        died0 = counter(metrics.CAPTURE_DROPPED_RECORDS, "worker_died")
        down0 = counter(metrics.CAPTURE_DROPPED_STEPS, "worker_down")
        open_steps = steps_for("g", 50)
        stage_costs_s = offer_each(tap, open_steps[:20])
        os.kill(tap.worker_pid, signal.SIGKILL)
        wait_for(lambda: tap.worker_pid is None, 10, "the dead worker to be let go")
        offer_each(tap, open_steps[20:])  # skipped: the request died with the worker
        drop_costs_s = offer_each(tap, [steps_for(f"g{i}", 1)[0] for i in range(100)])
        assert tap.worker_pid is None  # every offer above ran with no worker
        assert counter(metrics.CAPTURE_DROPPED_RECORDS, "worker_died") - died0 == 1  # request "g"
        assert counter(metrics.CAPTURE_DROPPED_STEPS, "worker_down") - down0 == 100  # each new request's first
        assert_drops_cost_no_more_than_staging(drop_costs_s, stage_costs_s)
    finally:
        tap.close(timeout_s=3.0)


def test_worker_death_is_counted_the_engine_keeps_offering_and_a_new_worker_takes_over():
    tap = CaptureTap(quick(), NO_BROKER)
    try:
        restarts0 = counter(metrics.CAPTURE_WORKER_RESTARTS)
        died0 = counter(metrics.CAPTURE_DROPPED_RECORDS, "worker_died")
        open_steps = steps_for("e", 50)
        for s in open_steps[:5]:
            tap.offer([s])
        first = tap.worker_pid
        os.kill(first, signal.SIGKILL)
        wait_for(lambda: counter(metrics.CAPTURE_WORKER_RESTARTS) - restarts0 == 1, 10, "the restart count")
        offer_each(tap, open_steps[5:])  # the decode loop goes on while the worker is gone or new
        wait_for(lambda: tap.worker_pid not in (None, first), 10, "a new worker")
        assert counter(metrics.CAPTURE_DROPPED_RECORDS, "worker_died") - died0 == 1  # request "e"
        staged0 = counter(metrics.CAPTURE_STEPS)
        for s in steps_for("f", 3):  # a new request goes to the new worker
            tap.offer([s])
        assert counter(metrics.CAPTURE_STEPS) - staged0 == 4
        before = counter(metrics.CAPTURE_DROPPED_RECORDS, "broker_unavailable")
    finally:
        tap.close(timeout_s=3.0)
    assert counter(metrics.CAPTURE_DROPPED_RECORDS, "broker_unavailable") - before == 1  # "f" reached it


def test_unknown_storage_dtype_is_refused():
    with pytest.raises(ValueError):
        CaptureTap(CaptureConfig(hidden_dtype="float16"), NO_BROKER)


def test_the_worker_process_never_imports_torch():
    import subprocess
    import sys
    code = "import sys, tide.capture.worker; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
