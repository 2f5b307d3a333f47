"""The staging ring: shared memory the engine's tap copies step rows into, and the frames that
describe them on the tap -> worker pipe.

Layout: a 64-byte header (``tail``: int64 at offset 0, written only by the worker) and a data area
of ``capacity`` bytes. The tap (only writer of data) keeps ``head`` to itself; both counters grow
forever and a block of ``size`` bytes sits at ``data_offset + position % capacity``. A block never
wraps: when it would, the tap skips to the next lap. The worker consumes blocks in frame order and
advances ``tail`` past each one after copying it out, so free space is ``capacity - (head - tail)``
and the tap never waits: a block that does not fit is refused (the caller drops and counts it).

Frames are pickled tuples written with one ``os.write`` of at most ``PIPE_BUF`` bytes to a
non-blocking pipe, which POSIX makes atomic: a frame either goes whole or not at all (EAGAIN).
They use ``multiprocessing.connection``'s framing (a big-endian int32 length), so the worker reads
them with ``Connection.recv_bytes``. Imports numpy and the standard library only.
"""
from __future__ import annotations

import os
import pickle
import select
import struct
from multiprocessing import resource_tracker, shared_memory

import numpy as np

HEADER_BYTES = 64
ALIGN_BYTES = 64  # every block starts aligned, so int32 / bf16 views of it are aligned too
PIPE_BUF = select.PIPE_BUF
_LENGTH = struct.Struct("!i")

# how a staged tensor's bytes are laid out: the stored dtype already, or a source dtype that the
# worker converts (the tap then copied raw bytes with one memmove instead of a torch cast)
STORED, FLOAT32, INT64 = "stored", "float32", "int64"
# NaN stays a quiet NaN; its bits may differ from a torch cast's (which differ between torch's kernels)
_BF16_NAN = np.uint16(0x7FC0)

# frame kinds, tap -> worker
STEP, CLOSE = "step", "close"
# and worker -> tap
STATS, CLOSED = "stats", "closed"


def align(n: int) -> int:
    return -(-n // ALIGN_BYTES) * ALIGN_BYTES


class StagingRing:
    """The shared memory; ``create`` on the engine side, ``attach`` in the worker."""

    def __init__(self, shm: shared_memory.SharedMemory, owner: bool) -> None:
        self.shm, self.owner = shm, owner
        self.capacity = shm.size - HEADER_BYTES
        self._tail = np.ndarray((1,), dtype=np.int64, buffer=shm.buf)
        self.data = np.ndarray((self.capacity,), dtype=np.uint8, buffer=shm.buf, offset=HEADER_BYTES)
        self.head = 0  # tap side only

    @classmethod
    def create(cls, capacity_bytes: int) -> "StagingRing":
        shm = shared_memory.SharedMemory(create=True, size=HEADER_BYTES + align(capacity_bytes))
        ring = cls(shm, owner=True)
        ring.reset()
        return ring

    @classmethod
    def attach(cls, name: str) -> "StagingRing":
        shm = shared_memory.SharedMemory(name=name)
        # the engine owns (and unlinks) it: the worker's resource tracker must not unlink it on exit
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
        return cls(shm, owner=False)

    @property
    def name(self) -> str:
        return self.shm.name

    @property
    def tail(self) -> int:
        return int(self._tail[0])

    def set_tail(self, position: int) -> None:
        self._tail[0] = position

    def reset(self) -> None:
        """Empty the ring (tap side, while no worker is attached to it)."""
        self.head = 0
        self._tail[0] = 0

    def reserve(self, size: int) -> int | None:
        """Absolute start position of a ``size``-byte block, or None when it does not fit now.
        The caller writes at ``offset(start)`` and then ``commit(start, size)``s."""
        size = align(size)
        start = self.head
        if start % self.capacity + size > self.capacity:  # never wrap a block: next lap
            start += self.capacity - start % self.capacity
        if size > self.capacity or start + size - self.tail > self.capacity:
            return None
        return start

    def commit(self, start: int, size: int) -> None:
        self.head = start + align(size)

    def offset(self, start: int) -> int:
        return start % self.capacity

    def close(self) -> None:
        self._tail = self.data = None  # views must go before the mapping closes
        self.shm.close()
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


def bf16_from_float32(values: np.ndarray) -> np.ndarray:
    """bfloat16 bits of float32 ``values`` rounded to nearest even, as torch's cast rounds them."""
    bits = values.view(np.uint32)
    rounded = ((bits + np.uint32(0x7FFF) + ((bits >> 16) & np.uint32(1))) >> 16).astype(np.uint16)
    rounded[np.isnan(values)] = _BF16_NAN
    return rounded


def unstage(block: np.ndarray, n: int, row_bytes: int, kind: str) -> np.ndarray:
    """A staged hidden-state block of ``n`` rows of ``row_bytes`` as stored bytes (a copy):
    uint8 [n, stored row bytes]."""
    if kind == FLOAT32:
        return bf16_from_float32(block.view(np.float32)).view(np.uint8).reshape(n, row_bytes // 2)
    return block.reshape(n, row_bytes).copy()


def pack_frame(message: tuple) -> bytes:
    payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LENGTH.pack(len(payload)) + payload


def write_frame(fd: int, frame: bytes) -> bool:
    """One atomic write to the non-blocking pipe: True if sent, False if the pipe is full.
    Raises BrokenPipeError when the worker is gone, ValueError for frames over ``PIPE_BUF``."""
    if len(frame) > PIPE_BUF:
        raise ValueError(f"frame of {len(frame)} bytes exceeds PIPE_BUF={PIPE_BUF}")
    try:
        os.write(fd, frame)
    except BlockingIOError:
        return False
    return True
