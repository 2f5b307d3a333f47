"""The dataset as a Delta Lake table, with real parts: a delete of request ids racing ingest (a real
broker), retention and compaction leaves the ids in no later table version and no retrain window;
an outside reader (Polars' Delta reader, no TIDE code) reads the table, local and on S3."""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import polars as pl
import pytest
from kafka import KafkaProducer

from tide.config import IngestConfig, KafkaConfig
from tide.dataset.location import Location
from tide.dataset.reader import DatasetReader
from tide.dataset.retention import apply_retention, compact, delete_requests
from tide.dataset.schema import Row, partition_values
from tide.dataset.table import DatasetTable
from tide.dataset.topics import ensure_topics
from tide.dataset.writer import DataFileWriter
from tide.records import Record, encode, split
from tide.train.window import WindowSpec, plan_window

H = 16


def _record(rid: str, t: int, seed: int) -> Record:
    rng = np.random.default_rng(seed)
    now = time.time()
    return Record(request_id=rid, target_model_id="org/m", drafter_version="v1", aux_layer_ids=(1, 2, 3),
                  workload=None, started_at_s=now - 1, finished_at_s=now, hidden_size=H, hidden_dtype="bfloat16",
                  token_ids=rng.integers(0, 1000, t).astype(np.int32), loss_mask=(np.arange(t) > 2).astype(np.uint8),
                  aux_hidden=rng.bytes(t * 3 * H * 2), final_hidden=rng.bytes(t * H * 2))


def _ids_in(table: DatasetTable, version: int) -> set[str]:
    ids = set()
    for f in table.data_files(version):
        try:
            ids.update(table.open_file(f.path).read(columns=["request_id"]).column(0).to_pylist())
        except FileNotFoundError:  # vacuumed: that version's rows are gone anyway
            continue
    return ids


def test_a_delete_racing_ingest_retention_and_compaction_holds_in_every_later_version_and_window(
        memory_broker, topic_name, tmp_path, capture_kit, wait):
    bs = memory_broker.bootstrap_servers
    config = IngestConfig(group_id=topic_name + ".g", topic_partitions=2, roll_interval_s=0.2, file_max_rows=4,
                          metrics_port=0)
    kafka = KafkaConfig(bootstrap_servers=bs, topic=topic_name, dead_letter_topic=topic_name + ".dl")
    ensure_topics(config, kafka)
    data_dir = tmp_path / "data"
    table = DatasetTable(data_dir)
    producer = KafkaProducer(bootstrap_servers=bs, acks="all")
    victims = [f"user-{i}" for i in range(3)]
    # each victim's first chunk goes out before the delete, its last chunk only after it
    chunks = {rid: split(_record(rid, 60, i), 2000) for i, rid in enumerate(victims)}
    stop, errors, deleted = threading.Event(), [], threading.Event()

    def produce() -> None:
        i = 0
        while not stop.is_set():
            producer.send(topic_name, key=f"k{i}".encode(), value=encode(_record(f"r{i}", 12, 100 + i)))
            i += 1
            time.sleep(0.01)

    def maintain(operation) -> None:
        while not stop.is_set():
            try:
                operation()
            except Exception as exc:  # noqa: BLE001 - surfaced below
                errors.append(exc)
                return

    for rid, parts in chunks.items():
        for chunk in parts[:-1]:
            producer.send(topic_name, key=rid.encode(), value=encode(chunk))
    producer.flush()
    threads = [threading.Thread(target=produce),
               # files of this hour compacted while ingest appends to it
               threading.Thread(target=maintain, args=(lambda: compact(DatasetTable(data_dir), 1 << 30,
                                                                       time.time() + 7200),)),
               # retention DELETE + VACUUM (its TTL keeps everything: it races, it does not expire)
               threading.Thread(target=maintain, args=(lambda: apply_retention(
                   DatasetTable(data_dir), ttl_s=86400, max_bytes=1 << 40, vacuum_retention_hours=1),))]
    with capture_kit.IngestThread(config, kafka, data_dir):
        for t in threads:
            t.start()
        try:
            wait(lambda: victims[0] in _ids_in(table, table.version()) if table.exists() else False, 60,
                 what="a victim's first chunks in the table")
            removed = delete_requests(DatasetTable(data_dir), victims)
            deleted.set()
            after = table.version()
            assert sum(removed.values()) >= 1
            for rid, parts in chunks.items():  # their last chunks reach Kafka after the delete
                producer.send(topic_name, key=rid.encode(), value=encode(parts[-1]))
            producer.flush()
            seen = table.version()
            wait(lambda: table.version() > seen + 5, 60, interval_s=0.1, what="ingest, compaction and retention to go on")
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        wait(lambda: capture_kit.caught_up(kafka, config.group_id), 60, what="ingest to commit everything")
    producer.close()
    assert errors == []
    history = table.delta().history()
    assert {"OPTIMIZE", "DELETE"} <= {h["operation"] for h in history}  # the race did happen
    latest = table.version()
    for version in range(after, latest + 1):
        assert not set(victims) & _ids_in(table, version), version
    # no retrain window has them: the newest version, nor one pinned before the delete
    for version in (None, after - 2):
        plan = plan_window(data_dir, WindowSpec(heldout_fraction=0.2, version=version))
        assert plan.catalog_requests > 0 and not set(victims) & set(plan.recent + plan.replay + plan.heldout)


