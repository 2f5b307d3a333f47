"""Target states written into the dataset table exactly as capture + ingest would write them.

Tests, benches and the shift experiment need logged traffic without running an engine, a broker
and an ingest service. ``log_samples`` takes trainer ``Sample``s (e.g. from
``tide.train.offline.generate_samples``) and, per sample:
1. builds the capture ``Record`` (bfloat16 states, loss mask 0 on the prompt, 1 on generated
   positions), splits it into chunks under ``max_message_bytes`` like the producer, and sends
   each chunk through ``encode``/``decode`` like the broker round trip;
2. appends the chunks as Kafka-like rows (consecutive offsets of one topic partition) to the
   dataset's data files (``DataFileWriter``), one per ``date=/hour=`` partition;
3. commits each file to the table (one table version per file), as ingest commits a batch.
"""
from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from tide.dataset.location import Location
from tide.dataset.schema import Row, partition_path, partition_values
from tide.dataset.table import DatasetTable
from tide.dataset.writer import DataFileWriter
from tide.records import Record, decode, encode, hidden_bytes, split
from tide.train.trainer import Sample


def sample_record(sample: Sample, request_id: str, prompt_len: int, finished_at_s: float,
                  target_model_id: str, aux_layer_ids: tuple[int, ...], workload: str | None = None,
                  drafter_version: str = "static", hidden_dtype: str = "bfloat16") -> Record:
    """The capture record of one request whose first ``prompt_len`` positions were the prompt."""
    t = len(sample)
    mask = (torch.arange(t) >= prompt_len).to(torch.uint8)
    return Record(
        request_id=request_id, target_model_id=target_model_id, drafter_version=drafter_version,
        aux_layer_ids=tuple(aux_layer_ids), workload=workload, started_at_s=finished_at_s - 1.0,
        finished_at_s=finished_at_s, hidden_size=int(sample.final.shape[-1]), hidden_dtype=hidden_dtype,
        token_ids=sample.tokens.to(torch.int32).numpy(), loss_mask=mask.numpy(),
        aux_hidden=hidden_bytes(sample.aux, hidden_dtype), final_hidden=hidden_bytes(sample.final, hidden_dtype),
        request_num_tokens=t)


def prompt_length(sample: Sample) -> int:
    """Leading positions with loss mask 0 (what ``generate_samples`` marks as the prompt)."""
    nonzero = torch.nonzero(sample.loss_mask > 0)
    return int(nonzero[0, 0]) if nonzero.numel() else len(sample)


def log_samples(data_dir: str | Path | Location, samples: Sequence[Sample], prompt_lens: Sequence[int] | None = None, *,
                target_model_id: str, aux_layer_ids: tuple[int, ...], start_s: float,
                spacing_s: float = 1.0, workload: str | None = None, id_prefix: str = "req",
                topic: str = "tide.hidden-states", partition: int = 0, first_offset: int = 0,
                max_message_bytes: int = 900_000, rows_per_file: int = 256,
                hidden_dtype: str = "bfloat16", request_ids: Sequence[str] | None = None
                ) -> list[int]:
    """Write ``samples`` (request i finished at ``start_s + i * spacing_s``) to the table at
    ``data_dir`` (a directory or s3:// URI); returns the table versions committed, one per file.

    ``prompt_lens`` default: each sample's leading zeros of its loss mask; ``request_ids``
    default: ``<id_prefix>-<i:06d>``.
    """
    if prompt_lens is None:
        prompt_lens = [prompt_length(s) for s in samples]
    location = data_dir if isinstance(data_dir, Location) else Location.from_uri(data_dir)
    table = DatasetTable(location)
    table.ensure()
    versions: list[int] = []
    offset = first_offset
    open_files: dict[str, DataFileWriter] = {}  # partition folder -> its open file

    def seal(key: str) -> None:
        out = open_files.pop(key).finish()
        versions.append(table.append([out.add], out.counts))

    try:
        for i, (sample, prompt_len) in enumerate(zip(samples, prompt_lens, strict=True)):
            at_s = start_s + i * spacing_s
            rid = request_ids[i] if request_ids is not None else f"{id_prefix}-{i:06d}"
            record = sample_record(sample, rid, prompt_len, at_s, target_model_id,
                                   aux_layer_ids, workload, hidden_dtype=hidden_dtype)
            part = partition_values(at_s)
            key = partition_path(part)
            for other in [k for k in open_files if k != key]:
                seal(other)  # like ingest: a batch holds consecutive offsets
            for chunk in split(record, max_message_bytes):
                if key not in open_files:
                    open_files[key] = DataFileWriter(location, part, 64, 32 * 1024 * 1024)
                f = open_files[key]
                f.add(Row(decode(encode(chunk)), topic, partition, offset, int(at_s * 1000), at_s))
                offset += 1
                if f.rows >= rows_per_file:
                    seal(key)
        for key in list(open_files):
            seal(key)
    finally:
        for f in open_files.values():
            f.discard()
    return versions
