"""A full disk under ingest (a real tmpfs, a real broker): ingest stops consuming, backs off
exponentially, says ``disk_full`` on /health (503) and in ``tide_ingest_write_blocked``, commits
nothing it has not written, leaves no uncommitted data file behind, and once space returns resumes
and writes every produced record to the table exactly once."""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import Counter

import numpy as np
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from tide.config import IngestConfig, KafkaConfig
from tide.dataset.table import DatasetTable
from tide.dataset.topics import ensure_topics
from tide.health_server import HealthServer
from tide.records import Record, encode

H = 64
PARTITIONS = 2


def _record(i: int) -> Record:
    rng = np.random.default_rng(i)
    t = 24
    now = time.time()
    return Record(request_id=f"req-{i}", target_model_id="org/target", drafter_version="v1",
                  aux_layer_ids=(1, 2, 3), workload=None, started_at_s=now - 1, finished_at_s=now,
                  hidden_size=H, hidden_dtype="bfloat16",
                  token_ids=rng.integers(0, 1000, t).astype(np.int32),
                  loss_mask=(np.arange(t) > 3).astype(np.uint8),
                  aux_hidden=rng.bytes(t * 3 * H * 2), final_hidden=rng.bytes(t * H * 2))


def _produce(bs: str, topic: str, ids: range) -> None:
    producer = KafkaProducer(bootstrap_servers=bs, acks="all")
    for i in ids:
        producer.send(topic, key=f"req-{i}".encode(), value=encode(_record(i)))
    producer.flush()
    producer.close()


def _stored(data_dir) -> list[tuple[int, int, str]]:
    """(partition, offset, request id) of every stored row."""
    rows = []
    table = DatasetTable(data_dir)
    for f in table.data_files() if table.exists() else []:
        data = table.open_file(f.path).read(columns=["kafka_partition", "kafka_offset", "request_id"])
        rows += zip(*(data.column(i).to_pylist() for i in range(3)))
    return rows


def _uncommitted(data_dir) -> set[str]:
    """Data files on disk that the table log does not name (user data nobody will commit)."""
    on_disk = {str(p.relative_to(data_dir)) for p in data_dir.glob("date=*/hour=*/*.parquet")}
    return on_disk - {f.path for f in DatasetTable(data_dir).data_files()}


def _committed(consumer: KafkaConsumer, topic: str) -> dict[int, int]:
    return {p: consumer.committed(TopicPartition(topic, p)) or 0 for p in range(PARTITIONS)}


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _blocked_gauge(port: int) -> float:
    text = _get(f"http://127.0.0.1:{port}/metrics")[1]
    line = next(x for x in text.splitlines() if x.startswith('tide_ingest_write_blocked{reason="disk_full"}'))
    return float(line.split()[-1])


def test_full_disk_blocks_reports_and_resumes_without_loss(memory_broker, topic_name, small_filesystem,
                                                           capture_kit, wait):
    bs = memory_broker.bootstrap_servers
    fs = small_filesystem(16 << 20)
    data_dir = fs.path / "dataset"
    config = IngestConfig(group_id=topic_name + ".g", topic_partitions=PARTITIONS, roll_interval_s=0.3,
                          file_max_rows=4, poll_timeout_s=0.2, metrics_port=0,
                          write_backoff_initial_s=0.2, write_backoff_max_s=1.6)
    kafka = KafkaConfig(bootstrap_servers=bs, topic=topic_name, dead_letter_topic=topic_name + ".dl")
    ensure_topics(config, kafka)
    watcher = KafkaConsumer(bootstrap_servers=bs, group_id=config.group_id, enable_auto_commit=False)
    first, second = range(0, 12), range(12, 40)
    with capture_kit.IngestThread(config, kafka, data_dir) as ingest:
        http = HealthServer("127.0.0.1", 0, ingest.ingestor.health).start()
        try:
            _produce(bs, topic_name, first)
            wait(lambda: len(_stored(data_dir)) == len(first)
                 and sum(_committed(watcher, topic_name).values()) == len(first), 30, what="first records")
            assert _get(f"http://127.0.0.1:{http.port}/health")[0] == 200

            fs.fill()
            _produce(bs, topic_name, second)
            seen_backoffs = set()

            def health_when_backoff_capped():
                code, body = _get(f"http://127.0.0.1:{http.port}/health")
                details = json.loads(body)
                if code == 503 and details["state"] == "disk_full":
                    seen_backoffs.add(details["backoff_s"])
                    if details["backoff_s"] == config.write_backoff_max_s and details["retry_in_s"] > 0:
                        return details
                return None

            details = wait(health_when_backoff_capped, 60, interval_s=0.05, what="disk_full at the capped backoff")
            assert {0.2, 0.4, 0.8, 1.6} <= seen_backoffs  # doubling per failed retry
            assert details["write_failures"] >= 4 and details["paused_partitions"] == PARTITIONS
            assert _blocked_gauge(http.port) == 1.0
            # nothing committed that is not on disk, and no temporaries left holding data
            stored = _stored(data_dir)
            committed = _committed(watcher, topic_name)
            for p in range(PARTITIONS):
                on_disk = sorted(o for q, o, _ in stored if q == p)
                assert on_disk == list(range(len(on_disk))) and committed[p] <= len(on_disk), (p, committed)
            wait(lambda: not _uncommitted(data_dir), 10, what="uncommitted files removed")

            fs.free()
            wait(lambda: _get(f"http://127.0.0.1:{http.port}/health")[0] == 200, 30, what="healthy again")
            total = len(first) + len(second)
            wait(lambda: sum(_committed(watcher, topic_name).values()) == total, 30, what="all committed")
            assert _blocked_gauge(http.port) == 0.0
        finally:
            http.close()
    watcher.close(autocommit=False)
    stored = _stored(data_dir)
    assert max(Counter((p, o) for p, o, _ in stored).values()) == 1  # no duplicate
    assert sorted(rid for _, _, rid in stored) == sorted(f"req-{i}" for i in range(total))
    for p in range(PARTITIONS):
        offsets = sorted(o for q, o, _ in stored if q == p)
        assert offsets == list(range(len(offsets)))  # contiguous: nothing skipped