def _reference_rows(uri, options) -> dict:
    table = DatasetTable(Location.from_uri(uri, options))
    rows = {}
    for f in table.data_files():
        for row in table.open_file(f.path).read(columns=["request_id", "chunk_index", "token_ids", "aux_hidden"]).to_pylist():
            rows[(row["request_id"], row["chunk_index"])] = (row["token_ids"], row["aux_hidden"])
    return rows


def _check_polars(frame: pl.DataFrame, expected: dict) -> None:
    assert {"request_id", "chunk_index", "finished_at_s", "aux_hidden", "loss_mask", "date", "hour"} <= set(frame.columns)
    got = {(r["request_id"], r["chunk_index"]): (r["token_ids"], r["aux_hidden"])
           for r in frame.select("request_id", "chunk_index", "token_ids", "aux_hidden").iter_rows(named=True)}
    assert got == expected and len(frame) == len(expected)
    assert frame.schema["loss_mask"] == pl.List(pl.Int8) and frame.schema["date"] == pl.Date


@pytest.fixture
def records() -> list[Record]:
    """Five requests: three captured in one hour, two an hour later."""
    t0 = 1_700_000_000.0
    return [dataclasses.replace(_record(f"r{i}", 40, i), started_at_s=t - 1, finished_at_s=t)
            for i, t in enumerate([t0] * 3 + [t0 + 3600] * 2)]


def test_an_outside_reader_reads_the_table_local_and_on_s3(tmp_path, s3_store, records):
    for uri, options in ((str(tmp_path / "local"), {}), (s3_store.uri("outside"), s3_store.env)):
        table = DatasetTable(Location.from_uri(uri, options))
        table.ensure()
        for k, group in enumerate((records[:3], records[3:])):
            writer = DataFileWriter(table.location, partition_values(group[0].finished_at_s), 2, 1 << 30)
            for i, rec in enumerate(group):
                for j, chunk in enumerate(split(rec, 3000)):
                    writer.add(Row(chunk, "t", 0, 100 * k + 10 * i + j, 0, rec.finished_at_s))
            out = writer.finish()
            table.append([out.add], out.counts)
        delete_requests(table, ["r1"])  # a DELETE's rewritten files are read the same way
        expected = _reference_rows(uri, options)
        assert expected and not any(rid == "r1" for rid, _ in expected)
        frame = pl.read_delta(uri, storage_options=options or None)
        _check_polars(frame, expected)
        # partition pruning by hour, as an analyst would filter
        hour = int(partition_values(records[0].finished_at_s)["hour"])
        assert set(pl.scan_delta(uri, storage_options=options or None).filter(pl.col("hour") == hour)
                   .select("request_id").collect()["request_id"]) == {"r0", "r2"}
        assert {s.request_id for s in DatasetReader(table).samples()} == {"r0", "r2", "r3", "r4"}

