"""Sealed files appear atomically under their offset-range name; temporaries never show."""
import pyarrow.parquet as pq

from tide.dataset.schema import FileName, Row, list_files, partition_dir
from tide.dataset.writer import OpenFile, remove_temporaries


def test_rows_stream_into_a_hidden_temporary_then_rename(tmp_path, helpers):
    rel = partition_dir("org/m", 1_700_000_000.0)
    f = OpenFile(tmp_path, rel, "t", 1, row_group_rows=2, row_group_bytes=1 << 30)
    for i in range(5):
        f.add(Row(helpers.make_record(f"r{i}", seed=i), "t", 1, 10 + i, 0, 0.0))
    # two row groups already written, but only to a dot-prefixed temporary
    assert list_files(tmp_path) == []
    temporaries = list((tmp_path / rel).glob(".*.tmp"))
    assert len(temporaries) == 1 and temporaries[0].stat().st_size > 0
    stats = f.seal(created_at_s=1.0)
    tag = FileName.tag_for("r0", 0, 0)
    assert [p.name for p in list_files(tmp_path)] == [
        f"t-p1-00000000000000000010-00000000000000000014-{tag}.parquet"]
    assert not list((tmp_path / rel).glob(".*.tmp"))
    meta = pq.ParquetFile(tmp_path / stats.path).metadata
    assert meta.num_rows == 5 and meta.num_row_groups == 3
    assert (stats.rows, stats.requests, stats.tokens, stats.generated_tokens) == (5, 5, 60, 40)


def test_leftover_temporaries_are_removed(tmp_path, helpers):
    rel = partition_dir("org/m", 1_700_000_000.0)
    f = OpenFile(tmp_path, rel, "t", 0, row_group_rows=1, row_group_bytes=1 << 30)
    f.add(Row(helpers.make_record("r"), "t", 0, 0, 0, 0.0))  # "crash" before seal
    assert remove_temporaries(tmp_path) == 1
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*"))


def test_discard_removes_the_temporary(tmp_path, helpers):
    rel = partition_dir("org/m", 1_700_000_000.0)
    f = OpenFile(tmp_path, rel, "t", 0, row_group_rows=1, row_group_bytes=1 << 30)
    f.add(Row(helpers.make_record("r"), "t", 0, 0, 0, 0.0))
    f.discard()
    assert not list((tmp_path / rel).iterdir())
