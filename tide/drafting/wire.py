"""What an engine and the drafter service exchange, defined once (both transports carry the same).

A message is a JSON header and named arrays. On the network transport the arrays follow the header
as frames; on the shared-memory transport a request's arrays sit in the engine's staging ring
(tide/capture/ring.py) and the header names the block (``block``: [start, size]); replies are small
and always travel as frames. The header lists each array as [name, dtype, shape, offset].

Messages (``op``), engine -> service:
- ``hello``: ``engine`` (its id), ``shm`` (its ring's name; local transport only);
- ``ping``: is the service there (answered ``pong``);
- ``draft``: ``engine``, ``seq``, ``rows`` (one per running request of the step: ``id``, ``t_len``,
  ``pending``, ``feed_start``, ``first_pos``, ``n_feed``, ``temperature``, ``seed``), ``gamma``,
  ``stop_prob``, ``closed`` (request ids that ended: their sessions are freed), ``acceptance``
  (the engine's cumulative counters, {version: {``forwards``, ``accepted``, ``committed``}}: the
  fields of tide.contracts.VersionAcceptance; its collapse guard's input); arrays ``tokens`` int64
  [sum n_feed] and ``aux`` float32 [sum n_feed, 3H];
service -> engine:
- ``welcome``: ``service`` (this process's id), ``version``; array ``d2t`` (target id of each draft id);
- ``pong``: ``service``, ``version``;
- ``drafts``: ``seq``, ``service``, ``version``, ``depth``; arrays ``tokens`` int64 [B, D] (target
  ids), ``prob`` float32 [B, D], ``survival`` float32 [B, D] (only with a confidence head), ``q``
  float32 [S, D, draft vocab] (each sampled row's draft distribution per depth, in row order);
- ``error``: ``reason``, ``seq`` (``unknown engine``: say hello again).
Everything a peer sends is checked against ``Limits`` before it is used.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from tide.contracts import VersionAcceptance

HELLO, PING, DRAFT, WELCOME, PONG, DRAFTS, ERROR = "hello", "ping", "draft", "welcome", "pong", "drafts", "error"
UNKNOWN_ENGINE = "unknown engine"
DTYPES = {"int64": np.int64, "float32": np.float32}
MAX_HEADER_BYTES = 1 << 20
MAX_ACCEPTANCE_VERSIONS = 64  # versions of one engine's acceptance report read; the rest are ignored
ACCEPTANCE_FIELDS = tuple(f.name for f in dataclasses.fields(VersionAcceptance))


class WireError(ValueError):
    """A message that does not follow this module's format or limits."""


@dataclass(frozen=True)
class Limits:
    """What the service accepts (its own config) and the target's shape."""

    vocab_size: int
    aux_dim: int  # 3 x the target's hidden size
    max_seq_len: int
    max_rows: int = 64
    max_depth: int = 16
    max_array_bytes: int = 256 << 20


