"""The Parquet schema file matches the code; rows round-trip through Parquet."""
import json
from importlib import resources

import numpy as np
import pyarrow.parquet as pq

from tide.dataset.schema import PARQUET_SCHEMA, FileName, Row, partition_dir, row_to_record, rows_to_table

SCHEMA_FILE = resources.files("tide.schemas").joinpath("parquet.schema.json")  # package data: schemas/


def test_schema_file_matches_code():
    doc = json.loads(SCHEMA_FILE.read_text())
    assert [(f["name"], f["type"]) for f in doc["fields"]] == \
        [(f.name, str(f.type)) for f in PARQUET_SCHEMA]


def test_rows_round_trip_through_parquet(tmp_path, helpers):
    recs = [helpers.make_record(f"r{i}", t=3 + i, seed=i) for i in range(4)]
    rows = [Row(r, "topic.x", 3, 100 + i, 1234, 5.0) for i, r in enumerate(recs)]
    pq.write_table(rows_to_table(rows), tmp_path / "x.parquet")
    table = pq.read_table(tmp_path / "x.parquet")
    assert table.schema.equals(PARQUET_SCHEMA)
    assert table.column("kafka_offset").to_pylist() == [100, 101, 102, 103]
    for rec, row in zip(recs, table.to_pylist()):
        back = row_to_record(row)
        assert back.aux_hidden == rec.aux_hidden and back.final_hidden == rec.final_hidden
        assert np.array_equal(back.token_ids, rec.token_ids)
        assert np.array_equal(back.loss_mask, rec.loss_mask)


def test_file_names_and_partition_dirs():
    name = FileName("tide.hidden-states", 2, 17, 4096, FileName.tag_for("r1", 0, 123))
    assert FileName.parse(str(name)) == name
    assert FileName.tag_for("r1", 0, 123) != FileName.tag_for("r2", 0, 123)
    assert FileName.parse(".abc.tmp") is None
    assert partition_dir("HuggingFaceTB/SmolLM2", 0.0) == \
        "target_model=HuggingFaceTB%2FSmolLM2/date=1970-01-01/hour=00"
