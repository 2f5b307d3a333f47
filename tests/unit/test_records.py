"""Record encoding: round trips, chunking, garbage rejection, dtype conversion, schema file."""
import dataclasses
import json
import struct
from importlib import resources

import numpy as np
import pytest
import torch

from tide import contracts, records
from tide.records import Record, RecordError, decode, encode, hidden_to_float32, split

SCHEMA_FILE = resources.files("tide.schemas").joinpath("record_value.schema.json")  # package data: schemas/


def make_record(t: int = 7, h: int = 16, dtype: str = "bfloat16", seed: int = 0) -> Record:
    rng = np.random.default_rng(seed)
    item = contracts.HIDDEN_ITEMSIZE[dtype]
    return Record(
        request_id=f"req-{seed}", target_model_id="org/model", drafter_version="v3",
        aux_layer_ids=(2, 15, 27), workload="code", started_at_s=1000.5, finished_at_s=1001.25,
        hidden_size=h, hidden_dtype=dtype,
        token_ids=rng.integers(0, 49152, t).astype(np.int32),
        loss_mask=(np.arange(t) >= 3).astype(np.uint8),
        aux_hidden=rng.bytes(t * 3 * h * item), final_hidden=rng.bytes(t * h * item))


def assert_same(a: Record, b: Record) -> None:
    for f in dataclasses.fields(Record):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f.name
        elif f.name == "request_num_tokens":
            assert (x or a.num_tokens) == (y or b.num_tokens)
        else:
            assert x == y, f.name


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_round_trip(dtype):
    rec = make_record(dtype=dtype)
    assert_same(decode(encode(rec)), rec)


def test_round_trip_empty_workload_and_zero_tokens():
    rec = dataclasses.replace(make_record(t=0), workload=None)
    out = decode(encode(rec))
    assert out.num_tokens == 0 and out.workload is None


def test_split_chunks_fit_and_rejoin():
    rec = make_record(t=200, h=32)
    limit = 20_000
    chunks = split(rec, limit)
    assert len(chunks) > 1
    values = [encode(c) for c in chunks]
    assert all(len(v) <= limit for v in values)
    decoded = [decode(v) for v in values]
    assert [c.chunk_index for c in decoded] == list(range(len(chunks)))
    assert {c.chunk_count for c in decoded} == {len(chunks)}
    assert {c.request_num_tokens for c in decoded} == {200}
    assert np.array_equal(np.concatenate([c.token_ids for c in decoded]), rec.token_ids)
    assert b"".join(c.aux_hidden for c in decoded) == rec.aux_hidden
    assert b"".join(c.final_hidden for c in decoded) == rec.final_hidden
    starts = [c.position_start for c in decoded]
    assert starts == [sum(c.num_tokens for c in decoded[:i]) for i in range(len(decoded))]


def test_split_refuses_a_position_larger_than_the_limit():
    with pytest.raises(RecordError) as err:
        split(make_record(h=4096), 10_000)
    assert err.value.reason == contracts.DEAD_OVERSIZED


def test_garbage_is_rejected_with_a_reason():
    value = encode(make_record())
    cases = {
        b"": contracts.DEAD_MALFORMED,
        b"hello world, not a record": contracts.DEAD_MALFORMED,
        value[:-10]: contracts.DEAD_MALFORMED,  # truncated
        value[:40] + bytes([value[40] ^ 0xFF]) + value[41:]: contracts.DEAD_MALFORMED,  # CRC
        value[:4] + struct.pack("<H", 99) + value[6:]: contracts.DEAD_UNKNOWN_VERSION,
        np.random.default_rng(1).bytes(5000): contracts.DEAD_MALFORMED,
    }
    for garbage, reason in cases.items():
        with pytest.raises(RecordError) as err:
            decode(garbage)
        assert err.value.reason == reason, garbage[:20]
    with pytest.raises(RecordError) as err:
        decode(value, max_bytes=len(value) - 1)
    assert err.value.reason == contracts.DEAD_OVERSIZED


def test_consistent_crc_but_lying_header_is_rejected():
    rec = make_record()
    header = rec.header()
    header["num_tokens"] = 6  # sections no longer match the header
    raw = json.dumps(header).encode()
    body = records._PREFIX.pack(records.MAGIC, records.SCHEMA_VERSION, len(raw)) + raw
    body += encode(rec)[records._PREFIX.size + len(json.dumps(rec.header(), separators=(",", ":"))):-4]
    value = body + struct.pack("<I", __import__("zlib").crc32(body))
    with pytest.raises(RecordError, match="header implies"):
        decode(value)


def test_encode_validates_shapes():
    with pytest.raises(RecordError, match="aux_hidden"):
        encode(dataclasses.replace(make_record(), aux_hidden=b"\0" * 10))
    with pytest.raises(RecordError, match="hidden_dtype"):
        encode(dataclasses.replace(make_record(), hidden_dtype="float16"))


