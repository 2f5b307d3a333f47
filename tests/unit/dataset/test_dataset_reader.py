"""The reader joins chunks (also across files), skips incomplete requests and duplicates, and
reads one pinned table version."""
import numpy as np
import torch

from tide.dataset.reader import DatasetReader
from tide.dataset.table import DatasetTable
from tide.records import hidden_to_float32, split


def test_samples_are_whole_requests_with_float_tensors(tmp_path, helpers):
    recs = [helpers.make_record(f"r{i}", t=30 + i, seed=i) for i in range(3)]
    helpers.write_file(tmp_path, recs, max_message_bytes=1500)
    samples = list(DatasetReader(tmp_path).samples(batch_rows=3))
    assert [s.request_id for s in samples] == ["r0", "r1", "r2"]
    for rec, s in zip(recs, samples):
        assert torch.equal(s.token_ids, torch.from_numpy(rec.token_ids.astype(np.int64)))
        assert s.loss_mask.tolist() == rec.loss_mask.tolist()
        assert s.aux_hidden.dtype == torch.float32 and s.aux_hidden.shape == (rec.num_tokens, 3 * helpers.H)
        expected = hidden_to_float32(rec.final_hidden, "bfloat16", helpers.H)
        assert np.array_equal(s.final_hidden.numpy(), expected, equal_nan=True)


def test_chunks_split_over_files_duplicates_and_missing(tmp_path, helpers):
    rec = helpers.make_record("split", t=40)
    chunks = split(rec, 1500)
    assert len(chunks) >= 3
    half = len(chunks) // 2
    helpers.write_file(tmp_path, chunks[:half], first_offset=0)
    helpers.write_file(tmp_path, chunks[half:] + [chunks[0]], first_offset=100)
    lost = split(helpers.make_record("lost", t=40), 1500)
    helpers.write_file(tmp_path, lost[:-1], first_offset=200)
    reader = DatasetReader(tmp_path)
    samples = list(reader.samples())
    assert [s.request_id for s in samples] == ["split"]
    assert samples[0].token_ids.tolist() == rec.token_ids.tolist()
    assert reader.duplicates == 1 and reader.incomplete == 1


def test_time_window_and_model_filter(tmp_path, helpers):
    t0 = 1_700_000_000.0
    for i, model in enumerate(["a/m", "b/m", "a/m"]):
        helpers.write_file(tmp_path, [helpers.make_record(f"r{i}", at_s=t0 + 7200 * i, model=model)], first_offset=i)
    reader = DatasetReader(tmp_path)
    assert [s.request_id for s in reader.samples(since_s=t0 + 1)] == ["r1", "r2"]
    assert [s.request_id for s in reader.samples(target_model="a/m")] == ["r0", "r2"]
    assert len(reader.files(until_s=t0 + 7200)) == 1


def test_a_reader_pinned_to_a_version_ignores_later_commits_and_skips_vacuumed_files(tmp_path, helpers):
    t0 = 1_700_000_000.0
    helpers.write_file(tmp_path, [helpers.make_record("old", at_s=t0)])
    pinned = DatasetReader(tmp_path, version=DatasetTable(tmp_path).version())
    helpers.write_file(tmp_path, [helpers.make_record("new", at_s=t0 + 1)], first_offset=1)
    assert [s.request_id for s in pinned.samples()] == ["old"]
    assert [s.request_id for s in DatasetReader(tmp_path).samples()] == ["old", "new"]
    (gone,) = pinned.files()
    (tmp_path / gone.path).unlink()  # as VACUUM does once no retained version references it
    assert list(pinned.samples()) == [] and pinned.missing_files == 1
