"""Ingest semantics against a real broker: bad messages go to the dead-letter topic with their
reason and ingest goes on; replays of offsets already in the table (a crash between the table
commit and the Kafka commit) write nothing twice; a recreated topic reusing offsets is not
mistaken for a replay; a deleted request is not written back by a replay or a new group."""
from __future__ import annotations

import json
import struct
import time

import numpy as np
import pytest
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from kafka.structs import OffsetAndMetadata

from tide.config import IngestConfig, KafkaConfig
from tide.dataset import DatasetReader, DatasetTable
from tide.dataset.topics import ensure_topics
from tide.records import Record, encode

H = 64


def _record(rid: str, t: int, seed: int) -> Record:
    rng = np.random.default_rng(seed)
    return Record(request_id=rid, target_model_id="org/target", drafter_version="v1",
                  aux_layer_ids=(1, 2, 3), workload="chat", started_at_s=1.7e9, finished_at_s=1.7e9 + 1,
                  hidden_size=H, hidden_dtype="bfloat16",
                  token_ids=rng.integers(0, 1000, t).astype(np.int32),
                  loss_mask=(np.arange(t) > 2).astype(np.uint8),
                  aux_hidden=rng.bytes(t * 3 * H * 2), final_hidden=rng.bytes(t * H * 2))


def _rows(data_dir) -> int:
    """Rows in the newest table version (from the log)."""
    table = DatasetTable(data_dir)
    return table.summary(exact=False)["rows"] if table.exists() else 0


def _stored(data_dir, column: str) -> list:
    table = DatasetTable(data_dir)
    return [v for f in table.data_files() for v in table.open_file(f.path).read(columns=[column]).column(0).to_pylist()]


def _rewind_group(bs: str, topic: str, group: str) -> None:
    """The group's Kafka offsets back to 0 while the table keeps everything: what a crash between
    the table commit and the Kafka commit leaves, for every batch at once."""
    consumer = KafkaConsumer(bootstrap_servers=bs, group_id=group, enable_auto_commit=False)
    consumer.commit({TopicPartition(topic, 0): OffsetAndMetadata(0, "", -1)})
    consumer.close(autocommit=False)


def _config(bs: str, topic: str, group: str) -> tuple[IngestConfig, KafkaConfig]:
    return (IngestConfig(group_id=group, topic_partitions=1, roll_interval_s=0.5, file_max_rows=8,
                         max_record_bytes=200_000, metrics_port=0),
            KafkaConfig(bootstrap_servers=bs, topic=topic, dead_letter_topic=topic + ".dead"))


def _read_all(bs: str, topic: str, expected: int, timeout_s: float = 20.0) -> list:
    consumer = KafkaConsumer(bootstrap_servers=bs, enable_auto_commit=False)
    consumer.assign([TopicPartition(topic, 0)])
    consumer.seek_to_beginning()
    out = []
    for _ in range(int(timeout_s * 2)):
        for records in consumer.poll(timeout_ms=500).values():
            out.extend(records)
        if len(out) >= expected:
            break
    consumer.close()
    return out


