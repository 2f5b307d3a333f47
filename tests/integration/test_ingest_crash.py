"""Two ingest processes in one consumer group on a 4-partition topic, SIGKILLed five times at random
points (at least once between the table commit and the Kafka offset commit), on a local
directory and on SeaweedFS's S3: afterwards every acknowledged record is in the Delta table
exactly once, its bytes intact."""
from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition

from tide.config import IngestConfig, KafkaConfig
from tide.dataset.location import Location
from tide.dataset.partitions import FAULT_DIR_ENV
from tide.dataset.table import DatasetTable
from tide.dataset.topics import ensure_topics
from tide.records import Record, encode, split

KILLS = 5
PARTITIONS = 4
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


def _digest(aux: bytes, final: bytes) -> str:
    return hashlib.blake2b(aux + final, digest_size=16).hexdigest()


class Traffic(threading.Thread):
    """Produces chunked records at a steady rate until stopped; remembers what the broker acked
    (request id, chunk index) -> digest of the chunk's hidden states."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__(daemon=True)
        self.producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5,
                                      compression_type="zstd")
        self.topic = topic
        self.stop = threading.Event()
        self.acked: dict[tuple[str, int], str] = {}
        self.failed = 0

    def run(self) -> None:
        rng = np.random.default_rng(3)
        i = 0
        while not self.stop.is_set():
            rec = _record(i, rng)
            for chunk in split(rec, 40_000):
                key = (rec.request_id, chunk.chunk_index)
                digest = _digest(chunk.aux_hidden, chunk.final_hidden)
                future = self.producer.send(self.topic, key=rec.request_id.encode(), value=encode(chunk))
                future.add_callback(lambda _, k=key, d=digest: self.acked.__setitem__(k, d))
                future.add_errback(lambda _: setattr(self, "failed", self.failed + 1))
            i += 1
            time.sleep(0.05)
        self.producer.flush(30)
        self.producer.close()


def _committed_all(bootstrap: str, group: str, topic: str) -> bool:
    # a consumer that never subscribes reads the group's offsets without joining it
    consumer = KafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        ends = consumer.end_offsets(tps)  # the memory engine reports these correctly
        return all((consumer.committed(tp) or 0) >= ends[tp] for tp in tps)
    finally:
        consumer.close(autocommit=False)


class Replica:
    """One ingest service process with its own fault folder (tide/dataset/partitions.py FAULT_DIR_ENV)."""

    def __init__(self, name: str, env: dict, tmp_path: Path) -> None:
        self.fault_dir = tmp_path / f"fault-{name}"
        self.fault_dir.mkdir()
        self.env = {**env, FAULT_DIR_ENV: str(self.fault_dir)}
        self.log = tmp_path / f"ingest-{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tide.services.ingest", "--log-level", "INFO"],
                                     env=self.env, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def pause_after_table_commit(self, on: bool) -> None:
        flag = self.fault_dir / "pause-after-table-commit"
        flag.touch() if on else flag.unlink(missing_ok=True)

    def paused(self) -> bool:
        return (self.fault_dir / f"paused-{self.proc.pid}").exists()


@pytest.mark.parametrize("store", ["local", "s3"])
def test_two_replicas_sigkilled_five_times_store_every_acked_record_exactly_once(
        store, memory_broker, topic_name, tmp_path, wait, request):
    bs = memory_broker.bootstrap_servers
    group = topic_name + ".ingest"
    if store == "s3":
        s3 = request.getfixturevalue("s3_store")
        uri, store_env = s3.uri(topic_name), s3.env
    else:
        uri, store_env = str(tmp_path / "data"), {}
    table = DatasetTable(Location.from_uri(uri, store_env))
    ensure_topics(IngestConfig(topic_partitions=PARTITIONS),
                  KafkaConfig(bootstrap_servers=bs, topic=topic_name, dead_letter_topic=topic_name + ".dl"))
    env = {**os.environ, **store_env, "TIDE_HOME": str(tmp_path / "home"),
           "TIDE_KAFKA__BOOTSTRAP_SERVERS": bs, "TIDE_KAFKA__TOPIC": topic_name,
           "TIDE_KAFKA__DEAD_LETTER_TOPIC": topic_name + ".dl", "TIDE_INGEST__GROUP_ID": group,
           "TIDE_INGEST__TOPIC_PARTITIONS": str(PARTITIONS), "TIDE_INGEST__DATA_DIR": uri,
           # small batches and frequent commits: kills land before, inside and after commits
           "TIDE_INGEST__FILE_MAX_ROWS": "6", "TIDE_INGEST__ROW_GROUP_ROWS": "2",
           "TIDE_INGEST__ROLL_INTERVAL_S": "0.5", "TIDE_INGEST__SESSION_TIMEOUT_MS": "3000",
           "TIDE_INGEST__HEARTBEAT_INTERVAL_MS": "1000", "TIDE_INGEST__METRICS_PORT": "0"}
    replicas = [Replica("a", env, tmp_path), Replica("b", env, tmp_path)]
    traffic = Traffic(bs, topic_name)
    rng = random.Random(11)
    between_commits = 0
    try:
        for r in replicas:
            r.start()
        traffic.start()
        wait(lambda: table.exists() and (table.version() or 0) > 0, 120, interval_s=0.1, what="a first commit")
        for k in range(KILLS):
            victim = replicas[rng.randrange(2)]
            if k in (1, 3):  # between its table commit and its offset commit
                victim.pause_after_table_commit(True)
                wait(victim.paused, 120, interval_s=0.05, what="a replica paused after its table commit")
                victim.kill()
                victim.pause_after_table_commit(False)
                between_commits += 1
            else:  # anywhere, once the table has moved since the last kill
                seen = table.version()
                wait(lambda: table.version() > seen, 120, interval_s=0.05, what="ingest progress")
                time.sleep(rng.uniform(0.0, 1.0))  # a random point: the kill's position, not a wait
                victim.kill()
            victim.start()
        traffic.stop.set()
        traffic.join(timeout=60)
        assert traffic.failed == 0
        wait(lambda: _committed_all(bs, group, topic_name), 180, interval_s=1.0,
             what="the replicas to commit everything")
        for r in replicas:
            r.proc.send_signal(signal.SIGTERM)
        for r in replicas:
            assert r.proc.wait(timeout=60) == 0
    finally:
        traffic.stop.set()
        for r in replicas:
            if r.proc is not None and r.proc.poll() is None:
                r.proc.kill()
                r.proc.wait()

    stored = [table.open_file(f.path).read(columns=["kafka_partition", "kafka_offset", "request_id", "chunk_index",
                                                    "aux_hidden", "final_hidden"])
              for f in table.data_files()]
    rows = [row for t in stored for row in t.to_pylist()]
    offsets = Counter((r["kafka_partition"], r["kafka_offset"]) for r in rows)
    chunks = Counter((r["request_id"], r["chunk_index"]) for r in rows)
    assert max(offsets.values()) == 1 and max(chunks.values()) == 1  # nothing twice
    assert set(chunks) == set(traffic.acked) and len(rows) == len(traffic.acked)  # nothing lost
    assert {(r["request_id"], r["chunk_index"]): _digest(r["aux_hidden"], r["final_hidden"])
            for r in rows} == traffic.acked  # the bytes as produced
    for p in range(PARTITIONS):
        got = sorted(o for (q, o) in offsets if q == p)
        assert got == list(range(len(got)))  # contiguous from 0: nothing skipped
    logs = "".join(r.log.read_text() for r in replicas)
    assert between_commits == 2 and logs.count("already in the table") >= 1  # a restart skipped its commit
    print(f"{store}: {len(rows)} chunks, {table.version()} versions, {KILLS} kills "
          f"({between_commits} between the table and the offset commit)")
