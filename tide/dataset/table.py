"""The dataset: one Delta Lake table (delta-rs, the ``deltalake`` package) at a ``Location``.

Writers (ingest, ``log_samples``, ``tide data migrate``) stream Parquet files into the table's
``date=/hour=`` folders themselves and commit them as add actions (``append``): each commit may
carry a Delta application transaction (ingest: app id = consumer group/topic/partition, version =
the batch's last Kafka offset) and commit metadata ``tide.counts`` (rows, requests, tokens,
generated tokens per target model). A commit that loses a race (a concurrent DELETE it read past,
or another writer of the same app id) is retried on the newer version: files already written are
committed again, never rewritten; the app id's recorded version is checked first, so a batch whose
offsets are already in the table is never committed twice (``Stale``).

Readers pin a version: ``data_files`` lists the files of that version from the log (path, size,
rows, partition, min/max capture time and model from the add actions' statistics), never by
listing storage; ``counts_since`` sums the commit metadata of later versions (the scheduler's
new samples); ``summary`` adds up the log and, for request and token totals, small columns.
"""
from __future__ import annotations

import json
import logging
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tide.dataset.location import Location
from tide.dataset.schema import PARTITION_COLUMNS, TABLE_SCHEMA, partition_start_s

log = logging.getLogger(__name__)

COUNTS_KEY = "tide.counts"  # commit metadata: {target model: {rows, requests, tokens, generated_tokens}}
COUNT_UNITS = ("rows", "requests", "tokens", "generated_tokens")
_COMMIT_ATTEMPTS = 20
TABLE_NAME = "tide_captures"


class Stale(Exception):
    """The batch does not start right after the app id's recorded version: another writer (a
    replica that owned the partition before a rebalance) committed some of its offsets, or offsets
    before it are missing (a batch still in flight after its replica rewound or lost the
    partition: committing it would leave a hole no replay fills). ``.version`` says where the
    table is: consume again from the offset after it."""

    def __init__(self, app_id: str, version: int) -> None:
        super().__init__(f"{app_id} already at offset {version}")
        self.app_id, self.version = app_id, version


@dataclass(frozen=True)
class DataFile:
    """One data file of a table version, as the log describes it."""

    path: str  # relative to the table root, decoded
    size: int
    rows: int
    min_time_s: float
    max_time_s: float
    min_model: str | None
    max_model: str | None


def empty_counts() -> dict[str, int]:
    return dict.fromkeys(COUNT_UNITS, 0)


