"""``tide data``: stats, delete a request's rows (a user's deletion request), retention, compact,
migrate a Parquet + SQLite dataset from before the table."""
import json
import sqlite3

import pyarrow as pa
import pyarrow.parquet as pq

from tide.cli import main
from tide.dataset.reader import DatasetReader
from tide.dataset.schema import PARQUET_SCHEMA, Row, rows_to_table


def _run(capsys, tmp_path, *argv) -> tuple[int, dict | str]:
    code = main(["--home", str(tmp_path / "home"), "data", "--data-dir", str(tmp_path / "ds"), *argv, "--json"])
    out, err = capsys.readouterr()
    try:
        return code, json.loads(out)
    except json.JSONDecodeError:
        return code, out + err


def test_stats_delete_and_retention(tmp_path, capsys, helpers):
    ds = tmp_path / "ds"
    t0 = 1_700_000_000.0
    recs = [helpers.make_record("keep", at_s=t0, seed=1), helpers.make_record("user-42", at_s=t0, t=40, seed=2)]
    helpers.write_file(ds, recs, max_message_bytes=2000)

    code, out = _run(capsys, tmp_path, "stats")
    assert code == 0 and out["files"] == 1 and out["requests"] == 2 and out["min_time_utc"].startswith("2023-11-14")
    assert out["version"] == 1

    code, out = _run(capsys, tmp_path, "delete", "user-42", "never-seen")
    assert code == 0 and out["rows_removed"]["user-42"] > 1 and out["rows_removed"]["never-seen"] == 0
    assert {s.request_id for s in DatasetReader(ds).samples()} == {"keep"}
    code, out = _run(capsys, tmp_path, "delete", "user-42")  # nothing left to delete: says so
    assert code == 1 and out["rows_removed"] == {"user-42": 0}

    code, out = _run(capsys, tmp_path, "retention")  # the default 7-day TTL has long expired
    assert code == 0 and len(out["files_deleted"]) == 1
    assert _run(capsys, tmp_path, "stats")[1]["files"] == 0


def test_no_dataset_is_a_clear_error(tmp_path, capsys):
    code = main(["--home", str(tmp_path / "home"), "data", "--data-dir", str(tmp_path / "ds"), "stats", "--json"])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and "no dataset at" in err and not (tmp_path / "ds").exists()


def test_text_output_names_each_field(tmp_path, capsys, helpers):
    ds = tmp_path / "ds"
    helpers.write_file(ds, [helpers.make_record("r1", at_s=1_700_000_000.0, seed=1)], max_message_bytes=2000)
    code = main(["--home", str(tmp_path / "home"), "data", "--data-dir", str(ds), "stats"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and "requests: 1" in lines and "files: 1" in lines


def _old_dataset(old, helpers) -> None:
    """The layout before the table: hive folders with a model level, uint8 masks, a SQLite index
    that remembers a deleted request."""
    t0 = 1_700_000_000.0
    uint8 = pa.schema([f if f.name != "loss_mask" else pa.field("loss_mask", pa.list_(pa.uint8()))
                       for f in PARQUET_SCHEMA])
    for k, rids in enumerate([["a", "gone"], ["b"]]):
        rows = [Row(helpers.make_record(r, at_s=t0 + 7200 * k, seed=i), "t", 0, 10 * k + i, 0, t0)
                for i, r in enumerate(rids)]
        folder = old / "target_model=org%2Fm" / f"date=2023-11-1{4 + k}" / "hour=22"
        folder.mkdir(parents=True)
        pq.write_table(rows_to_table(rows).cast(uint8), folder / f"t-p0-{k:020d}-{k:020d}-00000000.parquet")
    db = sqlite3.connect(old / "index.sqlite")
    db.execute("CREATE TABLE deleted_requests (request_id TEXT PRIMARY KEY, deleted_at_s REAL NOT NULL)")
    db.execute("INSERT INTO deleted_requests VALUES ('gone', 1.0)")
    db.commit()
    db.close()


def test_migrate_copies_an_old_dataset_once_and_keeps_deleted_requests_out(tmp_path, capsys, helpers):
    old = tmp_path / "old"
    _old_dataset(old, helpers)
    code, out = _run(capsys, tmp_path, "migrate", str(old))
    assert code == 0 and (out["files_migrated"], out["rows"], out["deleted_requests_kept_out"]) == (2, 2, 1)
    assert sorted(s.request_id for s in DatasetReader(tmp_path / "ds").samples()) == ["a", "b"]
    code, out = _run(capsys, tmp_path, "migrate", str(old))  # a re-run copies nothing twice
    assert code == 0 and out["files_already_migrated"] == 2
    assert _run(capsys, tmp_path, "stats")[1]["rows"] == 2
    # the deleted request stays deleted: ingest's tombstones name it
    from tide.dataset.location import Location
    from tide.dataset.tombstones import Tombstones
    assert Tombstones(Location.from_uri(tmp_path / "ds")).ids() == {"gone"}