def layout(arrays: dict[str, np.ndarray]) -> tuple[list, int]:
    """([name, dtype, shape, offset] per array, total bytes), each array 64-byte aligned."""
    out, offset = [], 0
    for name, a in arrays.items():
        out.append([name, a.dtype.name, list(a.shape), offset])
        offset += -(-a.nbytes // 64) * 64
    return out, offset


def encode(header: dict, arrays: dict[str, np.ndarray] | None = None) -> list:
    """Frames: the JSON header (with the arrays' layout), then each array's bytes."""
    arrays = {k: np.ascontiguousarray(v) for k, v in (arrays or {}).items()}
    header = {**header, "arrays": layout(arrays)[0]}
    return [json.dumps(header, separators=(",", ":")).encode()] + [memoryview(a).cast("B") for a in arrays.values()]


def _array(spec, limits_bytes: int) -> tuple[str, np.dtype, tuple[int, ...], int]:
    if not (isinstance(spec, list) and len(spec) == 4):
        raise WireError(f"bad array spec {spec!r}")
    name, dtype, shape, offset = spec
    if dtype not in DTYPES or not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise WireError(f"bad array {name!r}: {dtype!r} {shape!r}")
    nbytes = math.prod(shape) * np.dtype(DTYPES[dtype]).itemsize
    if nbytes > limits_bytes or not isinstance(offset, int) or offset < 0:
        raise WireError(f"array {name!r} too large or misplaced")
    return str(name), np.dtype(DTYPES[dtype]), tuple(shape), nbytes


def header_of(frame: bytes) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise WireError("header too large")
    try:
        header = json.loads(bytes(frame))
    except ValueError as exc:
        raise WireError(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("op"), str):
        raise WireError("header is not an object with an op")
    return header


def decode(frames: list, max_array_bytes: int = 256 << 20) -> tuple[dict, dict[str, np.ndarray]]:
    """(header, arrays) of a message whose arrays travel as frames (copies: frames are reused)."""
    header = header_of(frames[0])
    specs = header.get("arrays", [])
    if not isinstance(specs, list) or len(specs) != len(frames) - 1:
        raise WireError("array frames do not match the header")
    out = {}
    for spec, frame in zip(specs, frames[1:]):
        name, dtype, shape, nbytes = _array(spec, max_array_bytes)
        if len(frame) != nbytes:
            raise WireError(f"array {name!r}: {len(frame)} bytes, expected {nbytes}")
        out[name] = np.frombuffer(frame, dtype=dtype).reshape(shape).copy()
    return header, out


def from_block(block: np.ndarray, specs: list, max_array_bytes: int) -> dict[str, np.ndarray]:
    """The arrays a header lays out in a shared-memory block (copies: the ring is reused)."""
    out = {}
    for spec in specs if isinstance(specs, list) else []:
        name, dtype, shape, nbytes = _array(spec, max_array_bytes)
        offset = spec[3]
        if offset % 64 or offset + nbytes > block.nbytes:
            raise WireError(f"array {name!r} outside its block")
        out[name] = block[offset:offset + nbytes].view(dtype).reshape(shape).copy()
    return out


def check_draft(header: dict, arrays: dict[str, np.ndarray], limits: Limits) -> list[dict]:
    """The rows of a ``draft`` request, checked: sizes, ranges, types; WireError otherwise."""
    rows = header.get("rows")
    if not isinstance(rows, list) or not 1 <= len(rows) <= limits.max_rows:
        raise WireError(f"a draft needs 1..{limits.max_rows} rows")
    gamma, stop = header.get("gamma"), header.get("stop_prob")
    if not (isinstance(gamma, int) and 1 <= gamma <= limits.max_depth) or not isinstance(stop, (int, float)) \
            or not 0.0 <= stop <= 1.0:
        raise WireError("gamma or stop_prob out of range")
    total = 0
    for r in rows:
        ints = [r.get(k) for k in ("t_len", "pending", "feed_start", "first_pos", "n_feed", "seed")]
        temp = r.get("temperature")
        if not isinstance(r.get("id"), str) or not all(isinstance(v, int) for v in ints) \
                or not isinstance(temp, (int, float)) or not math.isfinite(temp) or temp < 0:
            raise WireError("a row's fields have the wrong types")
        t_len, pending, feed_start, first_pos, n_feed, _ = ints
        if not (n_feed >= 1 and 0 <= feed_start and feed_start + n_feed == t_len and 0 <= first_pos <= t_len
                and t_len + gamma + 2 <= limits.max_seq_len and 0 <= pending < limits.vocab_size):
            raise WireError("a row's positions are out of range")
        total += n_feed
    tokens, aux = arrays.get("tokens"), arrays.get("aux")
    if tokens is None or aux is None or tokens.shape != (total,) or aux.shape != (total, limits.aux_dim):
        raise WireError("tokens or aux do not match the rows")
    if total and (int(tokens.min()) < 0 or int(tokens.max()) >= limits.vocab_size):
        raise WireError("a token id is out of the vocabulary")
    if not np.isfinite(aux).all():
        raise WireError("aux states are not finite")
    return rows


def acceptance_field(counts: Mapping[str, VersionAcceptance]) -> dict[str, dict[str, int]]:
    """A draft request's ``acceptance``: each version's counters by field name."""
    return {version: dataclasses.asdict(c) for version, c in counts.items()}


def check_acceptance(raw) -> dict[str, VersionAcceptance] | None:
    """The counters of a draft request's ``acceptance``, checked: each version's value must hold
    exactly the named fields, each an integer in [0, 2**63); versions that do not are left out, and
    only the first MAX_ACCEPTANCE_VERSIONS are read. None (keep the last report) when ``raw`` is
    not an object, or is a non-empty one with no well-formed version."""
    if not isinstance(raw, dict):
        return None
    out = {}
    for version, counts in list(raw.items())[:MAX_ACCEPTANCE_VERSIONS]:
        if isinstance(counts, dict) and sorted(counts) == sorted(ACCEPTANCE_FIELDS) and all(
                type(n) is int and 0 <= n < 1 << 63 for n in counts.values()):
            out[str(version)] = VersionAcceptance(**counts)
    return out if out or not raw else None