def test_bf16_bytes_decode_to_torch_values():
    x = torch.randn(5, 12) * 100
    raw = x.to(torch.bfloat16).view(torch.int16).numpy().tobytes()
    got = torch.from_numpy(hidden_to_float32(raw, "bfloat16", 12))
    assert torch.equal(got, x.to(torch.bfloat16).float())


def test_fp8_table_matches_torch_for_every_bit_pattern():
    bits = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    expected = bits.view(torch.float8_e4m3fn).float()
    got = torch.from_numpy(hidden_to_float32(bits.numpy().tobytes(), "float8_e4m3fn", 1)).flatten()
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan], expected[~nan])


def test_schema_file_matches_the_header():
    schema = json.loads(SCHEMA_FILE.read_text())
    header = make_record().header()
    assert set(header) == set(schema["properties"])
    # optional: records written before version changes existed lack it, and decode as none
    assert set(header) - set(schema["required"]) == {"version_changes"}
    assert schema["x-schema-version"] == records.SCHEMA_VERSION
    json_types = {"string": str, "integer": int, "number": (int, float), "array": list,
                  "null": type(None)}
    for key, spec in schema["properties"].items():
        if "enum" in spec:
            assert header[key] in spec["enum"]
            assert set(spec["enum"]) == set(contracts.HIDDEN_ITEMSIZE)
            continue
        types = spec["type"] if isinstance(spec["type"], list) else [spec["type"]]
        assert isinstance(header[key], tuple(json_types[t] for t in types)), key
    layout = [s["name"] for s in schema["x-binary-layout"]]
    assert layout == ["magic", "schema_version", "header_len", "header", "token_ids", "loss_mask",
                      "aux_hidden", "final_hidden", "crc32"]


def test_schema_file_states_the_value_limits_validate_enforces():
    props = json.loads(SCHEMA_FILE.read_text())["properties"]
    for key in ("request_id", "target_model_id"):
        assert (props[key]["minLength"], props[key]["maxLength"]) == (1, records.MAX_ID_CHARS)
    assert props["drafter_version"]["maxLength"] == records.MAX_ID_CHARS
    assert props["workload"]["maxLength"] == records.MAX_WORKLOAD_CHARS
    assert props["aux_layer_ids"]["maxItems"] == records.MAX_AUX_LAYERS
    for key in ("started_at_s", "finished_at_s"):
        assert props[key]["exclusiveMaximum"] == records.MAX_CAPTURE_TIME_S
    for key in ("hidden_size", "position_start", "request_num_tokens", "chunk_count"):
        assert props[key]["maximum"] == records.INT32_MAX
    assert props["aux_layer_ids"]["items"]["maximum"] == records.INT32_MAX


def test_encode_refuses_what_the_dataset_cannot_store():
    for change in ({"finished_at_s": float("nan")}, {"started_at_s": float("inf")},
                   {"request_id": "x" * 257}, {"workload": "line\nbreak"}, {"position_start": 2**31}):
        with pytest.raises(RecordError) as err:
            encode(dataclasses.replace(make_record(), **change))
        assert err.value.reason == contracts.DEAD_INVALID, change


def test_version_changes_round_trip_and_name_the_version_at_each_position():
    rec = dataclasses.replace(make_record(t=40), position_start=0, version_changes=((12, "v4"), (30, "v5")))
    back = decode(encode(rec))
    assert back.version_changes == ((12, "v4"), (30, "v5"))
    assert [back.drafter_version_at(p) for p in (0, 11, 12, 29, 30, 39)] == ["v3", "v3", "v4", "v4", "v5", "v5"]
    for chunk in (decode(encode(c)) for c in split(rec, 2_000)):  # every chunk names the request's swaps
        assert chunk.version_changes == rec.version_changes


def test_records_without_version_changes_still_decode():
    """A producer from before the field existed: its header lacks the key."""
    rec = make_record()
    header = rec.header()
    del header["version_changes"]
    raw = json.dumps(header).encode()
    body = struct.pack("<4sHI", b"TIDR", records.SCHEMA_VERSION, len(raw)) + raw + encode(rec)[
        10 + len(json.dumps(rec.header(), separators=(",", ":")).encode()):-4]
    value = body + struct.pack("<I", __import__("zlib").crc32(body))
    assert decode(value).version_changes == ()


@pytest.mark.parametrize("changes", [((5, "v4"), (5, "v5")), ((-1, "v4"),), ((3, "x" * 300),), ((3, "bad\n"),)])
def test_bad_version_changes_are_invalid(changes):
    with pytest.raises(RecordError) as err:
        encode(dataclasses.replace(make_record(), version_changes=changes))
    assert err.value.reason == contracts.DEAD_INVALID
