"""Request ids ``tide data delete`` removed, kept for good: a small Delta table beside the data
(``<dataset>/_tide_deleted``, columns ``request_id``, ``deleted_at_s``; the leading underscore
keeps it out of the data table's readers and VACUUM).

Why: chunks of a deleted request may still be in the Kafka topic (until ``retention.ms``) or in a
batch ingest has written but not yet committed. Ingest drops rows of tombstoned ids before each
commit and checks again right after it (``tide/dataset/ingest.py``), and a deletion writes its
tombstones before its DELETE: whichever of the two commits second sees the other, so a deleted
request never reaches a later table version. Retrain windows skip tombstoned ids too, so a
retrain pinned to a version from before the deletion does not train on it either.
"""
from __future__ import annotations

import time
from typing import Iterable

import pyarrow as pa

from tide.dataset.location import TOMBSTONES, Location

SCHEMA = pa.schema([("request_id", pa.string()), ("deleted_at_s", pa.float64())])


class Tombstones:
    def __init__(self, location: Location) -> None:
        self.location = location.child(TOMBSTONES)
        self._table = None
        self._ids: set[str] = set()
        self._version = -1

    def _exists(self) -> bool:
        from deltalake import DeltaTable

        return DeltaTable.is_deltatable(self.location.uri, storage_options=self.location.options)

    def add(self, request_ids: Iterable[str], at_s: float | None = None) -> None:
        from deltalake import write_deltalake
        from deltalake.exceptions import CommitFailedError

        ids = sorted(set(request_ids))
        if not ids:
            return
        at_s = time.time() if at_s is None else at_s
        rows = pa.table({"request_id": ids, "deleted_at_s": [at_s] * len(ids)}, schema=SCHEMA)
        for attempt in range(20):
            try:
                write_deltalake(self.location.uri, rows, mode="append", storage_options=self.location.options)
                return
            except CommitFailedError:  # two first deletions created the table at once: append again
                time.sleep(min(1.0, 0.02 * 2 ** attempt))
        raise RuntimeError(f"could not record deleted requests in {self.location.uri}")

    def ids(self) -> set[str]:
        """Every tombstoned id (the table is re-read only when it has a new version)."""
        from deltalake import DeltaTable

        if self._table is None:
            if not self._exists():
                return set()
            self._table = DeltaTable(self.location.uri, storage_options=self.location.options)
        else:
            self._table.update_incremental()
        if self._table.version() != self._version:
            self._ids = set(pa.table(self._table.to_pyarrow_table(columns=["request_id"])).column(0).to_pylist())
            self._version = self._table.version()
        return set(self._ids)

    def among(self, request_ids: Iterable[str]) -> set[str]:
        return self.ids() & set(request_ids)
