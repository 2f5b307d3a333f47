"""Retention by TTL and size (oldest first) is DELETE + VACUUM; deleting requests is a DELETE."""
from tide.dataset.reader import DatasetReader
from tide.dataset.retention import apply_retention, delete_requests
from tide.dataset.table import DatasetTable


def test_ttl_then_size_budget_oldest_first(tmp_path, helpers):
    t0 = 1_700_000_000.0
    paths = []
    for i in range(4):
        out, _ = helpers.write_file(tmp_path, [helpers.make_record(f"r{i}", at_s=t0 + 100 * i)], first_offset=i)
        paths.append(out.add.path)
    table = DatasetTable(tmp_path)
    size = table.data_files()[0].size
    # r0 is older than the TTL; the budget then keeps only the newest two
    deleted = apply_retention(table, ttl_s=250, max_bytes=int(size * 2.5), now_s=t0 + 300)
    assert deleted == sorted(paths[:2])
    assert sorted(f.path for f in table.data_files()) == sorted(paths[2:])
    assert not (tmp_path / paths[0]).exists() and not (tmp_path / paths[1]).exists()  # vacuumed
    assert {s.request_id for s in DatasetReader(tmp_path).samples()} == {"r2", "r3"}


def test_delete_requests_removes_their_rows_from_the_newest_version(tmp_path, helpers):
    recs = [helpers.make_record("keep-1", seed=1), helpers.make_record("gone", t=40, seed=2),
            helpers.make_record("keep-2", seed=3)]
    helpers.write_file(tmp_path, recs, max_message_bytes=2000)
    helpers.write_file(tmp_path, [helpers.make_record("gone", t=3)], first_offset=50)
    table = DatasetTable(tmp_path)
    before = table.version()
    removed = delete_requests(table, ["gone"])
    assert removed["gone"] > 2
    assert {s.request_id for s in DatasetReader(tmp_path).samples()} == {"keep-1", "keep-2"}
    # the version before the DELETE still names the old files (until VACUUM removes them)
    assert "gone" in {s.request_id for s in DatasetReader(tmp_path, version=before).samples()}
