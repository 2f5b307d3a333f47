"""``tide data``: stats, delete a request's rows (a user's deletion request), retention now."""
import json

from tide.cli import main
from tide.dataset.index import DatasetIndex
from tide.dataset.reader import DatasetReader


def _run(capsys, tmp_path, *argv) -> tuple[int, dict | str]:
    code = main(["--home", str(tmp_path / "home"), "data", "--data-dir", str(tmp_path / "ds"), *argv, "--json"])
    out, err = capsys.readouterr()
    try:
        return code, json.loads(out)
    except json.JSONDecodeError:
        return code, out + err


def test_stats_delete_and_retention(tmp_path, capsys, helpers):
    ds = tmp_path / "ds"
    index = DatasetIndex(ds)
    t0 = 1_700_000_000.0
    recs = [helpers.make_record("keep", at_s=t0, seed=1), helpers.make_record("user-42", at_s=t0, t=40, seed=2)]
    stats, rids = helpers.write_file(ds, recs, max_message_bytes=2000)
    index.add(stats, rids)
    index.close()

    code, out = _run(capsys, tmp_path, "stats")
    assert code == 0 and out["files"] == 1 and out["requests"] == 2 and out["min_time_utc"].startswith("2023-11-14")

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
    index = DatasetIndex(ds)
    stats, rids = helpers.write_file(ds, [helpers.make_record("r1", at_s=1_700_000_000.0, seed=1)],
                                     max_message_bytes=2000)
    index.add(stats, rids)
    index.close()
    code = main(["--home", str(tmp_path / "home"), "data", "--data-dir", str(ds), "stats"])
    lines = capsys.readouterr().out.splitlines()
    assert code == 0 and "requests: 1" in lines and "files: 1" in lines
