"""Deletion is never lost: concurrent deletes, a retention pass during a delete, a chunk that was
in an open file while its request was deleted, and a replay of deleted rows cannot bring rows
back; temporaries holding user data are removed when a write fails (a real full tmpfs).

The races are made deterministic by pausing one party right after it has read a file (a wrapper
around ``pq.read_table``): without the dataset lock the other party then runs in the gap; with
it, the other party waits for the lock and the pause ends at its bounded timeout."""
import os
import threading
import time

import pyarrow.parquet as pq
import pytest

from tide.dataset.index import DatasetIndex
from tide.dataset.retention import apply_retention, delete_request
from tide.dataset.schema import Row, list_files, partition_dir
from tide.dataset.writer import OpenFile
from tide.dataset.writer_thread import WriterThread

T0 = 1_700_000_000.0
PAUSE_S = 1.0  # how long a paused party waits for the other: the lock makes it wait in vain


def _stored_ids(data_dir) -> list[str]:
    return sorted(r for p in list_files(data_dir)
                  for r in pq.read_table(p, columns=["request_id"]).column("request_id").to_pylist())


def _pause_after_first_read(monkeypatch, gate) -> None:
    """Threads named ``paused-*`` call ``gate()`` after their first read of a data file."""
    real, done = pq.read_table, set()

    def read(path, *args, **kwargs):
        table = real(path, *args, **kwargs)
        me = threading.current_thread().name
        if me.startswith("paused-") and me not in done:
            done.add(me)
            gate()
        return table

    monkeypatch.setattr(pq, "read_table", read)


def _open_file(data_dir, helpers, rids, first_offset=0, at_s=T0, row_group_rows=64):
    f = OpenFile(data_dir, partition_dir("org/m", at_s), "t", 0, row_group_rows, 1 << 30)
    for i, rid in enumerate(rids):
        f.add(Row(helpers.make_record(rid, at_s=at_s, seed=i), "t", 0, first_offset + i, 0, at_s))
    return f


