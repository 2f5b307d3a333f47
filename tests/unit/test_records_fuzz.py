"""Hostile record values: the decoder either returns a record the dataset can store or raises
RecordError with a reason; it never raises anything else (which would crash-loop ingest).

Three sources of bad values: random byte flips and truncations (with and without a repaired CRC,
so the header parser sees them too), extreme values for every header field, and random header
mutations built from those extremes. A decoded record must also survive what ingest does with it
later: its partition directory, a Parquet row group and the index (values that only failed at
seal time used to make ingest replay the same file forever)."""
import json
import random
import sqlite3
import struct
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tide import contracts, records
from tide.dataset.schema import Row, partition_dir, rows_to_table
from tide.records import Record, RecordError, decode, encode

H = 4
REASONS = {contracts.DEAD_MALFORMED, contracts.DEAD_INVALID, contracts.DEAD_UNKNOWN_VERSION,
           contracts.DEAD_OVERSIZED}


def _record(t: int = 3) -> Record:
    rng = np.random.default_rng(0)
    return Record(request_id="req-1", target_model_id="org/m", drafter_version="v1",
                  aux_layer_ids=(1, 2, 3), workload="chat", started_at_s=1.7e9, finished_at_s=1.7e9 + 1,
                  hidden_size=H, hidden_dtype="bfloat16",
                  token_ids=rng.integers(0, 1000, t).astype(np.int32), loss_mask=np.ones(t, np.uint8),
                  aux_hidden=rng.bytes(t * 3 * H * 2), final_hidden=rng.bytes(t * H * 2))


BASE = _record()
VALUE = encode(BASE)
_HEADER_LEN = records._PREFIX.unpack_from(VALUE)[2]
BODY = VALUE[records._PREFIX.size + _HEADER_LEN:-records._CRC.size]


def with_header(header: bytes, body: bytes = BODY) -> bytes:
    """A value with this raw header and a correct CRC (the CRC is no defence against a bad producer)."""
    value = records._PREFIX.pack(records.MAGIC, records.SCHEMA_VERSION, len(header)) + header + body
    return value + struct.pack("<I", zlib.crc32(value))


def header_with(field: str, json_text: str, **more: str) -> bytes:
    """BASE's header with ``field`` (and each of ``more``) set to raw JSON text (NaN, 1e400, ...)."""
    raw = {k: json.dumps(v) for k, v in BASE.header().items()}
    raw.update({field: json_text, **more})
    return ("{" + ",".join(f'"{k}":{v}' for k, v in raw.items()) + "}").encode("utf-8", "surrogatepass")


def fix_crc(value: bytes) -> bytes:
    return value[:-4] + struct.pack("<I", zlib.crc32(value[:-4])) if len(value) >= 4 else value


def storable(record: Record) -> None:
    """What ingest does with a decoded record before and at seal time; raises if it cannot."""
    record.validate()
    rel = partition_dir(record.target_model_id, record.finished_at_s)
    assert all(len(part.encode()) <= 255 for part in rel.split("/")), rel
    table = rows_to_table([Row(record, "topic", 0, 0, 0, 0.0)])
    pq.write_table(table, pa.BufferOutputStream())
    db = sqlite3.connect(":memory:")
    db.execute("CREATE TABLE r (request_id TEXT, path TEXT)")
    db.execute("INSERT INTO r VALUES (?, ?)", (record.request_id, rel))


def decode_or_reason(value: bytes) -> str | None:
    """None when decoded (and storable); the reason when refused; anything else propagates."""
    try:
        record = decode(value, max_bytes=1 << 20)
    except RecordError as exc:
        assert exc.reason in REASONS, exc.reason
        return exc.reason
    storable(record)
    return None


