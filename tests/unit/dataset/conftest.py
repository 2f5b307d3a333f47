"""Helpers for dataset tests: records split into chunks, committed to a table as Kafka-like rows."""
import numpy as np
import pytest

from tide.dataset.location import Location
from tide.dataset.schema import Row, partition_values
from tide.dataset.table import DatasetTable
from tide.dataset.writer import DataFileWriter
from tide.records import Record, split

H = 8


def make_record(rid: str, t: int = 12, at_s: float = 1_700_000_000.0, model: str = "org/m",
                seed: int = 0) -> Record:
    rng = np.random.default_rng(seed)
    return Record(
        request_id=rid, target_model_id=model, drafter_version="v1", aux_layer_ids=(1, 2, 3),
        workload=None, started_at_s=at_s - 1, finished_at_s=at_s, hidden_size=H,
        hidden_dtype="bfloat16", token_ids=rng.integers(0, 1000, t).astype(np.int32),
        loss_mask=(np.arange(t) >= 4).astype(np.uint8),
        aux_hidden=rng.bytes(t * 3 * H * 2), final_hidden=rng.bytes(t * H * 2))


def write_file(uri, records, topic="t", partition=0, first_offset=0, row_group_rows=2,
               max_message_bytes=None, app_id=None):
    """Commit one data file holding ``records`` (split into chunks if a limit is given) to the
    table at ``uri``, as ingest does; returns (the file's FileOut, the new table version)."""
    location = Location.from_uri(uri)
    table = DatasetTable(location)
    table.ensure()
    writer = DataFileWriter(location, partition_values(records[0].finished_at_s), row_group_rows, 1 << 30)
    offset = first_offset
    for rec in records:
        for chunk in (split(rec, max_message_bytes) if max_message_bytes else [rec]):
            writer.add(Row(chunk, topic, partition, offset, 0, rec.finished_at_s))
            offset += 1
    out = writer.finish()
    version = table.append([out.add], out.counts, app_id, first_offset - 1, offset - 1)
    return out, version


@pytest.fixture
def helpers():
    class _H:
        pass

    h = _H()
    h.make_record, h.write_file, h.H = make_record, write_file, H
    return h
