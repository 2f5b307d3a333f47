"""Ingest's write backoff: the wait doubles per failed retry up to its cap, failures within one
wait do not lengthen it, a success ends it; a full disk (real ENOSPC and SQLITE_FULL from a
small tmpfs) is told apart from other write errors."""
import errno
import os

from prometheus_client import REGISTRY

from tide.dataset.backoff import DISK_FULL, WRITE_ERROR, WriteBackoff, failure_reason


def _gauge(reason: str) -> float:
    return REGISTRY.get_sample_value("tide_ingest_write_blocked", {"reason": reason})


def _backoff_s() -> float:
    return REGISTRY.get_sample_value("tide_ingest_write_backoff_seconds")


def test_wait_doubles_per_failed_retry_up_to_the_cap_and_resets_on_success():
    b = WriteBackoff(initial_s=1.0, max_s=5.0)
    full = OSError(errno.ENOSPC, "No space left on device")
    delays = []
    now = 100.0
    for _ in range(5):
        b.failed(full, now)
        b.failed(full, now + 0.1)  # another partition's seal failing within the same wait
        delays.append(b.delay_s)
        assert not b.due(now + b.delay_s - 0.01) and b.due(now + b.delay_s)
        now += b.delay_s
        b.retrying()
    assert delays == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.failing and b.reason == DISK_FULL and _gauge(DISK_FULL) == 1 and _gauge(WRITE_ERROR) == 0
    assert _backoff_s() == 5.0
    b.succeeded()
    assert not b.failing and _gauge(DISK_FULL) == 0
    assert _backoff_s() == 0
    b.failed(RuntimeError("broker"), now)
    assert b.delay_s == 1.0 and b.reason == WRITE_ERROR and _gauge(WRITE_ERROR) == 1
    details = b.details(now + 0.25)
    assert details == {"state": WRITE_ERROR, "write_failures": 1, "backoff_s": 1.0, "retry_in_s": 0.8}


def test_a_success_reported_during_the_wait_does_not_end_it():
    b = WriteBackoff(initial_s=1.0, max_s=8.0)
    b.failed(OSError(errno.EIO, "I/O error"), 0.0)
    b.succeeded()  # a seal queued before the failure: the wait still runs
    assert b.failing and b.blocked


def test_a_real_full_disk_is_disk_full_through_any_wrapping(small_filesystem):
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs = small_filesystem(1 << 20)
    fs.fill()
    errors = []
    try:  # a data file written through pyarrow, as ingest writes one
        pq.write_table(pa.table({"x": [b"x" * 200_000]}), str(fs.path / "part.parquet"))
    except OSError as exc:
        errors.append(exc)
    fd = os.open(fs.path / "more", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(fd, b"y" * 8192)
    except OSError as exc:
        errors.append(exc)
        try:
            raise RuntimeError("writing a row failed") from exc
        except RuntimeError as wrapped:
            errors.append(wrapped)
    finally:
        os.close(fd)
    assert [failure_reason(e) for e in errors] == [DISK_FULL] * 3
    assert failure_reason(OSError(errno.EIO, "I/O error")) == WRITE_ERROR
    assert failure_reason(RuntimeError("object store unreachable")) == WRITE_ERROR
