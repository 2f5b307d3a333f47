"""The ingest process's bulk settings: the socket read loop returns what the socket held, ends
the connection on a failure as kafka-python's does, and is left alone on another release; the
allocator setting keeps freed fetch-sized buffers for reuse (measured in a fresh process)."""
from __future__ import annotations

import subprocess
import sys

import kafka
import kafka.errors
import pytest
from kafka.net import transport

from tide.config import IngestConfig
from tide.dataset import bulk


class _Socket:
    """A non-blocking socket's reads: the queued pieces, then 'would block' (or a failure)."""

    def __init__(self, pieces: list[bytes], then: BaseException | None = BlockingIOError()):
        self.pieces, self.then, self.asked = list(pieces), then, []

    def recv(self, n: int) -> bytes:
        self.asked.append(n)
        if self.pieces:
            return self.pieces.pop(0)[:n]
        raise self.then

    def getpeername(self):
        raise OSError("not connected")  # what the transport's name shows for a socket gone


def _read(sock: _Socket) -> tuple[bytes, Exception | None]:
    return transport.KafkaTCPTransport(None, sock, host="broker")._sock_recv()


@pytest.fixture
def reads():
    yield
    bulk.restore_socket_reads()


def test_socket_reads_ask_for_the_configured_size_and_return_everything_held(reads):
    assert bulk.read_sockets_in(1 << 20)
    sock = _Socket([b"a" * 1000, b"b" * 70_000, b"c"])
    data, err = _read(sock)
    assert err is None and data == b"a" * 1000 + b"b" * 70_000 + b"c"
    assert sock.asked == [1 << 20] * 4  # three pieces, then the read that would block
    data, err = _read(_Socket([b"only"]))
    assert (data, err) == (b"only", None)


def test_a_closed_or_failing_socket_ends_the_connection_as_kafka_python_does(reads):
    assert bulk.read_sockets_in(4096)
    data, err = _read(_Socket([b"xy", b""]))
    assert data == b"xy" and isinstance(err, kafka.errors.KafkaConnectionError)
    data, err = _read(_Socket([], then=ConnectionResetError("reset by peer")))
    assert data == b"" and isinstance(err, kafka.errors.KafkaConnectionError)


def test_another_kafka_python_release_keeps_its_own_reads(reads, monkeypatch):
    monkeypatch.setattr(kafka, "__version__", "9.9.9")
    before = transport.KafkaTCPTransport._sock_recv
    assert not bulk.read_sockets_in(1 << 20)
    assert transport.KafkaTCPTransport._sock_recv is before


def test_tls_connections_keep_their_own_reads(reads):
    tls_before = transport.KafkaSSLTransport._sock_recv
    assert bulk.read_sockets_in(1 << 20)
    assert transport.KafkaSSLTransport._sock_recv is tls_before
    assert transport.KafkaTCPTransport._sock_recv is not tls_before


def test_zero_leaves_a_setting_alone(reads):
    before = transport.KafkaTCPTransport._sock_recv
    applied = bulk.tune_process(IngestConfig(socket_read_bytes=0, malloc_mmap_threshold_bytes=0))
    assert applied == {"heap_buffers": False, "socket_reads": False}
    assert transport.KafkaTCPTransport._sock_recv is before


_FAULTS = """
import resource, sys
from tide.dataset import bulk
if sys.argv[1] == "tuned":
    assert bulk.keep_buffers_on_heap(32 << 20, 256 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(200):  # a fetch's worth of buffers, allocated, filled and freed again and again
    buffers = [bytes(bytearray(b"x") * (4 << 20)) for _ in range(2)]
    del buffers
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.split()[-1])


def test_freed_fetch_sized_buffers_are_reused_instead_of_faulted_in_again():
    stock, tuned = _faults("stock"), _faults("tuned")
    # stock glibc maps each 4 MiB buffer afresh: ~1000 page faults per buffer, 400 buffers
    assert stock > 100_000, stock
    assert tuned < stock / 10, (stock, tuned)
