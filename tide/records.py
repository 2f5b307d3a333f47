"""The capture record: what one request's target hidden states look like on the wire.

A request's record is split by positions into chunks; each chunk is a complete ``Record`` covering
positions ``[position_start, position_start + num_tokens)`` of the request, and travels as one
Kafka message. The value encoding (written down in ``schemas/record_value.schema.json``; a test
keeps the two equal) is:

    magic b"TIDR" | u16 schema_version | u32 header_len | header (UTF-8 JSON)
    | token_ids int32[T] | loss_mask uint8[T] | aux_hidden [T, 3H] | final_hidden [T, H] | u32 crc32

All integers are little-endian; hidden states are raw ``hidden_dtype`` bytes (bfloat16 or
float8_e4m3fn) and the CRC covers every byte before it. Decoding garbage raises ``RecordError``
with a ``reason`` that ingest puts in the dead-letter headers.

This module imports only ``tide.contracts`` and numpy (torch only inside ``hidden_bytes``, whose
callers hold torch tensors already).
"""
from __future__ import annotations

import dataclasses
import json
import math
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from tide.contracts import DEAD_INVALID, DEAD_MALFORMED, DEAD_OVERSIZED, DEAD_UNKNOWN_VERSION, HIDDEN_ITEMSIZE

SCHEMA_VERSION = 1
MAGIC = b"TIDR"
_PREFIX = struct.Struct("<4sHI")  # magic, schema version, header length
_CRC = struct.Struct("<I")
_MAX_HEADER_BYTES = 64 * 1024
# value limits (``validate``; also in the schema file): what the dataset can store and index
MAX_ID_CHARS = 256  # request_id, target_model_id (1..this), drafter_version (0..this)
MAX_WORKLOAD_CHARS = 64  # the engine API's own limit for the tag
MAX_AUX_LAYERS = 16
MAX_VERSION_CHANGES = 64  # drafter swaps one record can name (a request spans few)
MAX_CAPTURE_TIME_S = 4_102_444_800.0  # 2100-01-01T00:00:00Z: times are Unix seconds in [0, this)
INT32_MAX = 2**31 - 1  # every integer header value and token id is stored as int32


