"""`tide up` with the dataset on S3 (TIDE_STACK_DATASET_STORE=s3): the stack starts SeaweedFS's S3
with the dataset's bucket, and the config it writes for its services reaches a Delta table there
(written, read back, deleted from), with the keys only in the services' environment."""
from __future__ import annotations

import os

import pytest

from tide.config import load_config
from tide.dataset.location import Location
from tide.dataset.reader import DatasetReader
from tide.dataset.retention import delete_requests
from tide.dataset.table import DatasetTable
from tide.stack import Stack, StackOptions
from tide.train.capture_log import log_samples


def test_the_stack_puts_the_dataset_on_its_local_s3(tmp_path, monkeypatch):
    import torch

    from tide.broker import LOCAL_S3_KEYS, BrokerError, find_weed
    from tide.train.trainer import Sample

    try:
        find_weed()
    except BrokerError as exc:
        pytest.skip(str(exc))
    monkeypatch.setenv("TIDE_STACK_DATASET_STORE", "s3")
    stack = Stack(StackOptions(tmp_path / "home", bootstrap_servers="127.0.0.1:1", tracking_uri="http://127.0.0.1:1"))
    try:
        stack._s3_port = stack._start_store(tmp_path / "logs")
        cfg = load_config(env={}, overrides=stack._config("127.0.0.1:1", "http://127.0.0.1:1",
                                                          {"engine": 1, "ingest": 2, "scheduler": 3}, "t"))
        assert cfg.ingest.data_dir == "s3://tide-dataset/dataset" and "AWS_SECRET_ACCESS_KEY" not in cfg.ingest.storage_options
        for key, value in LOCAL_S3_KEYS.items():  # what the stack puts in each service's environment
            monkeypatch.setenv(key, value)
        location = Location.from_config(cfg)
        g = torch.Generator().manual_seed(0)
        samples = [Sample(tokens=torch.randint(0, 100, (8,), generator=g), loss_mask=torch.ones(8),
                          aux=torch.randn(8, 24, generator=g), final=torch.randn(8, 8, generator=g)) for _ in range(3)]
        log_samples(location, samples, [2] * 3, target_model_id="org/m", aux_layer_ids=(1, 2, 3),
                    start_s=1_700_000_000.0)
        assert not (tmp_path / "home" / "dataset").exists()  # nothing on the local disk
        table = DatasetTable(location)
        assert {s.request_id for s in DatasetReader(table).samples()} == {"req-000000", "req-000001", "req-000002"}
        delete_requests(table, ["req-000001"])
        assert {s.request_id for s in DatasetReader(table).samples()} == {"req-000000", "req-000002"}
        assert os.path.exists(tmp_path / "home" / "store")  # SeaweedFS's data under the stack's home
    finally:
        stack.stop()
