"""``tide data ...``: operator commands over the captured-hidden-state dataset (user data).

Verbs: ``stats`` (files, rows, requests, tokens, bytes, capture-time range, from the index),
``delete REQUEST_ID...`` (rewrite every file holding those requests without their rows: the
deletion a user's data request asks for), ``retention`` (apply ``ingest.retention_*`` now instead
of waiting for ingest's next pass). They work on the dataset folder directly, with or without
ingest running: they hold the dataset lock that ingest's seals share (tide/dataset/lock.py), and
the index records what they deleted, which ingest then never writes again (a replay, the later
chunks of a request still being served).

What deletion does not reach: records still in the Kafka topic (until ``retention.ms`` expires:
``ingest.topic_retention_ms`` on the topics ingest creates) until ingest consumes them, and
drafters already trained on the data (they are not retrained).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable


def add_data_parser(sub, fn: Callable[[argparse.Namespace], int]) -> None:
    p = sub.add_parser("data", help="dataset stats, delete a request's captured data, apply retention")
    p.add_argument("--data-dir", help="the Parquet dataset (default ingest.data_dir or <home>/dataset)")
    verbs = p.add_subparsers(dest="verb", required=True)
    stats = verbs.add_parser("stats", help="files, rows, requests, tokens, bytes, capture-time range")
    delete = verbs.add_parser("delete", help="remove every captured row of these request ids")
    delete.add_argument("request_ids", nargs="+", metavar="REQUEST_ID")
    retention = verbs.add_parser("retention", help="apply ingest.retention_ttl_s / retention_max_bytes now")
    for v in (stats, delete, retention):
        v.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(fn=fn)


def run_data(args: argparse.Namespace, cfg) -> int:
    """Run one verb; prints ``key: value`` lines (``--json``: one JSON object). Exit 1 when
    ``delete`` found none of the requests, 2 (message on stderr) when there is no dataset."""
    from tide.dataset.index import INDEX_NAME, DatasetIndex
    from tide.dataset.retention import apply_retention, delete_request

    data_dir = Path(args.data_dir or cfg.ingest.data_dir or cfg.home_path / "dataset")
    if not (data_dir / INDEX_NAME).exists():
        print(f"error: no dataset at {data_dir} (no {INDEX_NAME}); pass --data-dir", file=sys.stderr)
        return 2
    index = DatasetIndex(data_dir)
    try:
        if args.verb == "stats":
            out = {"data_dir": str(data_dir), **index.summary()}
            for key in ("min_time_s", "max_time_s"):
                if out[key] is not None:
                    out[key.replace("_s", "_utc")] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(out[key]))
            _print(out, args.json)
            return 0
        if args.verb == "delete":
            removed = {rid: delete_request(data_dir, rid, index) for rid in args.request_ids}
            _print({"data_dir": str(data_dir), "rows_removed": removed}, args.json)
            return 0 if any(removed.values()) else 1
        if args.verb == "retention":
            ic = cfg.ingest
            deleted = apply_retention(data_dir, index, ic.retention_ttl_s, ic.retention_max_bytes)
            _print({"data_dir": str(data_dir), "files_deleted": deleted}, args.json)
            return 0
    finally:
        index.close()
    raise AssertionError(args.verb)


def _print(out: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out, indent=1))
        return
    for key, value in out.items():
        print(f"{key}: {json.dumps(value) if isinstance(value, (dict, list)) else value}")