class RecordError(ValueError):
    """A record cannot be encoded or decoded; ``reason`` is one of the constants above."""

    def __init__(self, message: str, reason: str = DEAD_MALFORMED) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Record:
    """One request's captured positions (the whole request, or one chunk of it).

    ``token_ids[i]`` sits at request position ``position_start + i``; ``loss_mask`` is 0 on prompt
    positions and 1 on generated ones. ``aux_hidden`` ([T, 3H]) and ``final_hidden`` ([T, H]) hold
    raw ``hidden_dtype`` bytes, row-major.
    """

    request_id: str
    target_model_id: str
    drafter_version: str
    aux_layer_ids: tuple[int, ...]
    workload: str | None
    started_at_s: float
    finished_at_s: float
    hidden_size: int
    hidden_dtype: str
    token_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    # bytes-like: ``decode`` returns read-only memoryviews into the value (no copy)
    aux_hidden: bytes | memoryview
    final_hidden: bytes | memoryview
    position_start: int = 0
    request_num_tokens: int = 0  # positions in the whole request (0 = this record's own T)
    chunk_index: int = 0
    chunk_count: int = 1
    # (request position, drafter version): from that position on, drafts came from that version
    # (swaps while the request ran); ``drafter_version`` holds before the first. Absent in older records.
    version_changes: tuple[tuple[int, str], ...] = ()

    def drafter_version_at(self, position: int) -> str:
        """The drafter version that served request position ``position``."""
        version = self.drafter_version
        for start, changed in self.version_changes:
            if start > position:
                break
            version = changed
        return version

    @property
    def num_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def bytes_per_token(self) -> int:
        return 4 + 1 + 4 * self.hidden_size * HIDDEN_ITEMSIZE[self.hidden_dtype]

    def validate(self) -> None:
        """Shapes, dtypes and ranges agree; raises RecordError naming the first mismatch."""
        if self.hidden_dtype not in HIDDEN_ITEMSIZE:
            raise RecordError(f"hidden_dtype {self.hidden_dtype!r} not in {sorted(HIDDEN_ITEMSIZE)}")
        if self.hidden_size <= 0:
            raise RecordError(f"hidden_size must be positive, got {self.hidden_size}")
        t = self.num_tokens
        if self.token_ids.ndim != 1 or self.loss_mask.shape != (t,):
            raise RecordError(f"token_ids {self.token_ids.shape} / loss_mask {self.loss_mask.shape}"
                              " must both be [T]")
        item = HIDDEN_ITEMSIZE[self.hidden_dtype]
        if len(self.aux_hidden) != t * 3 * self.hidden_size * item:
            raise RecordError(f"aux_hidden has {len(self.aux_hidden)} bytes, expected "
                              f"{t}x{3 * self.hidden_size}x{item}")
        if len(self.final_hidden) != t * self.hidden_size * item:
            raise RecordError(f"final_hidden has {len(self.final_hidden)} bytes, expected "
                              f"{t}x{self.hidden_size}x{item}")
        self._check_values()

    def _check_values(self) -> None:
        """Values the dataset can store and index (reason ``invalid``): checked here, because
        otherwise they fail only when the Parquet file is written or a time becomes a directory."""
        texts = (("request_id", MAX_ID_CHARS, 1), ("target_model_id", MAX_ID_CHARS, 1),
                 ("drafter_version", MAX_ID_CHARS, 0), ("workload", MAX_WORKLOAD_CHARS, 1))
        for name, limit, least in texts:
            value = getattr(self, name)
            if value is None and name == "workload":
                continue
            if not isinstance(value, str) or not least <= len(value) <= limit:
                raise RecordError(f"{name} must be {least}-{limit} characters", DEAD_INVALID)
            if not value.isprintable() or not _is_utf8(value):
                raise RecordError(f"{name} must be printable UTF-8 text", DEAD_INVALID)
        for name in ("started_at_s", "finished_at_s"):
            t = getattr(self, name)
            if not (math.isfinite(t) and 0 <= t < MAX_CAPTURE_TIME_S):
                raise RecordError(f"{name}={t!r} is not a Unix time in [0, {MAX_CAPTURE_TIME_S:.0f})",
                                  DEAD_INVALID)
        if not 0 <= self.chunk_index < self.chunk_count <= INT32_MAX:
            raise RecordError(f"chunk_index {self.chunk_index} / chunk_count {self.chunk_count}: need "
                              "0 <= index < count < 2**31", DEAD_INVALID)
        ints = (self.hidden_size, self.position_start, self.request_num_tokens, *self.aux_layer_ids)
        if not all(0 <= x <= INT32_MAX for x in ints) or len(self.aux_layer_ids) > MAX_AUX_LAYERS:
            raise RecordError(f"hidden_size, position_start, request_num_tokens and (at most "
                              f"{MAX_AUX_LAYERS}) aux_layer_ids must be in [0, 2**31)", DEAD_INVALID)
        self._check_version_changes()
        if self.num_tokens and (self.token_ids.min() < 0 or self.token_ids.max() > INT32_MAX
                                or self.loss_mask.max() > 1):
            raise RecordError("token_ids must be in [0, 2**31) and loss_mask 0 or 1", DEAD_INVALID)

    def _check_version_changes(self) -> None:
        changes = self.version_changes
        if len(changes) > MAX_VERSION_CHANGES:
            raise RecordError(f"{len(changes)} version_changes, at most {MAX_VERSION_CHANGES}", DEAD_INVALID)
        last = -1
        for position, version in changes:
            if not (isinstance(position, int) and last < position <= INT32_MAX):
                raise RecordError("version_changes positions must increase within [0, 2**31)", DEAD_INVALID)
            if not (isinstance(version, str) and len(version) <= MAX_ID_CHARS and version.isprintable()
                    and _is_utf8(version)):
                raise RecordError(f"version_changes versions must be printable UTF-8 of at most {MAX_ID_CHARS} "
                                  "characters", DEAD_INVALID)
            last = position

    def header(self) -> dict:
        """The JSON header fields (everything but the arrays)."""
        return {
            "request_id": self.request_id, "target_model_id": self.target_model_id,
            "drafter_version": self.drafter_version, "aux_layer_ids": list(self.aux_layer_ids),
            "workload": self.workload, "started_at_s": self.started_at_s,
            "finished_at_s": self.finished_at_s, "hidden_size": self.hidden_size,
            "hidden_dtype": self.hidden_dtype, "num_tokens": self.num_tokens,
            "position_start": self.position_start,
            "request_num_tokens": self.request_num_tokens or self.num_tokens,
            "chunk_index": self.chunk_index, "chunk_count": self.chunk_count,
            "version_changes": [[p, v] for p, v in self.version_changes],
        }


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")  # lone surrogates (JSON "\\ud800") cannot be stored
    except UnicodeEncodeError:
        return False
    return True


_HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "request_id": (str,), "target_model_id": (str,), "drafter_version": (str,),
    "aux_layer_ids": (list,), "workload": (str, type(None)), "started_at_s": (float, int),
    "finished_at_s": (float, int), "hidden_size": (int,), "hidden_dtype": (str,),
    "num_tokens": (int,), "position_start": (int,), "request_num_tokens": (int,),
    "chunk_index": (int,), "chunk_count": (int,),
}


def encode(record: Record) -> bytes:
    """Validate, then lay the record out as documented in the module docstring."""
    record.validate()
    header = json.dumps(record.header(), separators=(",", ":")).encode()
    body = b"".join((
        _PREFIX.pack(MAGIC, SCHEMA_VERSION, len(header)), header,
        np.ascontiguousarray(record.token_ids, dtype="<i4").tobytes(),
        np.ascontiguousarray(record.loss_mask, dtype=np.uint8).tobytes(),
        record.aux_hidden, record.final_hidden,
    ))
    return body + _CRC.pack(zlib.crc32(body))


def peek_version(value: bytes) -> int:
    """Schema version of an encoded value without decoding it (RecordError if not a record)."""
    if len(value) < _PREFIX.size or value[:4] != MAGIC:
        raise RecordError("not a TIDE record (bad magic)")
    return _PREFIX.unpack_from(value)[1]


def decode(value: bytes, max_bytes: int | None = None) -> Record:
    """Parse an encoded value; every inconsistency raises RecordError with its reason.

    Steps: size limit -> magic -> schema version -> CRC -> header JSON and field types ->
    section lengths from (num_tokens, hidden_size, hidden_dtype) -> arrays.
    """
    if max_bytes is not None and len(value) > max_bytes:
        raise RecordError(f"value is {len(value)} bytes, limit {max_bytes}", DEAD_OVERSIZED)
    version = peek_version(value)
    if version != SCHEMA_VERSION:
        raise RecordError(f"schema version {version}, this build reads {SCHEMA_VERSION}",
                          DEAD_UNKNOWN_VERSION)
    if len(value) < _PREFIX.size + _CRC.size:
        raise RecordError("value truncated")
    view = memoryview(value)
    (crc,) = _CRC.unpack_from(view, len(value) - _CRC.size)
    if zlib.crc32(view[:-_CRC.size]) != crc:
        raise RecordError("CRC mismatch (truncated or corrupted value)")
    header_len = _PREFIX.unpack_from(view)[2]
    start = _PREFIX.size
    if header_len > _MAX_HEADER_BYTES or start + header_len > len(value) - _CRC.size:
        raise RecordError(f"header length {header_len} out of range")
    try:
        header = json.loads(bytes(view[start:start + header_len]))
    except (ValueError, RecursionError) as exc:  # also: integers of 4300+ digits, deep nesting
        raise RecordError(f"header is not JSON: {str(exc)[:200]}") from exc
    if not isinstance(header, dict):
        raise RecordError("header is not a JSON object")
    for key, types in _HEADER_TYPES.items():
        if key not in header:
            raise RecordError(f"header lacks {key!r}")
        if not isinstance(header[key], types) or isinstance(header[key], bool):
            raise RecordError(f"header field {key!r} has type {type(header[key]).__name__}")
    if not all(type(x) is int for x in header["aux_layer_ids"]):
        raise RecordError("aux_layer_ids must be a list of integers")
    changes = header.get("version_changes", [])  # optional: records before it have none
    if not (isinstance(changes, list) and all(isinstance(c, list) and len(c) == 2 and type(c[0]) is int
                                              and isinstance(c[1], str) for c in changes)):
        raise RecordError("version_changes must be a list of [position, version] pairs")
    dtype = header["hidden_dtype"]
    if dtype not in HIDDEN_ITEMSIZE:
        raise RecordError(f"unknown hidden_dtype {dtype!r}")
    t, h, item = header["num_tokens"], header["hidden_size"], HIDDEN_ITEMSIZE[dtype]
    if t < 0 or h <= 0:
        raise RecordError(f"bad shape: num_tokens={t} hidden_size={h}")
    sizes = (4 * t, t, 3 * h * t * item, h * t * item)
    pos = start + header_len
    if pos + sum(sizes) + _CRC.size != len(value):
        raise RecordError(f"value is {len(value)} bytes; header implies "
                          f"{pos + sum(sizes) + _CRC.size}")
    sections = []
    for size in sizes:
        sections.append(view[pos:pos + size])
        pos += size
    try:
        record = Record(
            request_id=header["request_id"], target_model_id=header["target_model_id"],
            drafter_version=header["drafter_version"],
            aux_layer_ids=tuple(header["aux_layer_ids"]),
            workload=header["workload"], started_at_s=float(header["started_at_s"]),
            finished_at_s=float(header["finished_at_s"]), hidden_size=h, hidden_dtype=dtype,
            token_ids=np.frombuffer(sections[0], dtype="<i4"),
            loss_mask=np.frombuffer(sections[1], dtype=np.uint8),
            aux_hidden=sections[2], final_hidden=sections[3],
            position_start=header["position_start"],
            request_num_tokens=header["request_num_tokens"],
            chunk_index=header["chunk_index"], chunk_count=header["chunk_count"],
            version_changes=tuple((p, v) for p, v in changes))
    except (TypeError, ValueError, OverflowError) as exc:  # float(10**400)
        raise RecordError(f"bad header value: {exc}") from exc
    record.validate()
    return record


