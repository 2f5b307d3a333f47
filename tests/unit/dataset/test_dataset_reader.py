"""The reader joins chunks (also across files), skips incomplete requests and duplicates."""
import numpy as np
import torch

from tide.dataset.index import INDEX_NAME, DatasetIndex
from tide.dataset.reader import DatasetReader
from tide.records import hidden_to_float32, split


def test_samples_are_whole_requests_with_float_tensors(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    recs = [helpers.make_record(f"r{i}", t=30 + i, seed=i) for i in range(3)]
    stats, rids = helpers.write_file(tmp_path, recs, max_message_bytes=1500)
    index.add(stats, rids)
    samples = list(DatasetReader(tmp_path).samples(batch_rows=3))
    assert [s.request_id for s in samples] == ["r0", "r1", "r2"]
    for rec, s in zip(recs, samples):
        assert torch.equal(s.token_ids, torch.from_numpy(rec.token_ids.astype(np.int64)))
        assert s.loss_mask.tolist() == rec.loss_mask.tolist()
        assert s.aux_hidden.dtype == torch.float32 and s.aux_hidden.shape == (rec.num_tokens, 3 * helpers.H)
        expected = hidden_to_float32(rec.final_hidden, "bfloat16", helpers.H)
        assert np.array_equal(s.final_hidden.numpy(), expected, equal_nan=True)


def test_chunks_split_over_files_duplicates_and_missing(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    rec = helpers.make_record("split", t=40)
    chunks = split(rec, 1500)
    assert len(chunks) >= 3
    half = len(chunks) // 2
    s1, r1 = helpers.write_file(tmp_path, chunks[:half], first_offset=0)
    s2, r2 = helpers.write_file(tmp_path, chunks[half:] + [chunks[0]], first_offset=100)
    lost = split(helpers.make_record("lost", t=40), 1500)
    s3, r3 = helpers.write_file(tmp_path, lost[:-1], first_offset=200)
    for s, r in ((s1, r1), (s2, r2), (s3, r3)):
        index.add(s, r)
    reader = DatasetReader(tmp_path)
    samples = list(reader.samples(files=[tmp_path / s1.path, tmp_path / s2.path, tmp_path / s3.path]))
    assert [s.request_id for s in samples] == ["split"]
    assert samples[0].token_ids.tolist() == rec.token_ids.tolist()
    assert reader.duplicates == 1 and reader.incomplete == 1


def test_time_window_and_model_filter(tmp_path, helpers):
    index = DatasetIndex(tmp_path)
    t0 = 1_700_000_000.0
    for i, model in enumerate(["a/m", "b/m", "a/m"]):
        s, r = helpers.write_file(tmp_path, [helpers.make_record(f"r{i}", at_s=t0 + 7200 * i, model=model)],
                                  first_offset=i)
        index.add(s, r)
    reader = DatasetReader(tmp_path)
    assert [s.request_id for s in reader.samples(since_s=t0 + 1)] == ["r1", "r2"]
    assert [s.request_id for s in reader.samples(target_model="a/m")] == ["r0", "r2"]
    assert len(reader.files(until_s=t0 + 7200)) == 1


def test_reader_opens_the_index_read_only_and_falls_back_to_the_files(tmp_path, helpers):
    # a retrain Job mounts the dataset read-only: the reader must not write, and where SQLite
    # cannot read the index that way, the rows are still all there (filtered row by row)
    index = DatasetIndex(tmp_path)
    t0 = 1_700_000_000.0
    for i in range(3):
        s, r = helpers.write_file(tmp_path, [helpers.make_record(f"r{i}", at_s=t0 + 7200 * i)], first_offset=i)
        index.add(s, r)
    index.close()
    db = tmp_path / INDEX_NAME
    assert db.exists(), sorted(p.name for p in tmp_path.iterdir())
    before = db.read_bytes()
    reader = DatasetReader(tmp_path)
    assert len(reader.files(since_s=t0 + 1)) == 2
    assert db.read_bytes() == before  # nothing written through the reader's connection
    db.write_bytes(b"not a database" * 100)  # e.g. unreadable on this mount
    assert len(reader.files()) == 3
    assert [s.request_id for s in reader.samples(since_s=t0 + 1)] == ["r1", "r2"]
