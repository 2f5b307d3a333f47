"""Ingest with its bulk socket reads against a real broker: fetch responses of several hundred kB
arrive in reads far smaller than a record and far larger, and the table holds every record's
bytes exactly as produced."""
from __future__ import annotations

import sys

import numpy as np
import pytest
from kafka import KafkaProducer

from tide.config import IngestConfig, KafkaConfig
from tide.dataset import DatasetTable, bulk
from tide.dataset.topics import ensure_topics
from tide.records import Record, encode

H = 64


def _record(i: int) -> Record:
    rng = np.random.default_rng(i)
    t = 900 + 97 * i  # ~0.4-0.6 MB values: one fetch response spans many reads of either size
    return Record(request_id=f"bulk-{i}", target_model_id="org/target", drafter_version="v1",
                  aux_layer_ids=(1, 2, 3), workload="code", started_at_s=1.7e9, finished_at_s=1.7e9 + 1,
                  hidden_size=H, hidden_dtype="bfloat16", token_ids=rng.integers(0, 1000, t).astype(np.int32),
                  loss_mask=(np.arange(t) > 2).astype(np.uint8),
                  aux_hidden=rng.bytes(t * 3 * H * 2), final_hidden=rng.bytes(t * H * 2))


@pytest.mark.parametrize("read_bytes", [1000, 1 << 20], ids=["reads-of-1000-bytes", "reads-of-1-MiB"])
def test_ingest_stores_every_byte_through_its_socket_reads(memory_broker, topic_name, tmp_path, capture_kit,
                                                           wait, read_bytes):
    bs = memory_broker.bootstrap_servers
    config = IngestConfig(group_id=topic_name + ".g", topic_partitions=2, roll_interval_s=0.5, metrics_port=0,
                          socket_read_bytes=read_bytes, malloc_mmap_threshold_bytes=0)  # the allocator is global
    kafka = KafkaConfig(bootstrap_servers=bs, topic=topic_name, dead_letter_topic=topic_name + ".dead")
    ensure_topics(config, kafka)
    records = {r.request_id: r for r in map(_record, range(6))}
    producer = KafkaProducer(bootstrap_servers=bs, acks="all", compression_type="zstd", max_request_size=2 << 20)
    for rid, rec in records.items():
        producer.send(topic_name, key=rid.encode(), value=encode(rec))
    producer.flush()
    producer.close()

    switch_s = sys.getswitchinterval()
    try:
        assert bulk.tune_process(config) == {"heap_buffers": False, "socket_reads": True}
        data_dir = tmp_path / "data"
        with capture_kit.IngestThread(config, kafka, data_dir):
            wait(lambda: capture_kit.caught_up(kafka, config.group_id), 60, what="ingest caught up")
    finally:
        bulk.restore_socket_reads()
        sys.setswitchinterval(switch_s)

    table = DatasetTable(data_dir)
    stored = {}
    for f in table.data_files():
        cols = table.open_file(f.path).read(columns=["request_id", "aux_hidden", "final_hidden"]).to_pydict()
        for rid, aux, final in zip(cols["request_id"], cols["aux_hidden"], cols["final_hidden"]):
            assert rid not in stored, f"{rid} stored twice"
            stored[rid] = (aux, final)
    assert sorted(stored) == sorted(records)
    for rid, rec in records.items():
        assert stored[rid] == (rec.aux_hidden, rec.final_hidden), rid
