"""The index counts rows/tokens per file and repairs itself against the disk."""
from tide.dataset.index import DatasetIndex


def test_summary_and_windows(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    t0 = 1_700_000_000.0
    for i in range(3):
        stats, rids = helpers.write_file(tmp_path, [helpers.make_record(f"r{i}", at_s=t0 + 3600 * i)],
                                         first_offset=i)
        index.add(stats, rids)
    total = index.summary()
    assert (total["files"], total["rows"], total["tokens"], total["generated_tokens"]) == (3, 3, 36, 24)
    assert index.summary(since_s=t0 + 3600)["files"] == 2
    assert index.summary(until_s=t0 + 1)["files"] == 1
    assert index.summary(created_after_s=t0 + 1)["files"] == 2
    assert index.summary(target_model="other")["files"] == 0
    assert [s.max_time_s for s in index.files()] == [t0, t0 + 3600, t0 + 7200]
    assert len(index.files_after("t", 0, 2)) == 1
    assert index.files_for_request("r1") == [index.files()[1].path]


def test_reconcile_adds_unindexed_and_drops_missing(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    a, a_ids = helpers.write_file(tmp_path, [helpers.make_record("a")], first_offset=0)
    b, b_ids = helpers.write_file(tmp_path, [helpers.make_record("b", t=5)], first_offset=1)
    index.add(a, a_ids)  # b was renamed but the "crash" came before its index entry
    (tmp_path / a.path).unlink()  # a vanished behind the index's back
    assert index.reconcile() == (1, 1)
    (only,) = index.files()
    assert only.path == b.path and only.tokens == 5 and only.rows == 1
    assert index.files_for_request("b") == [b.path]


def test_second_process_sees_committed_entries(tmp_path, helpers):
    writer = DatasetIndex(tmp_path)
    stats, rids = helpers.write_file(tmp_path, [helpers.make_record("x")])
    writer.add(stats, rids)
    reader = DatasetIndex(tmp_path)
    assert reader.summary()["rows"] == 1
