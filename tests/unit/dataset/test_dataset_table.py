"""The table's log answers what the scheduler and the window need without opening data files;
application transactions make a batch's offsets count once; a second process sees commits."""
import subprocess
import sys
import time

import pytest

from tide.dataset.location import Location
from tide.dataset.schema import Row, partition_values
from tide.dataset.table import DatasetTable, Stale
from tide.dataset.writer import DataFileWriter

T0 = 1_700_000_000.0


def test_summary_files_and_windows_from_the_log(tmp_path, helpers):
    for i in range(3):
        helpers.write_file(tmp_path, [helpers.make_record(f"r{i}", at_s=T0 + 3600 * i)], first_offset=i)
    table = DatasetTable(tmp_path)
    total = table.summary()
    assert (total["files"], total["rows"], total["tokens"], total["generated_tokens"]) == (3, 3, 36, 24)
    assert total["version"] == 3 and total["min_time_s"] == T0 and total["max_time_s"] == T0 + 7200
    assert [f.max_time_s for f in table.data_files()] == [T0, T0 + 3600, T0 + 7200]
    assert len(table.data_files(since_s=T0 + 3600)) == 2
    assert len(table.data_files(until_s=T0 + 1)) == 1
    assert table.data_files(target_model="other") == []
    assert len(table.data_files(version=1)) == 1  # a pinned version: what it held then


def test_counts_since_a_version_come_from_commit_metadata(tmp_path, helpers):
    helpers.write_file(tmp_path, [helpers.make_record("a"), helpers.make_record("b", t=5)])
    helpers.write_file(tmp_path, [helpers.make_record("c", model="org/other")], first_offset=5)
    table = DatasetTable(tmp_path)
    assert table.counts_since(None) == {"rows": 3, "requests": 3, "tokens": 29, "generated_tokens": 17}
    assert table.counts_since(1) == {"rows": 1, "requests": 1, "tokens": 12, "generated_tokens": 8}
    assert table.counts_since(1, target_model="org/m")["rows"] == 0
    assert table.counts_since(2)["rows"] == 0
    # the counts are in the log: deleting every data file does not change them
    for f in table.data_files():
        (tmp_path / f.path).unlink()
    assert DatasetTable(tmp_path).counts_since(None)["rows"] == 3


def test_counts_since_a_commit_time_leave_out_earlier_commits(tmp_path, helpers):
    """A shift's retrain counts only what was committed since its new traffic began."""
    helpers.write_file(tmp_path, [helpers.make_record("a"), helpers.make_record("b", t=5)])
    time.sleep(0.05)  # commit times are the log's milliseconds
    between_s = time.time()
    time.sleep(0.05)
    helpers.write_file(tmp_path, [helpers.make_record("c", model="org/other")], first_offset=5)
    table = DatasetTable(tmp_path)
    assert table.counts_since(None, committed_since_s=between_s) == table.counts_since(1)
    assert table.counts_since(None, committed_since_s=time.time() + 60)["rows"] == 0
    assert table.counts_since(None, committed_since_s=0.0)["rows"] == 3


def test_chunked_requests_count_once(tmp_path, helpers):
    helpers.write_file(tmp_path, [helpers.make_record("long", t=40)], max_message_bytes=1500)
    counts = DatasetTable(tmp_path).counts_since(None)
    assert counts["rows"] > 1 and counts["requests"] == 1 and counts["tokens"] == 40


def test_an_app_transaction_never_commits_offsets_twice(tmp_path, helpers):
    _, v = helpers.write_file(tmp_path, [helpers.make_record("a")], first_offset=0, app_id="g/t/0")
    table = DatasetTable(tmp_path)
    assert table.app_version("g/t/0") == 0 and table.app_version("g/t/1") is None
    out, _ = helpers.write_file(tmp_path, [helpers.make_record("b")], first_offset=1, app_id="g/t/0")
    with pytest.raises(Stale) as stale:  # a replica that lost the partition tries offsets 1..1 again
        table.append([out.add], out.counts, "g/t/0", 0, 1)
    assert stale.value.version == 1 and table.summary()["rows"] == 2


def test_an_app_transaction_never_leaves_a_hole(tmp_path, helpers):
    """A batch that does not follow the recorded offset (one still in flight after its replica
    rewound past a stale batch, or lost the partition) is refused: committing it would move the
    recorded offset past offsets no replica has written, and every replay would skip them."""
    helpers.write_file(tmp_path, [helpers.make_record("a")], first_offset=0, app_id="g/t/0")
    table = DatasetTable(tmp_path)
    with pytest.raises(Stale) as hole:  # offsets 1..4 of g/t/0 are nowhere yet
        helpers.write_file(tmp_path, [helpers.make_record("c")], first_offset=5, app_id="g/t/0")
    assert hole.value.version == 0 and table.app_version("g/t/0") == 0 and table.summary()["rows"] == 1
    helpers.write_file(tmp_path, [helpers.make_record(f"b{i}") for i in range(4)], first_offset=1, app_id="g/t/0")
    helpers.write_file(tmp_path, [helpers.make_record("c")], first_offset=5, app_id="g/t/0")  # now it follows
    assert table.app_version("g/t/0") == 5 and table.summary()["rows"] == 6


def test_a_recreated_topics_first_batch_replaces_the_old_offset_once(tmp_path, helpers):
    """A recreated topic starts at offset 0 below the offset the table records from the old one:
    its first batch names the old offset it replaces, and only that (a second replica's copy of it,
    or a zombie's, is refused once the new offsets are recorded)."""
    helpers.write_file(tmp_path, [helpers.make_record(f"old{i}") for i in range(12)], first_offset=0, app_id="g/t/0")
    table = DatasetTable(tmp_path)
    assert table.app_version("g/t/0") == 11
    new = DataFileWriter(Location.from_uri(tmp_path), partition_values(T0), 2, 1 << 30)
    for offset in range(3):
        new.add(Row(helpers.make_record(f"new{offset}"), "t", 0, offset, 0, T0))
    out = new.finish()
    with pytest.raises(Stale):  # offset 0 does not follow 11: not without naming the offset it replaces
        table.append([out.add], out.counts, "g/t/0", -1, 2)
    table.append([out.add], out.counts, "g/t/0", 11, 2)  # new offsets 0..2 replace 11
    assert table.app_version("g/t/0") == 2
    with pytest.raises(Stale) as stale:  # the same batch again, by a replica that still read 11
        table.append([out.add], out.counts, "g/t/0", 11, 2)
    assert stale.value.version == 2


def test_second_process_sees_committed_versions(tmp_path, helpers):
    helpers.write_file(tmp_path, [helpers.make_record("x")])
    code = ("import sys; from tide.dataset.table import DatasetTable; "
            "print(DatasetTable(sys.argv[1]).summary()['rows'])")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"
