"""Deletion is never lost: concurrent deletes, a retention pass during a delete, a chunk that was
in an uncommitted batch while its request was deleted, and rows past the TTL cannot reach a later
table version; files holding user data are removed when a write fails (a real full tmpfs).

The races run for real on threads: Delta's optimistic concurrency makes the loser of each race
run again on the winner's version (tide/dataset/retention.py)."""
import threading
import time

import pytest

from tide.dataset.location import Location
from tide.dataset.reader import DatasetReader
from tide.dataset.retention import apply_retention, delete_requests
from tide.dataset.schema import Row, partition_values
from tide.dataset.table import DatasetTable
from tide.dataset.tombstones import Tombstones
from tide.dataset.writer import DataFileWriter
from tide.dataset.writer_thread import Batch, WriterThread

T0 = 1_700_000_000.0


def _stored_ids(uri) -> list[str]:
    table = DatasetTable(uri)
    return sorted(r for f in table.data_files()
                  for r in table.open_file(f.path).read(columns=["request_id"]).column(0).to_pylist())


def _batch(uri, helpers, rids, first_offset=0, at_s=T0, row_group_rows=64):
    f = DataFileWriter(Location.from_uri(uri), partition_values(at_s), row_group_rows, 1 << 30)
    for i, rid in enumerate(rids):
        f.add(Row(helpers.make_record(rid, at_s=at_s, seed=i), "t", 0, first_offset + i, 0, at_s))
    return Batch([f], (("g/t/0", None),), first_offset, first_offset + len(rids) - 1, [], first_offset - 1)


def _writer(uri) -> WriterThread:
    table = DatasetTable(uri)
    table.ensure()
    return WriterThread(table, Tombstones(table.location), lambda futures: None)


def test_concurrent_deletes_of_one_file_all_hold(tmp_path, helpers):
    helpers.write_file(tmp_path, [helpers.make_record(r, seed=i) for i, r in enumerate(["a", "b", "c", "keep"])])
    start, errors = threading.Barrier(3), []

    def delete(rid):
        start.wait(timeout=10)
        try:
            delete_requests(DatasetTable(tmp_path), [rid])
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=delete, args=(rid,)) for rid in ("a", "b", "c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and _stored_ids(tmp_path) == ["keep"]


def test_retention_during_deletes_is_not_undone(tmp_path, helpers):
    helpers.write_file(tmp_path, [helpers.make_record("expired", at_s=T0, seed=1)])
    helpers.write_file(tmp_path, [helpers.make_record(r, at_s=T0 + 7200, seed=i) for i, r in
                                  enumerate(["gone", "keep"])], first_offset=1)
    start, errors = threading.Barrier(2), []

    def run(operation):
        start.wait(timeout=10)
        try:
            operation()
        except Exception as exc:  # noqa: BLE001 - surfaced below
            errors.append(exc)

    # VACUUM keeps an hour of files: the delete's rewritten file is not in the log yet while it runs
    retention = lambda: apply_retention(DatasetTable(tmp_path), ttl_s=3600, max_bytes=1 << 40,  # noqa: E731
                                        now_s=T0 + 3601, vacuum_retention_hours=1)
    threads = [threading.Thread(target=run, args=(op,)) for op in
               (retention, lambda: delete_requests(DatasetTable(tmp_path), ["gone"]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == [] and _stored_ids(tmp_path) == ["keep"]


def test_a_chunk_in_an_uncommitted_batch_during_its_delete_is_not_committed(tmp_path, helpers):
    writer = _writer(tmp_path)
    try:
        batch = _batch(tmp_path, helpers, ["gone", "keep", "gone"])
        assert delete_requests(DatasetTable(tmp_path), ["gone"]) == {"gone": 0}  # nothing stored yet
        sealed = writer.seal(batch).result(timeout=30)
    finally:
        writer.close()
    assert _stored_ids(tmp_path) == ["keep"]
    assert [o.rows for o in sealed.files] == [1]
    assert len(list(tmp_path.glob("date=*/hour=*/part-*.parquet"))) == 1  # the unfiltered file is gone


def test_rows_of_deleted_requests_never_reach_a_version(tmp_path, helpers):
    """Chunks still in Kafka when their request was deleted are dropped at commit time; a batch
    left with no row commits nothing."""
    writer = _writer(tmp_path)
    try:
        delete_requests(DatasetTable(tmp_path), ["user", "other"])
        gone = writer.seal(_batch(tmp_path, helpers, ["other"], 0, T0)).result(30)
        new = writer.seal(_batch(tmp_path, helpers, ["user", "new-1"], 2, T0 + 9000)).result(30)
    finally:
        writer.close()
    assert gone.version is None and gone.files == []
    assert _stored_ids(tmp_path) == ["new-1"] and [o.rows for o in new.files] == [1]
    for v in range(DatasetTable(tmp_path).version() + 1):
        assert {"user", "other"}.isdisjoint(s.request_id for s in DatasetReader(tmp_path, version=v).samples())


def test_delete_marks_the_request_even_when_nothing_is_stored(tmp_path):
    table = DatasetTable(tmp_path)
    assert delete_requests(table, ["later"]) == {"later": 0}
    assert Tombstones(table.location).among(["later", "other"]) == {"later"}


def test_a_delete_on_a_full_disk_keeps_the_data_and_works_once_there_is_room(small_filesystem, helpers):
    fs = small_filesystem(8 << 20)
    data = fs.path / "ds"
    big = helpers.make_record("keep", t=2000, seed=1)  # ~100 kB of hidden states
    helpers.write_file(data, [helpers.make_record("gone"), big])
    fs.fill()
    with pytest.raises(Exception):
        delete_requests(DatasetTable(data), ["gone"])
    assert _stored_ids(data) == ["gone", "keep"]  # the version it could not replace is intact
    fs.free()
    assert delete_requests(DatasetTable(data), ["gone"]) == {"gone": 1}
    assert _stored_ids(data) == ["keep"]


def test_a_seal_that_fails_on_a_full_disk_removes_every_file_it_wrote(small_filesystem, helpers):
    fs = small_filesystem(8 << 20)
    data = fs.path / "ds"
    writer = _writer(data)
    try:
        batch = _batch(data, helpers, [f"b{i}" for i in range(40)], row_group_rows=8)  # 5 row groups written
        writer.wait_idle()
        assert len(list(data.glob("date=*/hour=*/part-*.parquet"))) == 1
        fs.fill()
        with pytest.raises(OSError) as err:
            writer.seal(batch).result(timeout=30)
        assert err.value.errno == 28
        writer.wait_idle()
    finally:
        writer.close()
    assert not list(data.glob("date=*/hour=*/part-*.parquet")) and DatasetTable(data).data_files() == []


def test_retention_frees_a_nearly_full_disk(small_filesystem, helpers):
    """The runbook's remedy for a full disk: whole expired files go with a small log entry."""
    fs = small_filesystem(8 << 20)
    data = fs.path / "ds"
    for i in range(3):
        helpers.write_file(data, [helpers.make_record(f"r{i}", t=400, at_s=T0 + i, seed=i)], first_offset=i)
    fs.fill(leave_bytes=256 * 1024)
    started = time.monotonic()
    deleted = apply_retention(DatasetTable(data), ttl_s=3600, max_bytes=1 << 40, now_s=T0 + 3601.5)
    assert len(deleted) == 2 and _stored_ids(data) == ["r2"], time.monotonic() - started
    assert len(list(data.glob("date=*/hour=*/part-*.parquet"))) == 1  # their space is back
