"""``tide data ...``: operator commands over the captured-hidden-state dataset (user data).

Verbs: ``stats`` (table version, files, rows, requests, tokens, bytes, capture-time range),
``delete REQUEST_ID...`` (a Delta DELETE of every row of those requests, with the ids tombstoned
so ingest never writes them again: the deletion a user's data request asks for), ``retention``
(``ingest.retention_*`` now: DELETE + VACUUM, instead of waiting for the scheduler's next pass),
``compact`` (merge small files of settled hours now), ``migrate OLD_DIR`` (a Parquet + SQLite
dataset from before the table into it). They work on the table directly, with or without ingest
running: Delta serialises them with ingest's commits (tide/dataset/retention.py says how).

What deletion does not reach: records still in the Kafka topic (until ``retention.ms`` expires:
``ingest.topic_retention_ms`` on the topics ingest creates; ingest drops them when it consumes
them), files older table versions still reference until VACUUM (``ingest.vacuum_retention_hours``),
and drafters already trained on the data (they are not retrained).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Callable


def add_data_parser(sub, fn: Callable[[argparse.Namespace], int]) -> None:
    p = sub.add_parser("data", help="dataset stats, delete a request's captured data, apply retention")
    p.add_argument("--data-dir", help="the dataset table: a directory or s3://bucket/prefix "
                                      "(default ingest.data_dir or <home>/dataset)")
    verbs = p.add_subparsers(dest="verb", required=True)
    stats = verbs.add_parser("stats", help="version, files, rows, requests, tokens, bytes, capture-time range")
    delete = verbs.add_parser("delete", help="remove every captured row of these request ids")
    delete.add_argument("request_ids", nargs="+", metavar="REQUEST_ID")
    retention = verbs.add_parser("retention", help="apply ingest.retention_ttl_s / retention_max_bytes now")
    compact = verbs.add_parser("compact", help="merge the small files of hours that have ended")
    migrate = verbs.add_parser("migrate", help="copy a Parquet + SQLite dataset (older layout) into the table")
    migrate.add_argument("old_dir", metavar="OLD_DIR")
    for v in (stats, delete, retention, compact, migrate):
        v.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=fn)


def run_data(args: argparse.Namespace, cfg) -> int:
    """Run one verb; prints ``key: value`` lines (``--json``: one JSON object). Exit 1 when
    ``delete`` found none of the requests, 2 (message on stderr) when there is no dataset."""
    from tide.dataset.location import Location
    from tide.dataset.retention import apply_retention, compact, delete_requests
    from tide.dataset.table import DatasetTable

    table = DatasetTable(Location.from_config(cfg, args.data_dir))
    where = {"data_dir": table.uri}
    if args.verb == "migrate":
        from tide.dataset.migrate import migrate

        _print({**where, **migrate(args.old_dir, table)}, args.json)
        return 0
    if not table.exists():
        print(f"error: no dataset at {table.uri} (no Delta table); pass --data-dir", file=sys.stderr)
        return 2
    ic = cfg.ingest
    if args.verb == "stats":
        out = {**where, **table.summary()}
        for key in ("min_time_s", "max_time_s"):
            if out[key] is not None:
                out[key.replace("_s", "_utc")] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(out[key]))
        _print(out, args.json)
        return 0
    if args.verb == "delete":
        removed = delete_requests(table, args.request_ids)
        _print({**where, "rows_removed": removed, "version": table.version()}, args.json)
        return 0 if any(removed.values()) else 1
    if args.verb == "retention":
        deleted = apply_retention(table, ic.retention_ttl_s, ic.retention_max_bytes,
                                  vacuum_retention_hours=ic.vacuum_retention_hours)
        _print({**where, "files_deleted": deleted, "version": table.version()}, args.json)
        return 0
    if args.verb == "compact":
        removed = compact(table, ic.compact_target_bytes, time.time() - ic.roll_interval_s)
        _print({**where, "files_compacted": removed, "version": table.version()}, args.json)
        return 0
    raise AssertionError(args.verb)


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for key, value in out.items():
        print(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