class DatasetTable:
    def __init__(self, location: Location | str | Path) -> None:
        self.location = location if isinstance(location, Location) else Location.from_uri(location)
        self._writer = None  # DeltaTable kept by a writer, refreshed before each commit
        self._counts: dict[int, dict[str, dict[str, int]]] = {}  # version -> its commit's counts
        self._committed_s: dict[int, float] = {}  # version -> its commit's time (unix s)

    @property
    def uri(self) -> str:
        return self.location.uri

    def exists(self) -> bool:
        from deltalake import DeltaTable

        return DeltaTable.is_deltatable(self.uri, storage_options=self.location.options)

    def ensure(self) -> None:
        """Create the table if it does not exist (two replicas may race: one creates it)."""
        from deltalake import DeltaTable

        if self.exists():
            return
        if not self.location.remote:
            Path(self.uri).mkdir(parents=True, exist_ok=True)
        try:
            DeltaTable.create(self.uri, TABLE_SCHEMA, mode="ignore", partition_by=list(PARTITION_COLUMNS),
                              name=TABLE_NAME, description="TIDE captured hidden states, one row per record chunk",
                              storage_options=self.location.options)
        except Exception:  # created concurrently: fine when it is there now
            if not self.exists():
                raise

    def delta(self, version: int | None = None):
        """A DeltaTable at ``version`` (None: the newest)."""
        from deltalake import DeltaTable

        return DeltaTable(self.uri, version=version, storage_options=self.location.options)

    def version(self) -> int | None:
        """The newest version, None when there is no table yet."""
        return self.delta().version() if self.exists() else None

    # --- writing ----------------------------------------------------------------------------
    def writable(self):
        if self._writer is None:
            self.ensure()
            self._writer = self.delta()
        else:
            self._writer.update_incremental()
        return self._writer

    def app_version(self, app_id: str) -> int | None:
        """The last offset the table records for ``app_id`` (None: nothing committed yet)."""
        return self.writable().transaction_version(app_id)

    def append(self, adds: list, counts: dict[str, dict[str, int]] | None = None,
               app_id: str | None = None, recorded_before: int = -1, last_offset: int = 0,
               metadata: dict[str, str] | None = None, also: dict[str, int] | None = None) -> int:
        """Commit ``adds`` (AddActions of files already written); returns the new version.
        With ``app_id``: Stale unless the app's recorded offset is ``recorded_before`` (the batch's
        first offset - 1; any when none is recorded): an app's offsets reach the table in order,
        without holes, and a recreated topic's first batch replaces the old topic's offset. ``also``:
        more application transactions recorded in the same commit, unchecked."""
        from deltalake import CommitProperties, Transaction
        from deltalake.exceptions import CommitFailedError

        custom = {COUNTS_KEY: json.dumps(counts or {}), **(metadata or {})}
        txns = ([Transaction(app_id, last_offset)] if app_id else []) + [Transaction(a, v) for a, v in (also or {}).items()]
        for attempt in range(_COMMIT_ATTEMPTS):
            dt = self.writable()
            if app_id is not None:
                done = dt.transaction_version(app_id)
                if done is not None and done != recorded_before:
                    raise Stale(app_id, done)
            try:
                dt.create_write_transaction(adds, "append", TABLE_SCHEMA, partition_by=list(PARTITION_COLUMNS),
                                            commit_properties=CommitProperties(custom_metadata=custom,
                                                                               app_transactions=txns or None))
            except CommitFailedError as exc:  # a concurrent delete or writer of this app id won
                log.info("dataset: commit lost a race (%s); retrying on the new version", exc)
                time.sleep(min(1.0, 0.02 * 2 ** attempt))
                continue
            dt.update_incremental()
            return dt.version()
        raise RuntimeError(f"dataset: could not commit to {self.uri} after {_COMMIT_ATTEMPTS} attempts")

    # --- reading ----------------------------------------------------------------------------
    def data_files(self, version: int | None = None, since_s: float | None = None,
                   until_s: float | None = None, target_model: str | None = None) -> list[DataFile]:
        """Files of ``version`` that may hold rows captured in [since_s, until_s) of
        ``target_model``, oldest newest-capture first (from the log: no file is opened)."""
        actions = pa.table(self.delta(version).get_add_actions(flatten=True))
        out = []
        for a in actions.to_pylist():
            lo, hi = _time_bounds(a)
            f = DataFile(urllib.parse.unquote(a["path"]), a["size_bytes"], a["num_records"] or 0, lo, hi,
                         a.get("min.target_model_id"), a.get("max.target_model_id"))
            if since_s is not None and f.max_time_s < since_s:
                continue
            if until_s is not None and f.min_time_s >= until_s:
                continue
            if target_model is not None and f.min_model is not None and \
                    not (f.min_model <= target_model <= (f.max_model or f.min_model)):
                continue
            out.append(f)
        return sorted(out, key=lambda f: (f.max_time_s, f.path))

    def open_file(self, path: str) -> pq.ParquetFile:
        """A data file for reading (FileNotFoundError once vacuumed)."""
        fs, root = self.location.filesystem()
        return pq.ParquetFile(fs.open_input_file(f"{root}/{path}"))

    def counts_since(self, version: int | None, target_model: str | None = None,
                     upto: int | None = None, committed_since_s: float | None = None) -> dict[str, int]:
        """Sums of the ``tide.counts`` commit metadata of versions in (version, upto]
        (``version`` None: from the first; ``upto`` None: the newest), with ``committed_since_s``
        only of those committed at or after that unix time; log files only."""
        latest = self.version() if upto is None else upto
        total = empty_counts()
        if latest is None:
            return total
        start = -1 if version is None else version
        missing = [v for v in range(start + 1, latest + 1) if v not in self._counts]
        if missing:
            for entry in self.delta(latest).history(limit=latest - min(missing) + 1):
                v = entry.get("version")
                if v is not None and v not in self._counts:
                    self._counts[v] = _parse_counts(entry.get(COUNTS_KEY))
                    # a commit without a time counts wherever a time bound is asked (never under-counted)
                    self._committed_s[v] = float(entry.get("timestamp", float("inf"))) / 1000.0
        for v in range(start + 1, latest + 1):
            if committed_since_s is not None and self._committed_s.get(v, float("inf")) < committed_since_s:
                continue
            for model, counts in self._counts.get(v, {}).items():
                if target_model is None or model == target_model:
                    for unit in COUNT_UNITS:
                        total[unit] += int(counts.get(unit, 0))
        return total

    def summary(self, version: int | None = None, exact: bool = True) -> dict:
        """Files, rows, bytes and capture-time range from the log; with ``exact``, requests,
        tokens and generated tokens from the files' small columns."""
        if not self.exists():
            out = {"version": None, "files": 0, "rows": 0, "bytes": 0, "min_time_s": None, "max_time_s": None}
            return {**out, "requests": 0, "tokens": 0, "generated_tokens": 0}
        dt = self.delta(version)
        files = self.data_files(dt.version())
        out = {"version": dt.version(), "files": len(files), "rows": sum(f.rows for f in files),
               "bytes": sum(f.size for f in files),
               "min_time_s": min((f.min_time_s for f in files), default=None),
               "max_time_s": max((f.max_time_s for f in files), default=None)}
        if exact:
            out.update(self._small_totals(files))
        return out

    def _small_totals(self, files: list[DataFile]) -> dict[str, int]:
        requests: set[str] = set()
        tokens = generated = 0
        for f in files:
            try:
                table = self.open_file(f.path).read(columns=["request_id", "num_tokens", "loss_mask"])
            except FileNotFoundError:
                continue
            requests.update(table.column("request_id").to_pylist())
            tokens += int(pa.compute.sum(table.column("num_tokens")).as_py() or 0)
            generated += int(pa.compute.sum(pa.compute.list_flatten(table.column("loss_mask"))).as_py() or 0)
        return {"requests": len(requests), "tokens": tokens, "generated_tokens": generated}


def _time_bounds(action: dict) -> tuple[float, float]:
    """Capture-time bounds of a file: its statistics, else its date/hour partition."""
    lo, hi = action.get("min.finished_at_s"), action.get("max.finished_at_s")
    if lo is not None and hi is not None:
        return float(lo), float(hi)
    start = partition_start_s({k: action[f"partition.{k}"] for k in PARTITION_COLUMNS})
    return start, start + 3600.0


def _parse_counts(text) -> dict[str, dict[str, int]]:
    if not text:
        return {}
    try:
        value = json.loads(text) if isinstance(text, str) else text
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