# field -> JSON text -> reason (None = accepted); every value here crashed or wedged ingest,
# was stored unchecked, or is the boundary that must still pass
EXTREMES = {
    "finished_at_s": {"NaN": "invalid", "Infinity": "invalid", "-Infinity": "invalid",
                      "1e400": "invalid", "1e300": "invalid", "-1e18": "invalid", "-1": "invalid",
                      str(2**70): "invalid", "1" + "0" * 400: "malformed", "4102444799.5": None,
                      "0": None, '"1700000000"': "malformed", "true": "malformed", "null": "malformed"},
    "started_at_s": {"NaN": "invalid", "Infinity": "invalid", "-5": "invalid"},
    "request_id": {json.dumps("x" * 60000): "invalid", json.dumps("x" * 256): None,
                   json.dumps("x" * 257): "invalid", '""': "invalid", '"\\ud800"': "invalid",
                   '"a\\nb"': "invalid", '"a\\u0000b"': "invalid", '"\\u00e9t\\u00e9-1"': None,
                   "1": "malformed", "[]": "malformed"},
    "target_model_id": {'"\\ud800"': "invalid", json.dumps("/" * 256): None,
                        json.dumps("\u00e9" * 256): None, json.dumps("m" * 257): "invalid",
                        '""': "invalid"},
    "drafter_version": {'"\\udfff"': "invalid", json.dumps("v" * 257): "invalid", '""': None},
    "workload": {json.dumps("w" * 60000): "invalid", json.dumps("w" * 64): None,
                 json.dumps("w" * 65): "invalid", '"\\udfff"': "invalid", '""': "invalid",
                 '"a\\tb"': "invalid", "null": None, "7": "malformed"},
    "aux_layer_ids": {f"[{2**40},1,2]": "invalid", "[-1,1,2]": "invalid", "[1e400,1,2]": "malformed",
                      '[1.5,2,3]': "malformed", '["2",3,4]': "malformed", "[true,1,2]": "malformed",
                      "[[1],2,3]": "malformed", json.dumps(list(range(17))): "invalid", "[]": None,
                      '{"a":1}': "malformed"},
    "hidden_size": {"1" + "0" * 5000: "malformed", "0": "malformed", "-4": "malformed",
                    "4.0": "malformed"},
    "num_tokens": {"-1": "malformed", "2": "malformed", str(2**62): "malformed"},
    "position_start": {str(2**40): "invalid", str(2**31 - 1): None, "-1": "invalid"},
    "request_num_tokens": {str(2**40): "invalid", "-3": "invalid"},
    "chunk_index": {str(2**40): "invalid", "-1": "invalid", "1": "invalid"},
    "chunk_count": {str(2**40): "invalid", "0": "invalid"},
    "hidden_dtype": {'"float16"': "malformed", '"\\ud800"': "malformed", "null": "malformed"},
}


@pytest.mark.parametrize("field", sorted(EXTREMES))
def test_extreme_header_values_are_refused_with_their_reason(field):
    for text, reason in EXTREMES[field].items():
        assert decode_or_reason(with_header(header_with(field, text))) == reason, (field, text[:40])


def test_hidden_size_beyond_int32_with_no_positions_is_invalid():
    header = {**BASE.header(), "num_tokens": 0, "hidden_size": 2**40}
    assert decode_or_reason(with_header(json.dumps(header).encode(), b"")) == "invalid"


def test_header_structure_attacks_are_malformed():
    cases = [b"[" * 30000, b"{" * 20000, b'{"a":' * 10000, b"\xff\xfe{}", b"null", b"[]", b"1e999",
             b'{"request_id": "r"}', json.dumps({**BASE.header(), "extra": 1}).encode()[:-1]]
    for header in cases:
        assert decode_or_reason(with_header(header)) == "malformed", header[:20]


def test_array_values_outside_their_ranges_are_invalid():
    negative = BASE.token_ids.copy()
    negative[0] = -5
    mask = BASE.loss_mask.copy()
    mask[1] = 7
    for body in (negative.tobytes() + BODY[12:], BODY[:12] + mask.tobytes() + BODY[15:]):
        assert decode_or_reason(with_header(header_with("num_tokens", "3"), body)) == "invalid"


def test_header_length_and_version_extremes():
    prefix = records._PREFIX.size
    for header_len in (0, 1, 2**16, 2**32 - 1, len(VALUE)):
        value = VALUE[:6] + struct.pack("<I", header_len) + VALUE[prefix:]
        assert decode_or_reason(fix_crc(value)) == "malformed", header_len
    for version in (0, 2, 2**16 - 1):
        assert decode_or_reason(VALUE[:4] + struct.pack("<H", version) + VALUE[6:]) == "unknown_version"


def test_random_flips_truncations_and_header_mutations_decode_or_raise_record_error():
    rng = random.Random(20261202)
    outcomes = {}
    for i in range(3000):
        kind = i % 4
        value = bytearray(VALUE)
        if kind == 0:  # flips anywhere; the CRC catches them
            for _ in range(rng.randint(1, 4)):
                value[rng.randrange(len(value))] ^= 1 << rng.randrange(8)
        elif kind == 1:  # flips in the prefix and header, CRC repaired: the parser sees them
            for _ in range(rng.randint(1, 3)):
                value[rng.randrange(records._PREFIX.size + _HEADER_LEN)] = rng.randrange(256)
            value = bytearray(fix_crc(bytes(value)))
        elif kind == 2:  # truncated or extended, CRC repaired or not
            cut = rng.randrange(len(value) + 8)
            value = value[:cut] if cut <= len(value) else value + bytes(cut - len(value))
            if rng.random() < 0.5:
                value = bytearray(fix_crc(bytes(value)))
        else:  # two or three fields set to extreme values at once
            first, *others = rng.sample(sorted(EXTREMES), rng.randint(2, 3))
            value = bytearray(with_header(header_with(
                first, rng.choice(list(EXTREMES[first])),
                **{f: rng.choice(list(EXTREMES[f])) for f in others})))
        reason = decode_or_reason(bytes(value))
        outcomes[reason] = outcomes.get(reason, 0) + 1
    assert outcomes.get("malformed", 0) > 1000 and outcomes.get("invalid", 0) > 50, outcomes
