"""``tide data migrate OLD_DIR``: a Parquet + SQLite dataset (the layout before the Delta table)
into the table.

Steps, per old data file (``target_model=*/date=*/hour=*/<name>.parquet``; dot-prefixed
temporaries are skipped): read it, drop the rows of requests its ``index.sqlite`` lists as deleted
(and tombstone them in the table, so ingest never writes them back), cast the loss mask to int8,
split the rows by capture date/hour and commit them as one append whose application transaction
is ``tide-migrate/<the file's path>``: a re-run (after an interruption) skips files already
migrated. The old folder is left untouched; delete it once ``tide data stats`` agrees.
"""
from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from tide.dataset.schema import PARQUET_SCHEMA, partition_path, partition_values
from tide.dataset.table import DatasetTable, Stale
from tide.dataset.tombstones import Tombstones
from tide.dataset.writer import add_counts_all, write_file

log = logging.getLogger(__name__)


def _deleted_ids(old_dir: Path) -> set[str]:
    path = old_dir / "index.sqlite"
    if not path.exists():
        return set()
    db = sqlite3.connect(f"file:{path.resolve()}?mode=ro", uri=True)
    try:
        return {r[0] for r in db.execute("SELECT request_id FROM deleted_requests")}
    except sqlite3.Error:  # an index from before deletions were recorded
        return set()
    finally:
        db.close()


def old_files(old_dir: Path) -> list[Path]:
    return sorted(p for p in old_dir.glob("target_model=*/date=*/hour=*/*.parquet") if not p.name.startswith("."))


def _conform(table: pa.Table) -> pa.Table:
    """Old files: uint8 loss mask, maybe no version_changes column."""
    columns = []
    for field in PARQUET_SCHEMA:
        if field.name in table.column_names:
            columns.append(table.column(field.name).cast(field.type))
        else:
            columns.append(pa.nulls(table.num_rows, field.type))
    return pa.Table.from_arrays(columns, schema=PARQUET_SCHEMA)


def migrate(old_dir: str | Path, table: DatasetTable) -> dict:
    """Copy every old data file into ``table``; returns files migrated/skipped and rows."""
    old_dir = Path(old_dir)
    deleted = _deleted_ids(old_dir)
    table.ensure()
    Tombstones(table.location).add(deleted)
    migrated = skipped = rows = 0
    for path in old_files(old_dir):
        rel = str(path.relative_to(old_dir))
        data = _conform(pq.read_table(path))
        if deleted:
            data = data.filter(pc.invert(pc.is_in(data.column("request_id"), pa.array(sorted(deleted), pa.string()))))
        hours: dict[str, list[int]] = {}
        for i, t in enumerate(data.column("finished_at_s").to_pylist()):
            hours.setdefault(partition_path(partition_values(t)), []).append(i)
        outs = [write_file(table.location, data.take(idx), partition_values(data.column("finished_at_s")[idx[0]].as_py()))
                for idx in hours.values()]
        counts: dict = {}
        for out in outs:
            add_counts_all(counts, out.counts)
        try:
            table.append([o.add for o in outs], counts, app_id=f"tide-migrate/{rel}", last_offset=0)
        except Stale:  # migrated by an earlier run: its copies stay orphans for VACUUM
            skipped += 1
            continue
        migrated += 1
        rows += data.num_rows
    log.info("dataset: migrated %d files (%d rows), %d already there", migrated, rows, skipped)
    return {"files_migrated": migrated, "files_already_migrated": skipped, "rows": rows,
            "deleted_requests_kept_out": len(deleted)}
