"""How engines reach the drafter service: ZeroMQ sockets, and shared memory on one host.

Why ZeroMQ (pyzmq) and not gRPC: the service's loop is one thread that must never block on any
engine, so it needs non-blocking multi-peer I/O it polls between batches (a ROUTER socket: every
engine's messages in one queue, each reply routed back by the engine's identity); messages are
a small header plus raw arrays sent without copies or a schema compiler; and a peer that is down
is a send that fails at once (``IMMEDIATE``) rather than a stream to re-establish. gRPC brings
HTTP/2 streams, protobuf code generation and its own thread pools for none of that.

Two URLs, one protocol (tide/drafting/wire.py):
- ``tcp://host:port``: across hosts; a request's arrays are frames of the message;
- ``ipc:///path``: one host; the engine creates a staging ring (tide/capture/ring.py) and writes a
  request's arrays there (the aux states: the bulk of it), the message names the block, and the
  service copies them out and advances the ring's tail at once. A block that does not fit (a long
  prompt feed while the service is stalled) travels as frames instead.
An engine never blocks on the service: sends are non-blocking (a full queue or no connection is a
failed send) and receives wait at most the caller's deadline.
"""
from __future__ import annotations

import logging
import time

import numpy as np
import zmq

from tide.capture.ring import StagingRing
from tide.drafting.wire import WireError, decode, encode, from_block, header_of, layout

log = logging.getLogger(__name__)

LOCAL, NETWORK = "ipc://", "tcp://"
SEND_QUEUE = 16  # messages an engine queues towards a stalled service before sends fail


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
    return sock


class EngineLink:
    """One engine's connection to the service (used by one thread at a time)."""

    def __init__(self, url: str, ring_bytes: int = 32 << 20) -> None:
        if not url.startswith((LOCAL, NETWORK)):
            raise ValueError(f"spec.drafter_service must be ipc:///path or tcp://host:port, got {url!r}")
        self.url = url
        self._ctx = zmq.Context()
        self.sock = _socket(self._ctx, zmq.DEALER)
        self.sock.setsockopt(zmq.IMMEDIATE, 1)  # no connection: a send fails now, never queues for later
        self.sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self.sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        self.sock.connect(url)
        self.ring = StagingRing.create(ring_bytes) if url.startswith(LOCAL) else None

    @property
    def ring_name(self) -> str | None:
        return self.ring.name if self.ring is not None else None

    def send(self, header: dict, arrays: dict[str, np.ndarray] | None = None) -> bool:
        """False when the message cannot go now (no service connected, or its queue is full)."""
        frames = self._in_ring(header, arrays) if arrays and self.ring is not None else None
        frames = frames or encode(header, arrays)
        try:
            self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _in_ring(self, header: dict, arrays: dict[str, np.ndarray]) -> list | None:
        specs, size = layout(arrays)
        start = self.ring.reserve(size)
        if start is None:
            return None
        at = self.ring.offset(start)
        for (_, _, _, offset), a in zip(specs, arrays.values()):
            raw = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
            self.ring.data[at + offset:at + offset + raw.nbytes] = raw
        self.ring.commit(start, size)
        return encode({**header, "block": [start, size], "block_arrays": specs})[:1]

    def recv(self, timeout_s: float) -> tuple[dict, dict[str, np.ndarray]] | None:
        """The next message within ``timeout_s`` (0: only one already here), or None."""
        if not self.sock.poll(max(0, int(timeout_s * 1000))):
            return None
        frames = self.sock.recv_multipart(copy=True)
        try:
            return decode(frames)
        except WireError as exc:
            log.warning("drafter service: bad message dropped: %s", exc)
            return None

    def reset_ring(self) -> None:
        """A new service process: nothing reads the ring's old blocks any more."""
        if self.ring is not None:
            self.ring.reset()

    def close(self) -> None:
        self.sock.close(0)
        self._ctx.term()
        if self.ring is not None:
            self.ring.close()


class ServiceSockets:
    """The service's listening sockets (network and local) and the engines' rings it attached."""

    def __init__(self, tcp: str | None, ipc: str | None, max_array_bytes: int) -> None:
        self._ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.sockets: dict[str, zmq.Socket] = {}
        self.endpoints: dict[str, str] = {}
        for kind, url in ((NETWORK, tcp), (LOCAL, ipc)):
            if url:
                sock = _socket(self._ctx, zmq.ROUTER)
                sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a gone engine is dropped
                sock.bind(url)
                self.sockets[kind] = sock
                self.endpoints[kind] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                self.poller.register(sock, zmq.POLLIN)
        self.rings: dict[bytes, StagingRing] = {}  # local engines' rings, by socket identity
        self.max_array_bytes = max_array_bytes

    def poll(self, timeout_s: float) -> list[tuple[str, bytes, dict, dict]]:
        """Every message waiting now, or the first within ``timeout_s``: (kind, identity, header, arrays)."""
        out = []
        ready = dict(self.poller.poll(max(0, int(timeout_s * 1000))))
        while ready:
            for kind, sock in self.sockets.items():
                if sock not in ready:
                    continue
                while True:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=True)
                    except zmq.Again:
                        break
                    message = self._message(kind, frames)
                    if message is not None:
                        out.append(message)
            ready = dict(self.poller.poll(0))
        return out

    def _message(self, kind: str, frames: list) -> tuple[str, bytes, dict, dict] | None:
        identity, body = frames[0], frames[1:]
        try:
            if not body:
                raise WireError("empty message")
            header = header_of(body[0])
            if "block" in header:
                return kind, identity, header, self._from_ring(kind, identity, header)
            header, arrays = decode(body, self.max_array_bytes)
            return kind, identity, header, arrays
        except WireError as exc:
            log.warning("drafter service: message dropped: %s", exc)
            return kind, identity, {"op": "invalid", "reason": str(exc)}, {}

    def _from_ring(self, kind: str, identity: bytes, header: dict) -> dict:
        ring = self.rings.get(identity)
        if kind != LOCAL or ring is None:
            raise WireError("a shared-memory block from an engine without a ring")
        start, size = header.get("block", [None, None])
        if not (isinstance(start, int) and isinstance(size, int) and 0 <= size <= ring.capacity and start >= 0):
            raise WireError("bad shared-memory block")
        at = ring.offset(start)
        if at + size > ring.capacity:
            raise WireError("shared-memory block outside the ring")
        try:
            return from_block(ring.data[at:at + size], header.get("block_arrays"), self.max_array_bytes)
        finally:
            ring.set_tail(start + size + (-size % 64))  # copied out: the engine may reuse it

    def attach(self, kind: str, identity: bytes, name: str | None) -> None:
        """A local engine's hello names its ring (a hello again: its new ring)."""
        old = self.rings.pop(identity, None)
        if old is not None:
            old.close()
        if kind == LOCAL and isinstance(name, str) and name:
            self.rings[identity] = StagingRing.attach(name)

    def detach(self, identity: bytes) -> None:
        ring = self.rings.pop(identity, None)
        if ring is not None:
            ring.close()

    def send(self, kind: str, identity: bytes, header: dict, arrays: dict | None = None) -> None:
        try:
            self.sockets[kind].send_multipart([identity] + encode(header, arrays), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # that engine is not reading: it falls back to target-only on its own
            pass

    def close(self) -> None:
        for ring in self.rings.values():
            ring.close()
        for sock in self.sockets.values():
            sock.close(0)
        self._ctx.term()


def wait_until(check, timeout_s: float, interval_s: float = 0.01) -> bool:
    """Poll ``check`` until it is true or ``timeout_s`` passes (start-up helpers and tests)."""
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True
