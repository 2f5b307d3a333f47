"""A retrain window's hidden states on local disk instead of in memory, read back per batch.

An online retrain's window grows with the traffic it covers (4.6 KB of bf16 states per token for
SmolLM2), while one training batch is bounded by ``train.batch_tokens``. ``StateFile`` keeps each
sample's states ([T, 3H] aux and [T, H] final, bf16 as stored) as one row block of an unlinked
temporary file (it disappears with the process, killed or not: nothing to reap) and reads a
block back with one ``pread`` when a batch is collated. Reads are served from the page cache,
which the kernel reclaims under pressure and which is not part of the process's resident set, so
the retrain's memory is set by the batch and the window's small per-token columns, not by the
hidden states of every position. Values are bit-identical to holding the bf16 tensors.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

_DTYPE = torch.bfloat16
_BYTES = 2  # per bf16 value


class StateFile:
    """Append-only file of bf16 row blocks; ``put`` returns where a block lies, ``get`` reads it."""

    def __init__(self, directory: str | Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        self._file = tempfile.TemporaryFile(dir=directory, prefix="tide-states-")
        self._end = 0

    def put(self, aux: torch.Tensor, final: torch.Tensor) -> "SpilledStates":
        rows = torch.cat((aux.to(_DTYPE), final.to(_DTYPE)), dim=-1).contiguous()
        data = rows.view(torch.int16).numpy().tobytes()
        offset = self._end
        written = os.pwrite(self._file.fileno(), data, offset)
        if written != len(data):
            raise OSError(f"short write to the state file ({written} of {len(data)} bytes)")
        self._end += len(data)
        return SpilledStates(self, offset, rows.shape[0], aux.shape[-1], final.shape[-1])

    def read(self, offset: int, nbytes: int) -> bytes:
        data = os.pread(self._file.fileno(), nbytes, offset)
        if len(data) != nbytes:
            raise OSError(f"short read from the state file ({len(data)} of {nbytes} bytes)")
        return data

    @property
    def nbytes(self) -> int:
        return self._end

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class SpilledStates:
    """One sample's states in a ``StateFile``: [rows, aux_width] and [rows, final_width] bf16."""

    store: StateFile
    offset: int
    rows: int
    aux_width: int
    final_width: int

    def load(self, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(aux, final) of the first ``rows`` rows (all by default), as fresh tensors."""
        n = self.rows if rows is None else min(rows, self.rows)
        width = self.aux_width + self.final_width
        raw = np.frombuffer(bytearray(self.store.read(self.offset, n * width * _BYTES)), dtype=np.int16)
        block = torch.from_numpy(raw).view(_DTYPE).view(n, width)
        return block[:, :self.aux_width], block[:, self.aux_width:]
