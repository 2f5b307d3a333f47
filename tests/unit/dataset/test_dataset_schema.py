"""The schema file matches the code; rows round-trip through Parquet; partitions are date/hour."""
import json
from importlib import resources

import numpy as np
import pyarrow.parquet as pq

from tide.dataset.schema import (
    PARQUET_SCHEMA,
    PARTITION_COLUMNS,
    TABLE_SCHEMA,
    Row,
    partition_path,
    partition_start_s,
    partition_values,
    row_to_record,
    rows_to_table,
)

SCHEMA_FILE = resources.files("tide.schemas").joinpath("parquet.schema.json")  # package data: schemas/


def test_schema_file_matches_code():
    doc = json.loads(SCHEMA_FILE.read_text())
    assert [(f["name"], f["type"]) for f in doc["fields"]] == \
        [(f.name, str(f.type)) for f in PARQUET_SCHEMA]
    assert [(f["name"], f["type"]) for f in doc["partition_columns"]] == \
        [(name, str(TABLE_SCHEMA.field(name).type)) for name in PARTITION_COLUMNS]


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


def test_partitions_are_the_utc_date_and_hour_of_the_capture():
    values = partition_values(1_700_000_000.0 + 0.5)  # 2023-11-14 22:13:20 UTC
    assert values == {"date": "2023-11-14", "hour": "22"}
    assert partition_path(values) == "date=2023-11-14/hour=22"
    assert partition_start_s(values) == 1_699_999_200.0 and partition_values(0.0) == {"date": "1970-01-01", "hour": "0"}