def test_two_concurrent_deletes_of_one_file_both_hold(tmp_path, helpers, monkeypatch):
    index = DatasetIndex(tmp_path)
    stats, rids = helpers.write_file(tmp_path, [helpers.make_record(r, seed=i)
                                                for i, r in enumerate(["a", "b", "keep"])])
    index.add(stats, rids)
    index.close()
    both_read = threading.Barrier(2)

    def gate():
        try:
            both_read.wait(timeout=PAUSE_S)  # unlocked: both now hold the same original rows
        except threading.BrokenBarrierError:
            pass

    _pause_after_first_read(monkeypatch, gate)
    threads = [threading.Thread(target=delete_request, args=(tmp_path, rid), name=f"paused-{rid}")
               for rid in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert _stored_ids(tmp_path) == ["keep"]


def test_retention_during_a_delete_is_not_undone(tmp_path, helpers, monkeypatch):
    index = DatasetIndex(tmp_path)
    stats, rids = helpers.write_file(tmp_path, [helpers.make_record("gone", at_s=T0),
                                                helpers.make_record("expired", at_s=T0, seed=1)])
    index.add(stats, rids)
    read, retention_done = threading.Event(), threading.Event()
    _pause_after_first_read(monkeypatch, lambda: (read.set(), retention_done.wait(PAUSE_S)))
    deleter = threading.Thread(target=delete_request, args=(tmp_path, "gone"), name="paused-delete")
    deleter.start()
    assert read.wait(10)
    # the file expired: retention deletes it while the delete is between reading and renaming
    assert apply_retention(tmp_path, index, ttl_s=3600, max_bytes=1 << 40, now_s=T0 + 7200) \
        in ([stats.path], [])
    retention_done.set()
    deleter.join(timeout=30)
    assert list_files(tmp_path) == [] and index.summary()["files"] == 0
    index.close()


def test_a_chunk_in_an_open_file_during_its_delete_is_not_published(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    writer = WriterThread(index)
    try:
        open_file = _open_file(tmp_path, helpers, ["gone", "keep", "gone"])
        assert delete_request(tmp_path, "gone", index) == 0  # nothing on disk yet
        sealed = writer.seal([open_file], T0).result(timeout=30)
    finally:
        writer.close()
    assert _stored_ids(tmp_path) == ["keep"]
    assert [s.rows for s in sealed] == [1] and index.summary()["rows"] == 1
    assert index.files_for_request("gone") == []
    assert not list(tmp_path.rglob(".*.tmp"))


def test_a_replay_of_deleted_rows_brings_none_back(tmp_path, helpers):
    """A replay after a failed commit consumes the same messages again: rows a delete or a
    retention pass removed in between stay removed (TTL and size budget)."""
    index = DatasetIndex(tmp_path)
    writer = WriterThread(index)

    def seal(rids, first_offset, at_s):
        return writer.seal([_open_file(tmp_path, helpers, rids, first_offset, at_s)], at_s).result(30)

    try:
        old = seal(["old-1", "old-2"], 0, T0)[0]  # expires by TTL
        mid = seal(["mid-1", "mid-2"], 2, T0 + 5000)[0]  # deleted by the size budget
        new = seal(["user", "new-1"], 4, T0 + 9000)[0]
        delete_request(tmp_path, "user", index)
        assert apply_retention(tmp_path, index, ttl_s=3600, max_bytes=new.bytes,
                               now_s=T0 + 9000) == [old.path, mid.path]
        assert _stored_ids(tmp_path) == ["new-1"]
        # the commit had failed: everything is consumed and sealed again
        assert seal(["old-1", "old-2"], 0, T0) == [] and seal(["mid-1", "mid-2"], 2, T0 + 5000) == []
        replayed = seal(["user", "new-1"], 4, T0 + 9000)
        later = seal(["late-1"], 6, T0 + 9001)
    finally:
        writer.close()
    # the replay's file has the same name as the original (same offsets and first message) and
    # the same rows: it replaces it
    assert _stored_ids(tmp_path) == ["late-1", "new-1"]
    assert [s.rows for s in replayed + later] == [1, 1]


def test_a_delete_on_a_full_disk_leaves_no_temporary(small_filesystem, helpers):
    fs = small_filesystem(8 << 20)
    data = fs.path / "ds"
    index = DatasetIndex(data)
    big = helpers.make_record("keep", t=2000, seed=1)  # ~100 kB of hidden states
    stats, rids = helpers.write_file(data, [helpers.make_record("gone"), big])
    index.add(stats, rids)
    fs.fill(leave_bytes=32 * 1024)  # room for the index, not for the rewritten file
    with pytest.raises(OSError) as err:
        delete_request(data, "gone", index)
    assert err.value.errno == 28
    assert not list(data.rglob(".*.tmp")) and not _deleted_files_held_open()
    assert _stored_ids(data) == ["gone", "keep"]  # the original is intact
    fs.free()
    assert delete_request(data, "gone", index) == 1
    assert _stored_ids(data) == ["keep"]
    index.close()


def test_a_seal_that_fails_on_a_full_disk_removes_every_temporary(small_filesystem, helpers):
    fs = small_filesystem(8 << 20)
    data = fs.path / "ds"
    index = DatasetIndex(data)
    writer = WriterThread(index)
    try:
        buffered = _open_file(data, helpers, [f"b{i}" for i in range(40)])  # written at seal time
        streamed = _open_file(data, helpers, ["s0", "s1"], 100, T0 + 3600, row_group_rows=1)
        assert len(list(data.rglob(".*.tmp"))) == 1  # streamed has row groups on disk already
        fs.fill()
        future = writer.seal([buffered, streamed], T0)
        with pytest.raises(OSError) as err:
            future.result(timeout=30)
        assert err.value.errno == 28
        writer.wait_idle()
    finally:
        writer.close()
    assert not list(data.rglob(".*.tmp")) and list_files(data) == []
    assert not _deleted_files_held_open()  # a handle left open would keep the space
    index.close()


def _deleted_files_held_open() -> list[str]:
    fds = "/proc/self/fd"
    out = []
    for fd in os.listdir(fds):
        try:
            target = os.readlink(f"{fds}/{fd}")
        except OSError:
            continue
        if target.endswith(" (deleted)") and ".tmp" in target:
            out.append(target)
    return out


def test_delete_marks_the_request_even_when_nothing_is_stored(tmp_path):
    index = DatasetIndex(tmp_path)
    assert delete_request(tmp_path, "later", index) == 0
    assert index.deleted_among(["later", "other"]) == {"later"}
    started = time.time()
    apply_retention(tmp_path, index, ttl_s=60, max_bytes=1 << 40, now_s=started)
    assert index.retention_cut_s() == started - 60
    apply_retention(tmp_path, index, ttl_s=60, max_bytes=1 << 40, now_s=started - 3600)
    assert index.retention_cut_s() == started - 60  # the cut never moves back
    index.close()


def test_retention_frees_a_full_disk(small_filesystem, helpers):
    """The runbook's remedy for a full disk: retention must work when the disk is full."""
    fs = small_filesystem(8 << 20)
    data = fs.path / "ds"
    index = DatasetIndex(data)
    for i in range(3):
        stats, rids = helpers.write_file(data, [helpers.make_record(f"r{i}", t=400, at_s=T0 + i, seed=i)],
                                         first_offset=i)
        index.add(stats, rids)
    fs.fill()
    deleted = apply_retention(data, index, ttl_s=3600, max_bytes=1 << 40, now_s=T0 + 3601.5)
    assert len(deleted) == 2 and _stored_ids(data) == ["r2"]
    assert index.retention_cut_s() == T0 + 1.5 and index.summary()["files"] == 1
    index.close()
