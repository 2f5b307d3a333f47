"""Two ingest replicas that start together form one group in one join: every partition assigned,
none twice, both consuming, and no rebalance once formed (checked over three fresh groups).

kafka-python 3.0.12 drops a JoinGroup answer that arrives between two polls and joins again: a new
rebalance of the whole group, and another ~3 s hold at the broker. The broker holds a join for a
whole number of 0.5 s polls, so a loop doing work between polls can meet the answer there every
time (the ingest bench's group probe did); the ingest loop's poll waits out a join
(``ingest.join_poll_timeout_s``)."""
from __future__ import annotations

import threading
import time

import numpy as np
from kafka import KafkaProducer

from tide.config import IngestConfig, KafkaConfig
from tide.dataset.ingest import Ingestor
from tide.dataset.topics import ensure_topics
from tide.records import Record, encode

H = 64
PARTITIONS = 4
BUSY_BETWEEN_POLLS_S = 0.02  # a loaded replica's work between polls
RECORDS = 64


def _value(i: int) -> bytes:
    rng = np.random.default_rng(i)
    t = 8
    return encode(Record(request_id=f"r{i}", target_model_id="org/target", drafter_version="v1",
                         aux_layer_ids=(1, 2, 3), workload="chat", started_at_s=1.7e9, finished_at_s=1.7e9 + 1,
                         hidden_size=H, hidden_dtype="bfloat16", token_ids=rng.integers(0, 1000, t).astype(np.int32),
                         loss_mask=np.ones(t, np.uint8), aux_hidden=rng.bytes(t * 3 * H * 2),
                         final_hidden=rng.bytes(t * H * 2)))


def _form_group(config: IngestConfig, kafka: KafkaConfig, table) -> dict:
    """Two busy replicas of ``config.group_id`` until both hold partitions and every record is handled."""
    stop = threading.Event()
    held: dict[int, set] = {0: set(), 1: set()}
    first_held_s: dict[int, float] = {}
    lost = {0: False, 1: False}  # held partitions, then none: the group rebalanced after forming
    handled = [0, 0]
    t0 = time.monotonic()

    def replica(k: int) -> None:
        ingestor = Ingestor(config, kafka, table)
        ingestor.open()
        try:
            while not stop.is_set():
                handled[k] += ingestor.poll_once()
                now = {tp.partition for tp in ingestor.positions()}
                lost[k] |= bool(held[k]) and not now
                held[k] = now
                if now and k not in first_held_s:
                    first_held_s[k] = time.monotonic() - t0
                stop.wait(BUSY_BETWEEN_POLLS_S)
        finally:
            ingestor.close(flush=True)

    threads = [threading.Thread(target=replica, args=(k,), daemon=True) for k in (0, 1)]
    [t.start() for t in threads]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not (held[0] and held[1] and sum(handled) >= RECORDS):
        time.sleep(0.2)
    stop.set()
    [t.join(60) for t in threads]
    return {"held": held, "first_held_s": first_held_s, "lost": lost, "handled": handled}


def test_two_busy_replicas_form_one_group_in_one_join(memory_broker, topic_name, tmp_path):
    bs = memory_broker.bootstrap_servers
    kafka = KafkaConfig(bootstrap_servers=bs, topic=topic_name, dead_letter_topic=topic_name + ".dead")
    ensure_topics(IngestConfig(topic_partitions=PARTITIONS), kafka)
    producer = KafkaProducer(bootstrap_servers=bs)
    for i in range(RECORDS):
        producer.send(topic_name, key=f"r{i}".encode(), value=_value(i))
    producer.flush(30)
    producer.close()
    for trial in range(3):  # a dropped join is a race: each trial is a fresh group over the same topic
        config = IngestConfig(group_id=f"{topic_name}.group-{trial}", topic_partitions=PARTITIONS,
                              roll_interval_s=0.5, metrics_port=0)
        g = _form_group(config, kafka, tmp_path / f"table-{trial}")
        held = g["held"]
        assert held[0] and held[1], f"a replica held no partition after 30 s: {g}"
        assert held[0] | held[1] == set(range(PARTITIONS)) and not held[0] & held[1], g
        # one join (the broker holds it ~3 s) and no rebalance after it: a dropped join costs another
        # hold and takes the other replica's partitions away while the group forms again
        assert max(g["first_held_s"].values()) < 9.0 and not any(g["lost"].values()), g
        assert sum(g["handled"]) >= RECORDS, g