def split(record: Record, max_message_bytes: int) -> list[Record]:
    """Split by positions so every encoded chunk is at most ``max_message_bytes``.

    Steps: measure the encoded overhead of a chunk header (worst case: largest indices), derive
    positions per chunk from bytes per position, slice arrays and hidden bytes row-wise.
    """
    record.validate()
    t = record.num_tokens
    probe = dataclasses.replace(record, position_start=t, request_num_tokens=t,
                                chunk_index=t, chunk_count=t + 1)
    overhead = (_PREFIX.size + _CRC.size + 16
                + len(json.dumps(probe.header(), separators=(",", ":")).encode()))
    per_chunk = (max_message_bytes - overhead) // record.bytes_per_token
    if per_chunk < 1:
        raise RecordError(f"one position needs {record.bytes_per_token + overhead} bytes, more than "
                          f"max_message_bytes={max_message_bytes}", DEAD_OVERSIZED)
    count = max(1, -(-t // per_chunk))
    item = HIDDEN_ITEMSIZE[record.hidden_dtype]
    aux_row, final_row = 3 * record.hidden_size * item, record.hidden_size * item
    chunks = []
    for index in range(count):
        a, b = index * per_chunk, min(t, (index + 1) * per_chunk)
        chunks.append(dataclasses.replace(
            record, token_ids=record.token_ids[a:b], loss_mask=record.loss_mask[a:b],
            aux_hidden=record.aux_hidden[a * aux_row:b * aux_row],
            final_hidden=record.final_hidden[a * final_row:b * final_row],
            position_start=record.position_start + a, request_num_tokens=t,
            chunk_index=index, chunk_count=count))
    return chunks


_FP8_E4M3_TABLE: np.ndarray | None = None


def _fp8_e4m3_table() -> np.ndarray:
    """float32 value of every float8_e4m3fn bit pattern (no infinities; 0x7f/0xff are NaN)."""
    global _FP8_E4M3_TABLE
    if _FP8_E4M3_TABLE is None:
        bits = np.arange(256, dtype=np.uint32)
        sign = np.where(bits & 0x80, -1.0, 1.0)
        exp = (bits >> 3) & 0xF
        mant = (bits & 0x7).astype(np.float64)
        value = np.where(exp == 0, mant / 8.0 * 2.0 ** -6, (1 + mant / 8.0) * 2.0 ** (exp - 7.0))
        value = sign * value
        value[(bits & 0x7F) == 0x7F] = np.nan
        _FP8_E4M3_TABLE = value.astype(np.float32)
    return _FP8_E4M3_TABLE


def hidden_to_float32(raw: bytes, dtype: str, hidden_width: int) -> np.ndarray:
    """Raw hidden bytes -> float32 [T, hidden_width]; exact for both storage dtypes."""
    if dtype == "bfloat16":
        halves = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        flat = halves.view(np.float32)
    elif dtype == "float8_e4m3fn":
        flat = _fp8_e4m3_table()[np.frombuffer(raw, dtype=np.uint8)]
    else:
        raise RecordError(f"unknown hidden_dtype {dtype!r}")
    if flat.size % hidden_width:
        raise RecordError(f"{flat.size} values do not divide into rows of {hidden_width}")
    return flat.reshape(-1, hidden_width)


def hidden_bytes(tensor, dtype: str) -> bytes:
    """Row-major raw bytes of a torch ``tensor`` cast to the storage ``dtype`` (a copy; never aliases).
    The one encoder of hidden states: capture and the training-side record writer both call it."""
    import torch

    bits = torch.int16 if HIDDEN_ITEMSIZE[dtype] == 2 else torch.uint8
    cast = tensor.detach().to(device="cpu", dtype=getattr(torch, dtype)).contiguous()
    return cast.view(bits).numpy().tobytes()