def test_malformed_unknown_version_and_oversized_are_dead_lettered(memory_broker, topic_name,
                                                                   tmp_path, capture_kit, wait):
    bs = memory_broker.bootstrap_servers
    config, kafka = _config(bs, topic_name, topic_name + ".g1")
    ensure_topics(config, kafka)
    good = [encode(_record(f"good-{i}", 20 + i, i)) for i in range(4)]
    future_version = bytearray(encode(_record("v99", 5, 9)))
    future_version[4:6] = struct.pack("<H", 99)
    oversized = encode(_record("huge", 600, 5))  # ~310 kB > max_record_bytes=200 kB
    assert len(oversized) > config.max_record_bytes
    bad = {1: (b"\x00garbage that is not a record", "malformed"),
           3: (bytes(future_version), "unknown_version"),
           4: (oversized, "oversized"),
           6: (None, "malformed")}  # a tombstone
    producer = KafkaProducer(bootstrap_servers=bs, acks="all", max_request_size=2_000_000)
    values = [good[0], bad[1][0], good[1], bad[3][0], bad[4][0], good[2], bad[6][0], good[3]]
    for v in values:
        producer.send(topic_name, key=b"k", value=v)
    producer.flush()
    producer.close()

    data_dir = tmp_path / "data"
    with capture_kit.IngestThread(config, kafka, data_dir):
        wait(lambda: _rows(data_dir) >= 4, 30, what="good rows")
    samples = {s.request_id for s in DatasetReader(data_dir).samples()}
    assert samples == {"good-0", "good-1", "good-2", "good-3"}

    dead = _read_all(bs, topic_name + ".dead", expected=len(bad))
    assert len(dead) == len(bad)
    by_offset = {}
    for message in dead:
        headers = {k: v.decode() for k, v in message.headers}
        by_offset[int(headers["tide-source-offset"])] = (message, headers)
    assert sorted(by_offset) == sorted(bad)
    for offset, (value, reason) in bad.items():
        message, headers = by_offset[offset]
        assert headers["tide-dead-letter-reason"] == reason
        assert headers["tide-source-topic"] == topic_name
        assert message.value == (value or b"")  # the original bytes are kept for inspection
        assert headers["tide-dead-letter-detail"]

    # everything, dead letters included, was committed: a new run has nothing to do
    consumer = KafkaConsumer(bootstrap_servers=bs, group_id=config.group_id)
    assert consumer.committed(TopicPartition(topic_name, 0)) == len(values)
    consumer.close()


def test_replay_of_offsets_already_in_the_table_writes_nothing_twice(memory_broker, topic_name,
                                                                    tmp_path, capture_kit, wait):
    """The group's Kafka offsets fall behind the table (a crash between the two commits): every
    offset is consumed again, and the table's application transactions skip them all."""
    bs = memory_broker.bootstrap_servers
    config, kafka = _config(bs, topic_name, topic_name + ".a")
    ensure_topics(config, kafka)
    producer = KafkaProducer(bootstrap_servers=bs, acks="all")
    for i in range(30):
        producer.send(topic_name, key=b"k", value=encode(_record(f"r{i}", 10, i)))
    producer.flush()
    producer.close()
    data_dir = tmp_path / "data"
    with capture_kit.IngestThread(config, kafka, data_dir):
        wait(lambda: capture_kit.caught_up(kafka, config.group_id), 30, what="first pass")
    version = DatasetTable(data_dir).version()
    assert version >= 3  # several batches: 8 rows each at most
    _rewind_group(bs, topic_name, config.group_id)
    with capture_kit.IngestThread(config, kafka, data_dir):
        wait(lambda: capture_kit.caught_up(kafka, config.group_id), 30, what="replay committed")
    assert sorted(_stored(data_dir, "kafka_offset")) == list(range(30))  # each exactly once
    assert DatasetTable(data_dir).version() == version  # the replay committed nothing to the table


@pytest.mark.parametrize("same_group,new_messages", [(True, 12), (False, 12), (True, 30)],
                         ids=["same-group", "new-group", "same-group-past-the-old-offsets"])
def test_recreated_topic_reusing_offsets_is_not_mistaken_for_a_replay(memory_broker, topic_name, tmp_path,
                                                                       capture_kit, wait, same_group, new_messages):
    """An in-memory broker restart (or a deleted topic) starts offsets at 0 again while the
    dataset keeps its files: new messages at old offsets must be written, old files kept. The
    same group (a restarted ingest) too: its table transaction records the old topic's offsets,
    also when the new topic has grown past them before ingest reads it (its offsets are keyed by
    the topic's id, not guessed from where the partition ends)."""
    from kafka import KafkaAdminClient

    bs = memory_broker.bootstrap_servers
    data_dir = tmp_path / "data"

    def produce(prefix: str, n: int = 12) -> None:
        producer = KafkaProducer(bootstrap_servers=bs, acks="all")
        for i in range(n):
            producer.send(topic_name, key=b"k", value=encode(_record(f"{prefix}-{i}", 8, i)))
        producer.flush()
        producer.close()

    first, kafka = _config(bs, topic_name, topic_name + ".one")
    ensure_topics(first, kafka)
    produce("old")
    with capture_kit.IngestThread(first, kafka, data_dir):
        wait(lambda: _rows(data_dir) >= 12, 30, what="first topic")
    old_files = {f.path for f in DatasetTable(data_dir).data_files()}

    admin = KafkaAdminClient(bootstrap_servers=bs)
    admin.delete_topics([topic_name])
    admin.close()
    wait(lambda: _recreate(first, kafka), 30, what="topic recreated")
    produce("new", new_messages)
    second = first if same_group else _config(bs, topic_name, topic_name + ".two")[0]
    with capture_kit.IngestThread(second, kafka, data_dir):
        wait(lambda: _rows(data_dir) >= 12 + new_messages, 30, what="second topic")
    assert old_files <= {f.path for f in DatasetTable(data_dir).data_files()}  # nothing replaced
    ids = sorted(s.request_id for s in DatasetReader(data_dir).samples())
    assert ids == sorted([f"old-{i}" for i in range(12)] + [f"new-{i}" for i in range(new_messages)])


