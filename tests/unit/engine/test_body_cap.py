"""A request body over ``server.max_body_bytes`` is refused having been read up to the cap and a
bounded slack, not for as long as the client goes on sending (tide/engine/http_guard.py,
tide/engine/http_conn.py).

A real uvicorn server on loopback with FakeEngine behind it. The client writes its whole body
without waiting for an answer, as clients that read the response only after the body do, and
notes what the server answers meanwhile. What the server has read is taken from the kernel's
side of loopback, never from the server's objects: bytes the client sent, less those still in
its send queue (unsent or unacknowledged) and those in the server socket's receive queue
(/proc/net/tcp). Sampling the client's queue first makes that figure a lower bound of what the
server had read, so a server that stops reading can never be seen to read more.
"""
from __future__ import annotations

import fcntl
import select
import socket
import struct
import termios
import time
from typing import Iterator

import pytest
from fake_engine import FakeEngine

from tide.config import EngineConfig, ServerConfig
from tide.engine.server import HttpServer, build_app

CAP_BYTES = 1_048_576
BODY_BYTES = 10_000_000
# what the server may read past the cap, about 700 KiB at most: uvicorn's read-ahead (64 KiB
# and one 256 KiB socket read) before and after the body's last receive, and what a refused
# connection drops while it lingers (64 KiB and one read)
SLACK_BYTES = 1_048_576
PIECE_BYTES = 65_536
SNDBUF_BYTES = 4096  # small: the client's sends keep pace with what the server side takes
GIVE_UP_S = 30.0  # the server must have stopped reading and closed well before this


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    cfg = ServerConfig(max_body_bytes=CAP_BYTES)
    server = HttpServer(build_app(FakeEngine(), cfg, EngineConfig()), "127.0.0.1", 0, grace_s=1,
                        log_level="warning")
    yield server.start()
    server.stop()


def _proc_addr(addr: tuple[str, int]) -> str:
    """``addr`` as /proc/net/tcp writes it: the address's bytes as a native integer, then the port."""
    return f"{struct.unpack('=I', socket.inet_aton(addr[0]))[0]:08X}:{addr[1]:04X}"


def server_unread_bytes(client: socket.socket) -> int | None:
    """Bytes waiting in the receive queue of the server's end of ``client``'s connection; None
    once that end is gone."""
    here, there = _proc_addr(client.getpeername()), _proc_addr(client.getsockname())
    with open("/proc/net/tcp") as table:
        for line in table.readlines()[1:]:
            fields = line.split()
            if fields[1] == here and fields[2] == there:
                return int(fields[4].split(":")[1], 16)
    return None


def client_queued_bytes(client: socket.socket) -> int:
    """Bytes in ``client``'s send queue: not yet sent, or not yet acknowledged by the server."""
    return struct.unpack("i", fcntl.ioctl(client.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


class BlindSender:
    """A client that sends its request to the end whatever the server says, and measures how
    much of it the server read."""

    def __init__(self, port: int) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
        self.sock.connect(("127.0.0.1", port))
        self.sent_bytes, self.read_bytes, self.samples = 0, 0, 0
        self.answer, self.answer_ended = b"", False

    def close(self) -> None:
        self.sock.close()

    def await_answer(self, timeout_s: float) -> None:
        """Read until the server's status line has come (or it closed)."""
        self.sock.settimeout(timeout_s)
        while b"\r\n" not in self.answer and not self.answer_ended:
            self._take(self.sock.recv(65536))

    def send_all(self, pieces: Iterator[bytes]) -> None:
        """Send every piece, reading what the server answers meanwhile, until all of it was sent
        and read, or the server reset the connection."""
        self.sock.setblocking(False)
        pending = next(pieces, b"")
        deadline = time.monotonic() + GIVE_UP_S
        while time.monotonic() < deadline:
            reading = [] if self.answer_ended else [self.sock]
            readable, writable, _ = select.select(reading, [self.sock] if pending else [], [], 0.05)
            try:
                if readable:
                    self._take(self.sock.recv(65536))
                if not (writable and pending) and self._all_read(done=not pending):
                    return
                if writable and pending:
                    self.sent_bytes += (sent := self.sock.send(pending))
                    pending = pending[sent:] or next(pieces, b"")
            except (BrokenPipeError, ConnectionResetError):
                return  # the server ended the connection
        raise AssertionError(f"the server neither read the body nor closed in {GIVE_UP_S:g} s")

    def _take(self, data: bytes) -> None:
        self.answer += data
        self.answer_ended = self.answer_ended or not data

    def _all_read(self, done: bool) -> bool:
        """Sample what the server has read (a lower bound, see the module docstring); True when
        the client is ``done`` and the server read it all, or the server's end is gone."""
        queued = client_queued_bytes(self.sock)  # first: it only shrinks while we do not send
        unread = server_unread_bytes(self.sock)
        if unread is None:
            return True
        self.samples += 1
        self.read_bytes = max(self.read_bytes, self.sent_bytes - queued - unread)
        return done and queued == 0 and unread == 0


def chunked_pieces() -> Iterator[bytes]:
    sent = 0
    while sent < BODY_BYTES:
        yield f"{PIECE_BYTES:x}\r\n".encode() + b"x" * PIECE_BYTES + b"\r\n"
        sent += PIECE_BYTES
    yield b"0\r\n\r\n"


def plain_pieces() -> Iterator[bytes]:
    for start in range(0, BODY_BYTES, PIECE_BYTES):
        yield b"x" * min(PIECE_BYTES, BODY_BYTES - start)


def test_chunked_body_stops_at_cap(port: int) -> None:
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    client = BlindSender(port)
    try:
        client.send_all(iter([head, *chunked_pieces()]))
    finally:
        client.close()
    assert client.answer.startswith(b"HTTP/1.1 413"), client.answer[:80]
    assert client.samples > 0, "the server's end of the connection was never found in /proc/net/tcp"
    assert client.read_bytes <= len(head) + CAP_BYTES + SLACK_BYTES, (client.read_bytes, client.sent_bytes)


def test_declared_body_over_cap_is_refused_from_the_head_and_not_read(port: int) -> None:
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BODY_BYTES}\r\n\r\n").encode()
    client = BlindSender(port)
    try:
        client.sock.sendall(head)
        client.sent_bytes = len(head)
        client.await_answer(GIVE_UP_S)  # the answer comes before a byte of the body is sent
        assert client.answer.startswith(b"HTTP/1.1 413"), client.answer[:80]
        client.send_all(plain_pieces())  # then the client sends its body all the same
    finally:
        client.close()
    assert client.samples > 0, "the server's end of the connection was never found in /proc/net/tcp"
    assert client.read_bytes <= len(head) + SLACK_BYTES, (client.read_bytes, client.sent_bytes)
