"""Streaming reader of the dataset for training: samples = whole requests, chunks joined.

``DatasetReader.samples`` steps:
1. choose files: given, or the files of the reader's table version (pinned at construction, the
   newest by default) whose log statistics overlap the capture-time window and target model;
2. stream each file in small record batches (never the whole dataset in memory); a file VACUUM
   removed since the version was written is skipped;
3. keep each chunk until its request's ``chunk_count`` chunks are all seen (chunks of a request
   share a Kafka partition, so they are adjacent in practice); duplicates of a chunk (e.g. a
   producer retry) are ignored;
4. join the chunks in position order and convert stored bf16/fp8 hidden states to float32.
Requests whose chunks never all arrive are skipped and counted in ``incomplete``.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np
import torch

from tide.dataset.location import Location
from tide.dataset.schema import version_changes_of
from tide.dataset.table import DataFile, DatasetTable
from tide.records import hidden_to_float32

log = logging.getLogger(__name__)

_COLUMNS = ["request_id", "target_model_id", "drafter_version", "aux_layer_ids", "workload",
            "started_at_s", "finished_at_s", "position_start", "request_num_tokens",
            "chunk_index", "chunk_count", "hidden_size", "hidden_dtype", "token_ids", "loss_mask",
            "aux_hidden", "final_hidden", "version_changes"]


@dataclass
class Sample:
    """One captured request, ready for an EAGLE3 trainer."""

    request_id: str
    token_ids: torch.Tensor  # int64 [T]
    loss_mask: torch.Tensor  # int64 [T]: 0 prompt, 1 generated
    aux_hidden: torch.Tensor  # float32 [T, 3H]
    final_hidden: torch.Tensor  # float32 [T, H]
    target_model_id: str
    drafter_version: str
    aux_layer_ids: tuple[int, ...]
    workload: str | None
    started_at_s: float
    finished_at_s: float
    position_start: int
    hidden_dtype: str
    # (position, drafter version) for each swap while the request ran (tide.records.Record)
    version_changes: tuple[tuple[int, str], ...] = ()

    def drafter_version_at(self, position: int) -> str:
        """The drafter version that served request position ``position``."""
        version = self.drafter_version
        for start, changed in self.version_changes:
            if start > position:
                break
            version = changed
        return version


class DatasetReader:
    def __init__(self, location: Location | DatasetTable | str | Path, version: int | None = None,
                 max_pending_requests: int = 4096) -> None:
        self.table = location if isinstance(location, DatasetTable) else DatasetTable(location)
        # None: the newest at the first read (then fixed for this reader)
        self.version = version
        self.max_pending_requests = max_pending_requests
        self.incomplete = 0
        self.duplicates = 0
        self.missing_files = 0  # listed in the version's log but gone from storage (vacuumed)

    def files(self, since_s: float | None = None, until_s: float | None = None,
              target_model: str | None = None) -> list[DataFile]:
        """Files of the pinned version overlapping [since_s, until_s) of capture time, oldest first."""
        if self.version is None:
            self.version = self.table.version()
            if self.version is None:
                return []
        return self.table.data_files(self.version, since_s, until_s, target_model)

    def samples(self, files: Iterable[DataFile] | None = None, since_s: float | None = None,
                until_s: float | None = None, target_model: str | None = None,
                batch_rows: int = 8) -> Iterator[Sample]:
        """Complete requests captured in [since_s, until_s), streamed file by file."""
        chosen = list(files) if files is not None else self.files(since_s, until_s, target_model)
        pending: OrderedDict[str, dict[int, dict]] = OrderedDict()
        completed: OrderedDict[str, None] = OrderedDict()  # late duplicates of yielded requests
        for data_file in chosen:
            try:
                parquet = self.table.open_file(data_file.path)
            except FileNotFoundError:  # vacuumed after this version was written
                self.missing_files += 1
                continue
            names = set(parquet.schema_arrow.names)
            for batch in parquet.iter_batches(batch_size=batch_rows, columns=[c for c in _COLUMNS if c in names]):
                for row in batch.to_pylist():
                    if not self._wanted(row, since_s, until_s, target_model):
                        continue
                    if row["request_id"] in completed:
                        self.duplicates += 1
                        continue
                    chunks = pending.setdefault(row["request_id"], {})
                    if row["chunk_index"] in chunks:
                        self.duplicates += 1
                        continue
                    chunks[row["chunk_index"]] = row
                    if len(chunks) == row["chunk_count"]:
                        del pending[row["request_id"]]
                        completed[row["request_id"]] = None
                        if len(completed) > self.max_pending_requests:
                            completed.popitem(last=False)
                        sample = _join(chunks)
                        if sample is None:
                            self.incomplete += 1
                        else:
                            yield sample
                    elif len(pending) > self.max_pending_requests:
                        pending.popitem(last=False)
                        self.incomplete += 1
        self.incomplete += len(pending)

    @staticmethod
    def _wanted(row: dict, since_s: float | None, until_s: float | None,
                target_model: str | None) -> bool:
        t = row["finished_at_s"]
        if since_s is not None and t < since_s:
            return False
        if until_s is not None and t >= until_s:
            return False
        return target_model is None or row["target_model_id"] == target_model


def _join(chunks: dict[int, dict]) -> Sample | None:
    """Chunks in index order -> one sample; None if positions are not contiguous."""
    ordered = [chunks[i] for i in sorted(chunks)]
    first = ordered[0]
    position = first["position_start"]
    for chunk in ordered:
        if chunk["position_start"] != position:
            return None
        position += len(chunk["token_ids"])
    h, dtype = first["hidden_size"], first["hidden_dtype"]
    aux = np.concatenate([hidden_to_float32(c["aux_hidden"], dtype, 3 * h) for c in ordered])
    final = np.concatenate([hidden_to_float32(c["final_hidden"], dtype, h) for c in ordered])
    tokens = np.concatenate([np.asarray(c["token_ids"], dtype=np.int64) for c in ordered])
    mask = np.concatenate([np.asarray(c["loss_mask"], dtype=np.int64) for c in ordered])
    if aux.shape[0] != tokens.shape[0] or final.shape[0] != tokens.shape[0]:
        return None
    return Sample(
        request_id=first["request_id"], token_ids=torch.from_numpy(tokens),
        loss_mask=torch.from_numpy(mask), aux_hidden=torch.from_numpy(aux),
        final_hidden=torch.from_numpy(final), target_model_id=first["target_model_id"],
        drafter_version=first["drafter_version"], aux_layer_ids=tuple(first["aux_layer_ids"]),
        workload=first["workload"], started_at_s=first["started_at_s"],
        finished_at_s=first["finished_at_s"], position_start=first["position_start"],
        hidden_dtype=dtype, version_changes=version_changes_of(first))
