"""Retention by TTL and size (oldest first) and deletion of one request's rows."""
import pyarrow.parquet as pq

from tide.dataset.index import DatasetIndex
from tide.dataset.reader import DatasetReader
from tide.dataset.retention import apply_retention, delete_request
from tide.dataset.schema import list_files


def test_ttl_then_size_budget_oldest_first(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    t0 = 1_700_000_000.0
    paths = []
    for i in range(4):
        stats, rids = helpers.write_file(tmp_path, [helpers.make_record(f"r{i}", at_s=t0 + 100 * i)],
                                         first_offset=i)
        index.add(stats, rids)
        paths.append(stats.path)
    size = index.files()[0].bytes
    # r0 is older than the TTL; the budget then keeps only the newest two
    deleted = apply_retention(tmp_path, index, ttl_s=250, max_bytes=int(size * 2.5), now_s=t0 + 300)
    assert deleted == [paths[0], paths[1]]
    assert [str(p.relative_to(tmp_path)) for p in list_files(tmp_path)] == paths[2:]
    assert index.summary()["files"] == 2


def test_delete_request_rewrites_files_without_its_rows(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    recs = [helpers.make_record("keep-1", seed=1), helpers.make_record("gone", t=40, seed=2),
            helpers.make_record("keep-2", seed=3)]
    stats, rids = helpers.write_file(tmp_path, recs, max_message_bytes=2000)
    index.add(stats, rids)
    lone, lone_ids = helpers.write_file(tmp_path, [helpers.make_record("gone", t=3)], first_offset=50)
    index.add(lone, lone_ids)
    removed = delete_request(tmp_path, "gone", index)
    assert removed > 2
    assert not (tmp_path / lone.path).exists()  # left empty: deleted
    table = pq.read_table(tmp_path / stats.path)
    assert set(table.column("request_id").to_pylist()) == {"keep-1", "keep-2"}
    assert index.files_for_request("gone") == []
    assert index.get(stats.path).created_at_s == stats.created_at_s
    assert {s.request_id for s in DatasetReader(tmp_path).samples()} == {"keep-1", "keep-2"}