def _recreate(config: IngestConfig, kafka: KafkaConfig) -> bool:
    try:
        ensure_topics(config, kafka)
    except Exception:  # deletion still in progress
        return False
    consumer = KafkaConsumer(bootstrap_servers=kafka.bootstrap_servers)
    try:
        tp = TopicPartition(kafka.topic, 0)
        return consumer.partitions_for_topic(kafka.topic) is not None and \
            consumer.end_offsets([tp])[tp] == 0
    finally:
        consumer.close()


def test_health_follows_the_consume_loop(memory_broker, topic_name, tmp_path, monkeypatch):
    # ingest's /health: not ready before joining, ready while polling the real broker, not ready
    # once the loop stops polling (stuck) although the process is up
    from tide.dataset.ingest import Ingestor

    ingestor = Ingestor(*_config(memory_broker.bootstrap_servers, topic_name, topic_name + ".gh"), tmp_path)
    ok, details = ingestor.health()
    assert not ok and details["state"] == "connecting"
    ingestor.open()
    try:
        ingestor.poll_once()
        ok, details = ingestor.health()
        assert ok and details["state"] == "consuming", details
        now = time.monotonic()
        monkeypatch.setattr(time, "monotonic", lambda: now + 31)  # 30 s = max(30 s, 20 polls of 0.5 s)
        ok, details = ingestor.health()
        assert not ok and details["state"] == "stalled", details
    finally:
        monkeypatch.undo()
        ingestor.close()
    assert ingestor.health()[1]["state"] == "connecting"  # closed: not ready again


def _raw_value(rid: str, header: bytes | None = None, **raw_fields: str) -> bytes:
    """A record whose header fields are set to raw JSON text (NaN, 1e400, ...), or whose whole
    header is ``header``, CRC correct: what a buggy or hostile producer can send."""
    import zlib

    from tide import records

    rec = _record(rid, 4, 1)
    value = encode(rec)
    header_len = records._PREFIX.unpack_from(value)[2]
    fields = {k: json.dumps(v) for k, v in rec.header().items()} | raw_fields
    if header is None:
        header = ("{" + ",".join(f'"{k}":{v}' for k, v in fields.items()) + "}").encode("utf-8", "surrogatepass")
    body = records._PREFIX.pack(records.MAGIC, records.SCHEMA_VERSION, len(header)) + header + \
        value[records._PREFIX.size + header_len:-4]
    return body + struct.pack("<I", zlib.crc32(body))


