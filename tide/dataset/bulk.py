"""Process settings for moving captured hidden states through Python in bulk (the ingest service).

A fetch response carries megabytes of hidden states, read and copied several times on its way to a
Parquet page. Two defaults of the libraries underneath cost more CPU than the ingest work itself:

- glibc's allocator serves each buffer above its mmap threshold with a fresh ``mmap`` and returns
  it on free, so every fetch-sized buffer faults its pages in again (system time, per byte); with
  the threshold raised and the heap kept, freed buffers are reused;
- kafka-python 3.0.12 reads its sockets 4 KiB at a time (a fixed size in its TCP transport), one
  system call and one bytes object per 4 KiB of a response.

``tune_process`` applies both (and the GIL switch interval) once at start, before any client
exists; the ingest service and ``bench/ingest.py`` call it alike. Each step reports whether it
took effect: neither is needed for correctness, and a platform without it runs unchanged.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import kafka
import kafka.errors
from kafka.net import transport

from tide.config import IngestConfig

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# the kafka-python release whose plain-TCP transport reads in fixed 4 KiB pieces (pyproject pins it)
RECV_PATCHED_VERSION = "3.0.12"
_ORIGINAL_SOCK_RECV = transport.KafkaTCPTransport._sock_recv


def keep_buffers_on_heap(mmap_threshold_bytes: int, trim_threshold_bytes: int) -> bool:
    """Serve allocations below ``mmap_threshold_bytes`` from the heap and keep up to
    ``trim_threshold_bytes`` of freed heap; False where the C library is not glibc or refuses
    (glibc caps the threshold at 32 MiB on 64-bit)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt accepts and ignores
    except (OSError, AttributeError, TypeError):
        return False
    # setting either disables glibc's dynamic thresholds, so both are set together
    return bool(mallopt(_M_MMAP_THRESHOLD, int(mmap_threshold_bytes))
                and mallopt(_M_TRIM_THRESHOLD, int(trim_threshold_bytes)))


def read_sockets_in(chunk_bytes: int) -> bool:
    """Plain-TCP Kafka connections read up to ``chunk_bytes`` per system call; False (and nothing
    changed) on a kafka-python other than the pinned release. TLS connections keep their reads."""
    if kafka.__version__ != RECV_PATCHED_VERSION:
        log.warning("kafka-python %s: socket reads left at its own size (tuned for %s)",
                    kafka.__version__, RECV_PATCHED_VERSION)
        return False

    def _sock_recv(self) -> tuple[bytes, Exception | None]:
        """Everything the socket holds now, as the transport's own reader returns it."""
        pieces = []
        while True:
            try:
                data = self._sock.recv(chunk_bytes)
            except (BlockingIOError, InterruptedError):
                break
            except Exception as exc:  # noqa: BLE001 - as kafka-python's: any failure closes the connection
                log.warning("%s: error receiving network data: %s", self, exc)
                return b"".join(pieces), kafka.errors.KafkaConnectionError(exc)
            if not data:
                return b"".join(pieces), kafka.errors.KafkaConnectionError("socket disconnected")
            pieces.append(data)
        return (pieces[0] if len(pieces) == 1 else b"".join(pieces)), None

    transport.KafkaTCPTransport._sock_recv = _sock_recv
    return True


def restore_socket_reads() -> None:
    """kafka-python's own reads again (tests)."""
    transport.KafkaTCPTransport._sock_recv = _ORIGINAL_SOCK_RECV


def tune_process(config: IngestConfig) -> dict[str, bool]:
    """All of the above for an ingest process; which took effect (logged at start)."""
    sys.setswitchinterval(config.switch_interval_s)
    applied = {"heap_buffers": keep_buffers_on_heap(config.malloc_mmap_threshold_bytes,
                                                    config.malloc_trim_threshold_bytes)
               if config.malloc_mmap_threshold_bytes else False,
               "socket_reads": read_sockets_in(config.socket_read_bytes) if config.socket_read_bytes else False}
    log.info("ingest process settings: %s", applied)
    return applied
