"""Fixtures that start real brokers (tansu; durable = tansu on SeaweedFS S3) on free loopback ports,
and the drafter-operations stack's (ops_stack.py: ``tiny``, ``store``, ``make_stack``).

The broker code is tide/broker.py (stdlib only), so `tide up`, the demo and the tests start brokers
the same way. Every process started here is stopped at teardown.
"""
from __future__ import annotations

import shutil
import signal
import uuid
from pathlib import Path

import pytest
import torch

from tide import broker as broker_scripts

torch.set_num_threads(1)


def _start(mode: str, state_dir: Path):
    try:
        broker_scripts.find_tansu()
        if mode == "durable":
            broker_scripts.find_weed()
    except broker_scripts.BrokerError as exc:
        pytest.skip(str(exc))
    stack = broker_scripts.BrokerStack(mode, broker_scripts.free_port(), state_dir)
    try:
        stack.start()
    except Exception:
        stack.stop()
        raise
    return stack


@pytest.fixture(scope="session")
def memory_broker(tmp_path_factory):
    """One in-memory tansu for the session; tests isolate themselves with unique topic names."""
    stack = _start("memory", tmp_path_factory.mktemp("broker-memory"))
    yield stack
    stack.stop()


@pytest.fixture
def durable_broker(tmp_path):
    """tansu on a fresh SeaweedFS store; the test may stop and restart tansu (stack.start_tansu)."""
    stack = _start("durable", tmp_path / "broker-durable")
    yield stack
    stack.stop_tansu(signal.SIGKILL)
    if stack.weed is not None and stack.weed.poll() is None:
        stack.weed.kill()  # a graceful weed stop takes ~15 s; the store is thrown away anyway
        stack.weed.wait(timeout=10)
    shutil.rmtree(tmp_path / "broker-durable", ignore_errors=True)


@pytest.fixture
def s3_store(tmp_path):
    """SeaweedFS's S3 alone with the dataset's bucket; ``.uri(name)`` is a table URI on it and
    ``.env`` the AWS_* variables a process needs to reach it (options and keys)."""
    try:
        broker_scripts.find_weed()
    except broker_scripts.BrokerError as exc:
        pytest.skip(str(exc))
    stack = broker_scripts.BrokerStack("store", broker_scripts.free_port(), tmp_path / "s3-store",
                                       buckets=(broker_scripts.DATASET_BUCKET,))
    try:
        stack.start()
    except Exception:
        stack.stop()
        raise
    stack.options = broker_scripts.local_s3_options(stack.s3_port)
    stack.env = {**stack.options, **broker_scripts.LOCAL_S3_KEYS}
    stack.uri = lambda name: f"s3://{broker_scripts.DATASET_BUCKET}/{name}"
    yield stack
    if stack.weed is not None and stack.weed.poll() is None:
        stack.weed.kill()  # its data is thrown away
        stack.weed.wait(timeout=10)
    shutil.rmtree(tmp_path / "s3-store", ignore_errors=True)


@pytest.fixture
def free_port():
    """A function returning a free loopback port."""
    return broker_scripts.free_port


@pytest.fixture
def topic_name():
    return f"tide.test.{uuid.uuid4().hex[:10]}"


# --- capture/ingest helpers (used through the fixtures below) --------------------------------------

def request_steps(rid: str, prompt_len: int, decode_steps: int, hidden: int, workload=None,
                  seed: int = 0, model: str = "org/target"):
    """Step captures like an engine emits them: prefill, 1-3 positions per decode step, then an
    empty finished marker. Random float32 tensors (bf16 rounding happens in capture)."""
    import time as _time

    from tide.engine.base import CaptureMeta, StepCapture

    gen = torch.Generator().manual_seed(seed)
    meta = CaptureMeta(rid, model, "drafter-v1", (1, 2, 3), workload, prompt_len, _time.time())
    steps = [StepCapture(meta, 0, torch.randint(0, 1000, (prompt_len,), generator=gen),
                         torch.randn(prompt_len, 3 * hidden, generator=gen),
                         torch.randn(prompt_len, hidden, generator=gen), True)]
    pos = prompt_len
    for i in range(decode_steps):
        n = 1 + int(torch.randint(0, 3, (1,), generator=gen))
        steps.append(StepCapture(meta, pos, torch.randint(0, 1000, (n,), generator=gen),
                                 torch.randn(n, 3 * hidden, generator=gen),
                                 torch.randn(n, hidden, generator=gen), False))
        pos += n
    steps.append(StepCapture(meta, pos, torch.empty(0, dtype=torch.long),
                             torch.empty(0, 3 * hidden), torch.empty(0, hidden), False, True))
    return steps


class IngestThread:
    """An Ingestor running in a background thread (same code path as the service)."""

    def __init__(self, config, kafka, data_dir):
        import threading

        from tide.dataset.ingest import Ingestor

        self.ingestor = Ingestor(config, kafka, data_dir)
        self.stop = threading.Event()
        self.error = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        try:
            self.ingestor.run(self.stop)
        except BaseException as exc:  # surfaced by close()
            self.error = exc

    def __enter__(self):
        self.ingestor.open()
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.stop.set()
        self.thread.join(timeout=60)
        self.ingestor.close()
        if self.error is not None:
            raise self.error


def ingest_caught_up(kafka, group_id: str) -> bool:
    """True once ingest has committed every message on ``kafka.topic`` (offsets are committed
    only after the Parquet holding them is durable): then nothing more can appear in the dataset.
    The probe never subscribes, so it does not join (or rebalance) ingest's consumer group."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers, group_id=group_id,
                             enable_auto_commit=False)
    try:
        parts = [TopicPartition(kafka.topic, p) for p in sorted(consumer.partitions_for_topic(kafka.topic) or ())]
        ends = consumer.end_offsets(parts)
        return bool(parts) and all((consumer.committed(tp) or 0) >= ends[tp] for tp in parts)
    finally:
        consumer.close(autocommit=False)


@pytest.fixture
def capture_kit():
    class Kit:
        pass

    kit = Kit()
    kit.request_steps = request_steps
    kit.IngestThread = IngestThread
    kit.caught_up = ingest_caught_up
    return kit


def wait_for(predicate, timeout_s: float, interval_s: float = 0.2, what: str = "condition"):
    import time as _time

    deadline = _time.monotonic() + timeout_s
    while _time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        _time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


@pytest.fixture
def wait():
    return wait_for


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """The ops tests' tiny target and trained drafter (ops_stack.build_tiny); a module may define its own."""
    from ops_stack import build_tiny

    return build_tiny(tmp_path_factory.mktemp("ops-tiny"))


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from ops_stack import store_at

    return store_at(tmp_path_factory.mktemp("ops-mlflow"))


@pytest.fixture
def make_stack(tiny, store, tmp_path):
    from ops_stack import stacks_of

    yield from stacks_of(tiny, store, tmp_path)
