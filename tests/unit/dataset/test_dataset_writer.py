"""Data files stream row groups into the table folder and stay invisible until committed; a
discarded or uncommitted file holds user data and is removed (discard now, VACUUM later)."""
import pyarrow.parquet as pq

from tide.dataset.location import Location
from tide.dataset.reader import DatasetReader
from tide.dataset.retention import vacuum
from tide.dataset.schema import Row, partition_values
from tide.dataset.table import DatasetTable
from tide.dataset.tombstones import Tombstones
from tide.dataset.writer import DataFileWriter

T0 = 1_700_000_000.0


def _writer(tmp_path, row_group_rows=2):
    table = DatasetTable(tmp_path)
    table.ensure()
    return table, DataFileWriter(Location.from_uri(tmp_path), partition_values(T0), row_group_rows, 1 << 30)


def test_rows_stream_into_an_uncommitted_file_then_commit(tmp_path, helpers):
    table, f = _writer(tmp_path)
    for i in range(5):
        f.add(Row(helpers.make_record(f"r{i}", seed=i), "t", 1, 10 + i, 0, 0.0))
    # two row groups already written, but no reader sees the file before its commit
    written = list((tmp_path / "date=2023-11-14" / "hour=22").glob("part-*.parquet"))
    assert len(written) == 1 and written[0].stat().st_size > 0
    assert table.data_files() == [] and list(DatasetReader(tmp_path).samples()) == []
    out = f.finish()
    assert pq.ParquetFile(written[0]).metadata.num_row_groups == 3
    table.append([out.add], out.counts)
    (only,) = table.data_files()
    assert only.path == out.add.path and only.rows == 5 and (only.min_time_s, only.max_time_s) == (T0, T0)
    assert out.counts == {"org/m": {"rows": 5, "requests": 5, "tokens": 60, "generated_tokens": 40}}


def test_discard_removes_the_file(tmp_path, helpers):
    _, f = _writer(tmp_path, row_group_rows=1)
    f.add(Row(helpers.make_record("r"), "t", 0, 0, 0, 0.0))
    f.discard()
    assert not list(tmp_path.rglob("part-*.parquet"))


def test_vacuum_removes_a_file_a_crash_left_uncommitted(tmp_path, helpers):
    table, f = _writer(tmp_path, row_group_rows=1)
    f.add(Row(helpers.make_record("r"), "t", 0, 0, 0, 0.0))
    f.finish()  # "crash" before the commit: the file exists, the log does not name it
    helpers.write_file(tmp_path, [helpers.make_record("kept")], first_offset=1)
    assert len(list(tmp_path.rglob("part-*.parquet"))) == 2
    tombstones = Tombstones(table.location)
    tombstones.add(["deleted-before"])
    vacuum(table, retention_hours=0)
    assert len(list(tmp_path.rglob("part-*.parquet"))) == 2  # the second is the tombstones' file
    assert [s.request_id for s in DatasetReader(tmp_path).samples()] == ["kept"]
    assert Tombstones(table.location).ids() == {"deleted-before"}  # VACUUM leaves them alone
