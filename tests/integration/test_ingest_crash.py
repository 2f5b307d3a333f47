"""Ingest service SIGKILLed at random points: no partial files, no duplicate and no missing rows."""
from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from tide.config import IngestConfig, KafkaConfig
from tide.dataset.ingest import ensure_topics
from tide.dataset.schema import list_files
from tide.records import Record, encode, split

KILLS = 5
H = 64


def _record(i: int, rng: np.random.Generator) -> Record:
    t = int(rng.integers(4, 160))
    return Record(
        request_id=f"req-{i}", target_model_id="org/target", drafter_version="v1",
        aux_layer_ids=(1, 2, 3), workload=None, started_at_s=time.time() - 1,
        finished_at_s=time.time(), hidden_size=H, hidden_dtype="bfloat16",
        token_ids=rng.integers(0, 1000, t).astype(np.int32),
        loss_mask=(np.arange(t) > 3).astype(np.uint8),
        aux_hidden=rng.bytes(t * 3 * H * 2), final_hidden=rng.bytes(t * H * 2))


class Traffic(threading.Thread):
    """Produces chunked records at a steady rate until stopped; remembers what was acked."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                                      compression_type="zstd")
        self.topic = topic
        self.stop = threading.Event()
        self.sent: list[tuple[str, int]] = []  # (request id, chunk index)

    def run(self) -> None:
        rng = np.random.default_rng(3)
        i = 0
        while not self.stop.is_set():
            rec = _record(i, rng)
            for chunk in split(rec, 40_000):
                self.producer.send(self.topic, key=rec.request_id.encode(), value=encode(chunk))
                self.sent.append((rec.request_id, chunk.chunk_index))
            i += 1
            time.sleep(0.05)
        self.producer.flush(30)
        self.producer.close()


def _start_service(env: dict, log_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tide.services.ingest", "--log-level", "INFO"], env=env,
                            stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)


def _committed_all(bootstrap: str, group: str, topic: str, partitions: int) -> bool:
    # a consumer that never subscribes reads the group's offsets without joining it
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(partitions)]
        ends = consumer.end_offsets(tps)  # the memory engine reports these correctly
        return all((consumer.committed(tp) or 0) >= ends[tp] for tp in tps)
    finally:
        consumer.close(autocommit=False)


def _visible_files_are_complete(data_dir: Path) -> int:
    for path in list_files(data_dir):
        meta = pq.ParquetFile(path).metadata  # a partial file has no footer and fails here
        assert meta.num_rows > 0
    return len(list_files(data_dir))


def test_sigkill_five_times_no_partial_files_no_duplicates_no_loss(memory_broker, topic_name,
                                                                   tmp_path, wait, free_port):
    bs = memory_broker.bootstrap_servers
    partitions = 3
    group = topic_name + ".ingest"
    data_dir = tmp_path / "data"
    ensure_topics(IngestConfig(topic_partitions=partitions),
                  KafkaConfig(bootstrap_servers=bs, topic=topic_name, dead_letter_topic=topic_name + ".dl"))
    env = {**os.environ, "TIDE_HOME": str(tmp_path / "home"),
           "TIDE_KAFKA__BOOTSTRAP_SERVERS": bs, "TIDE_KAFKA__TOPIC": topic_name,
           "TIDE_KAFKA__DEAD_LETTER_TOPIC": topic_name + ".dl", "TIDE_INGEST__GROUP_ID": group,
           "TIDE_INGEST__TOPIC_PARTITIONS": str(partitions), "TIDE_INGEST__DATA_DIR": str(data_dir),
           # small files and frequent commits: kills land before, inside and after flushes
           "TIDE_INGEST__FILE_MAX_ROWS": "6", "TIDE_INGEST__ROW_GROUP_ROWS": "2",
           "TIDE_INGEST__ROLL_INTERVAL_S": "0.5", "TIDE_INGEST__SESSION_TIMEOUT_MS": "3000",
           "TIDE_INGEST__HEARTBEAT_INTERVAL_MS": "1000", "TIDE_INGEST__METRICS_PORT": "0"}
    log_path = tmp_path / "ingest.log"
    traffic = Traffic(bs, topic_name)
    traffic.start()
    rng = random.Random(11)
    kills_with_temporaries = 0
    files_before = 0
    proc = None
    try:
        for _ in range(KILLS):
            proc = _start_service(env, log_path)
            # kill only once this run has made progress of its own
            wait(lambda: len(list_files(data_dir)) > files_before, 60, interval_s=0.05,
                 what="ingest to write a file")
            time.sleep(rng.uniform(0.0, 1.5))
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=10)
            kills_with_temporaries += any(data_dir.glob("target_model=*/date=*/hour=*/.*.tmp"))
            files_before = _visible_files_are_complete(data_dir)
        traffic.stop.set()
        traffic.join(timeout=60)
        metrics_port = free_port()
        proc = _start_service({**env, "TIDE_INGEST__METRICS_PORT": str(metrics_port)}, log_path)
        wait(lambda: _committed_all(bs, group, topic_name, partitions), 120, interval_s=1.0,
             what="the final run to commit everything")
        exposition = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics",
                                            timeout=5).read().decode()
        assert 'tide_ingest_commits_total{outcome="ok"}' in exposition
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health", timeout=5).read())
        assert health["status"] == "ok" and health["state"] == "consuming", health
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        traffic.stop.set()
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    assert not list(data_dir.glob("target_model=*/date=*/hour=*/.*.tmp"))
    _visible_files_are_complete(data_dir)
    rows = [pq.read_table(p, columns=["kafka_partition", "kafka_offset", "request_id",
                                      "chunk_index"]) for p in list_files(data_dir)]
    offsets = Counter((p, o) for t in rows for p, o in zip(t.column("kafka_partition").to_pylist(),
                                                           t.column("kafka_offset").to_pylist()))
    chunks = Counter((r, c) for t in rows for r, c in zip(t.column("request_id").to_pylist(),
                                                          t.column("chunk_index").to_pylist()))
    duplicates = sum(n - 1 for n in offsets.values() if n > 1)
    assert duplicates == 0
    assert set(chunks) == set(traffic.sent) and sum(chunks.values()) == len(traffic.sent)
    for p in range(partitions):
        got = sorted(o for (q, o) in offsets if q == p)
        assert got == list(range(len(got)))  # contiguous from 0: nothing missing
    log_text = log_path.read_text()
    print(f"{len(traffic.sent)} messages, {len(list_files(data_dir))} files, {KILLS} kills, "
          f"{kills_with_temporaries} with a half-written file, "
          f"{log_text.count('already on disk')} resumes skipped offsets already on disk")