def test_values_that_crashed_or_wedged_ingest_are_dead_lettered_and_ingest_goes_on(
        memory_broker, topic_name, tmp_path, capture_kit, wait):
    """Each of these stopped ingest before: the consumer thread raised (NaN or out-of-range time,
    a 5000-digit integer, a deeply nested header) or the writer failed at seal time and the same
    file was replayed forever (lone surrogate, int32 overflow, a model id too long for a
    directory name). Now each is dead-lettered with its reason, or stored, and ingest goes on."""
    bs = memory_broker.bootstrap_servers
    config, kafka = _config(bs, topic_name, topic_name + ".hostile")
    ensure_topics(config, kafka)
    future_s = time.time() + 30 * 86400  # beyond ingest.max_clock_skew_s
    bad = [  # (value, reason)
        (_raw_value("nan", finished_at_s="NaN"), "invalid"),
        (_raw_value("inf", finished_at_s="1e400"), "invalid"),
        (_raw_value("negative", finished_at_s="-1e18"), "invalid"),
        (_raw_value("huge-int", hidden_size="1" + "0" * 5000), "malformed"),
        (_raw_value("surrogate", request_id='"\\ud800"'), "invalid"),
        (_raw_value("overflow", position_start=str(2**40)), "invalid"),
        (_raw_value("layers", aux_layer_ids=f"[{2**40},1,2]"), "invalid"),
        (_raw_value("long", request_id=json.dumps("x" * 60_000)), "invalid"),
        (_raw_value("future", finished_at_s=repr(future_s)), "invalid"),
        (_raw_value("nested", header=b"[" * 30_000), "malformed"),
        (b"\0not a record", "malformed"),  # sent with a key too large for a dead letter
    ]
    huge_key = b"k" * 1_100_000
    long_model = "/" * 256  # valid: stored under a shortened, hashed directory name
    good = [encode(_record(f"good-{i}", 6, i)) for i in range(3)]
    good.append(_raw_value("good-long-model", target_model_id=json.dumps(long_model)))
    producer = KafkaProducer(bootstrap_servers=bs, acks="all", max_request_size=2_000_000)
    values = []
    for i, (value, _) in enumerate(bad):
        values.append(value)
        if i % 3 == 0:
            values.append(good[i // 3])
    for v in values:
        producer.send(topic_name, key=huge_key if v == bad[-1][0] else b"k", value=v)
    producer.flush()
    producer.close()

    data_dir = tmp_path / "data"
    with capture_kit.IngestThread(config, kafka, data_dir):
        wait(lambda: _rows(data_dir) >= len(good), 30, what="good rows")
        consumer = KafkaConsumer(bootstrap_servers=bs, group_id=config.group_id)
        wait(lambda: consumer.committed(TopicPartition(topic_name, 0)) == len(values), 30,
             what="every offset committed")
        consumer.close()
    ids = {s.request_id for s in DatasetReader(data_dir).samples()}
    assert ids == {"good-0", "good-1", "good-2", "good-long-model"}
    dead = _read_all(bs, topic_name + ".dead", expected=len(bad))
    reasons = {}
    for message in dead:
        headers = {k: v.decode() for k, v in message.headers}
        reasons[message.value] = headers["tide-dead-letter-reason"]
        if message.value == bad[-1][0]:  # the key is cut; its length is kept
            assert len(message.key) < len(huge_key)
            assert headers["tide-dead-letter-key-truncated-from"] == str(len(huge_key))
    assert reasons == {value: reason for value, reason in bad}


def test_a_replay_or_a_new_group_does_not_resurrect_deleted_rows(memory_broker, topic_name,
                                                                   tmp_path, capture_kit, wait):
    """One request is deleted (``tide data delete``) and retention expires the oldest rows. Then the
    group replays everything (its Kafka offsets fell behind the table), and a new group (a new
    ingest deployment) reads the topic from the start: neither writes the deleted request back,
    and the replay writes nothing twice."""
    import dataclasses

    from tide.dataset.retention import apply_retention, delete_requests

    bs = memory_broker.bootstrap_servers
    first, kafka = _config(bs, topic_name, topic_name + ".first")
    ensure_topics(first, kafka)
    producer = KafkaProducer(bootstrap_servers=bs, acks="all")
    for i in range(24):  # capture times one second apart, oldest first
        rec = dataclasses.replace(_record(f"r{i}", 6, i), started_at_s=1.7e9 + i - 1, finished_at_s=1.7e9 + i)
        producer.send(topic_name, key=b"k", value=encode(rec))
    producer.flush()
    producer.close()
    data_dir = tmp_path / "data"
    with capture_kit.IngestThread(first, kafka, data_dir):
        wait(lambda: capture_kit.caught_up(kafka, first.group_id), 30, what="first pass")

    table = DatasetTable(data_dir)
    assert delete_requests(table, ["r13"]) == {"r13": 1}
    assert apply_retention(table, ttl_s=3600, max_bytes=1 << 40, now_s=1.7e9 + 3600 + 5.5)
    expired = {f"r{i}" for i in range(6)}  # captured at or before 1.7e9 + 5.5
    _rewind_group(bs, topic_name, first.group_id)
    with capture_kit.IngestThread(first, kafka, data_dir):
        wait(lambda: capture_kit.caught_up(kafka, first.group_id), 30, what="replay committed")
    assert sorted(_stored(data_dir, "request_id")) == sorted(f"r{i}" for i in range(24)
                                                              if f"r{i}" not in expired | {"r13"})
    fresh, _ = _config(bs, topic_name, topic_name + ".fresh")
    with capture_kit.IngestThread(fresh, kafka, data_dir):
        wait(lambda: capture_kit.caught_up(kafka, fresh.group_id), 30, what="a new group's pass")
    stored = _stored(data_dir, "request_id")
    assert "r13" not in stored  # the tombstone holds for any group
    # a new group is a new writer: what retention expired comes back until its next pass
    apply_retention(table, ttl_s=3600, max_bytes=1 << 40, now_s=1.7e9 + 3600 + 5.5)
    assert sorted(set(_stored(data_dir, "request_id"))) == sorted(f"r{i}" for i in range(24)
                                                                  if f"r{i}" not in expired | {"r13"})


def _gaps(outcome: str) -> float:
    from prometheus_client import REGISTRY

    return REGISTRY.get_sample_value("tide_ingest_offset_gaps_total", {"outcome": outcome}) or 0.0


def _poll_until(ingestor, predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"ingest never reached: {what}"
        ingestor.poll_once()


def test_a_fetch_that_skips_offsets_is_fetched_again_and_a_lasting_gap_is_passed(memory_broker, topic_name,
                                                                                 tmp_path):
    """A fetch answer that starts past the offset ingest asked for (kafka-python drops such records
    without a word): the skipped offsets are fetched again once and land exactly once; a gap that
    is still there on the second fetch is counted and passed, never a loop."""
    from kafka import TopicPartition

    from tide.dataset.ingest import Ingestor

    bs = memory_broker.bootstrap_servers
    config, kafka = _config(bs, topic_name, topic_name + ".gap")
    config = config.model_copy(update={"max_poll_records": 4})
    ensure_topics(config, kafka)
    producer = KafkaProducer(bootstrap_servers=bs, acks="all")

    def produce(first: int, n: int) -> None:
        for i in range(first, first + n):
            producer.send(topic_name, key=b"k", partition=0, value=encode(_record(f"g{i}", 10, i)))
        producer.flush()

    produce(0, 30)
    data_dir, tp = tmp_path / "data", TopicPartition(topic_name, 0)
    ingestor = Ingestor(config, kafka, data_dir)
    ingestor.open()
    refetched, passed = _gaps("refetched"), _gaps("passed")
    try:
        _poll_until(ingestor, lambda: ingestor.positions().get(tp, 0) > 0, 30, "a first batch")
        ingestor._consumer.seek(tp, 20)  # the fetcher skips 4..19 (or wherever the first batch ended)
        _poll_until(ingestor, lambda: _gaps("refetched") > refetched, 30, "the gap seen")
        _poll_until(ingestor, lambda: sorted(_stored(data_dir, "kafka_offset")) == list(range(30)), 60,
                    "every offset once")
        produce(30, 30)
        _poll_until(ingestor, lambda: ingestor.positions()[tp] > 30, 30, "a batch past 30")
        start = ingestor.positions()[tp]
        ingestor._consumer.seek(tp, 50)
        _poll_until(ingestor, lambda: _gaps("refetched") > refetched + 1, 30, "the second gap seen")
        ingestor._consumer.seek(tp, 50)  # the re-fetch skips them again: nothing is there to read
        _poll_until(ingestor, lambda: _gaps("passed") > passed, 30, "the lasting gap passed")
        expected = list(range(30)) + [o for o in range(30, 60) if not start <= o < 50]
        _poll_until(ingestor, lambda: sorted(_stored(data_dir, "kafka_offset")) == expected, 60,
                    "every offset but the lasting gap, once")
    finally:
        producer.close()
        ingestor.close()
    assert _gaps("refetched") == refetched + 2 and _gaps("passed") == passed + 1
