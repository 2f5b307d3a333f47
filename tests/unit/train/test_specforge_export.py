"""A window exported by TIDE is read by SpecForge's own offline reader, loader and vocab loader.

SpecForge 0.2.0 is installed with --no-deps (scripts/install.sh); torch.compile is disabled as in
tests/unit/drafter/test_specforge_compat.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

from tide.train.capture_log import log_samples  # noqa: E402
from tide.train.specforge_export import export_specforge, sample_path  # noqa: E402
from tide.train.trainer import Sample  # noqa: E402
from tide.train.window import WindowSpec, plan_window  # noqa: E402

reader_mod = pytest.importorskip("specforge.runtime.data_plane.offline_reader",
                                 reason="specforge must be installed (scripts/install.sh)")


@pytest.fixture(scope="module")
def exported(tiny_drafter, tmp_path_factory):
    shape = tiny_drafter.shape
    h, g = shape.hidden_size, torch.Generator().manual_seed(0)
    samples = []
    for i in range(30):
        t = 12 + i
        samples.append(Sample(tokens=torch.randint(0, shape.vocab_size, (t,), generator=g), loss_mask=torch.ones(t),
                              aux=torch.randn(t, 3 * h, generator=g), final=torch.randn(t, h, generator=g)))
    data_dir = tmp_path_factory.mktemp("dataset")
    log_samples(data_dir, samples, [5] * len(samples), target_model_id="org/m", aux_layer_ids=(1, 2, 3),
                start_s=1_700_000_000.0, id_prefix="r", max_message_bytes=8000)
    plan = plan_window(data_dir, WindowSpec(heldout_fraction=0.2, target_model="org/m"))
    out = tmp_path_factory.mktemp("export") / "specforge"
    manifest = export_specforge(data_dir, plan, out, tiny_drafter.d2t, tiny_drafter.t2d)
    return out, manifest, plan, samples


def test_specforge_reader_lists_and_loads_every_sample(exported):
    from specforge.algorithms.eagle3.data import normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file

    out, manifest, plan, samples = exported
    assert manifest["samples"] == len(plan.train_ids) > 0 and manifest["missing"] == 0
    refs = reader_mod.OfflineManifestReader(str(out), validate_files=True, max_len=64).read()
    assert len(refs) == manifest["samples"]
    assert all(ref.feature_store_uri.startswith("file://") and ref.num_tokens > 0 for ref in refs)
    assert sample_path(out, 0).is_file()
    for index, rid in enumerate(manifest["request_ids"]):
        original = samples[int(rid.split("-")[1])]
        raw = load_feature_file(str(sample_path(out, index)))
        t = len(original)
        assert raw["input_ids"].dtype == torch.int64 and torch.equal(raw["input_ids"], original.tokens)
        assert raw["aux_hidden_state"].shape == (1, t, original.aux.shape[1])
        assert torch.equal(raw["hidden_state"][0], original.final.to(torch.bfloat16))
        assert raw["loss_mask"].tolist() == [0] * 5 + [1] * (t - 5)  # captured mask
        norm = normalize_offline_sample(raw, max_len=64)
        assert norm["input_ids"].shape == (1, t) and norm["loss_mask"][0, -1] == 0
        assert norm["hidden_state"].shape == (1, t, original.aux.shape[1])
    assert not set(manifest["request_ids"]) & set(plan.heldout)  # held-out data is not exported


def test_specforge_counts_tokens_and_loads_the_vocab_mapping(exported, tiny_drafter):
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3
    from specforge.training.vocab_mapping import count_effective_feature_tokens
    from transformers import LlamaConfig

    out, manifest, _, _ = exported
    counts = count_effective_feature_tokens(str(out), max_length=64, target_vocab_size=tiny_drafter.shape.vocab_size)
    assert sum(counts.values()) > 0
    cfg = LlamaConfig(**tiny_drafter.shape.to_hf_config())
    model = LlamaForCausalLMEagle3(cfg, attention_backend="sdpa")
    model.load_vocab_mapping(str(out / "vocab_mapping" / "vocab_mapping.pt"))
    assert torch.equal(model.d2t, tiny_drafter.d2t) and torch.equal(model.t2d.bool(), tiny_drafter.t2d)
    assert json.loads((out / "tide_export.json").read_text())["samples"] == manifest["samples"]
