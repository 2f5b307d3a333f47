"""Drafter artifacts: round trip, and every kind of bad artifact is refused with a clear error."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide.drafter.artifact import DrafterError, TargetSpec, load_drafter, save_drafter
from tide.drafter.vocab import build_d2t, mapping_digest


@pytest.fixture()
def saved(tiny_drafter, tmp_path):
    return save_drafter(tiny_drafter, tmp_path / "d", metadata={"version": "7"})


def spec_of(d):
    return TargetSpec(d.shape.target_hidden_size, d.shape.vocab_size, d.shape.aux_layer_ids)


def test_round_trip_identical_weights_and_metadata(tiny_drafter, saved):
    loaded = load_drafter(saved, spec_of(tiny_drafter), expect_vocab_mapping=mapping_digest(tiny_drafter.d2t))
    for name, tensor in tiny_drafter.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name
    meta = json.loads((saved / "tide.json").read_text())
    assert meta["version"] == "7" and len(meta["sha256"]) == 64
    cfg = json.loads((saved / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert "embed_tokens.weight" not in load_file(str(saved / "model.safetensors"))


def test_bf16_artifact_loads_back_close(tiny_drafter, tmp_path):
    folder = save_drafter(tiny_drafter, tmp_path / "b", dtype=torch.bfloat16)
    loaded = load_drafter(folder, spec_of(tiny_drafter))
    assert torch.allclose(loaded.fc.weight, tiny_drafter.fc.weight, atol=1e-2)
    assert torch.equal(loaded.d2t, tiny_drafter.d2t)


def test_checksum_mismatch_refused(tiny_drafter, saved):
    state = load_file(str(saved / "model.safetensors"))
    state["fc.weight"] = state["fc.weight"] + 1
    save_file(state, str(saved / "model.safetensors"))
    with pytest.raises(DrafterError, match="checksum mismatch"):
        load_drafter(saved, spec_of(tiny_drafter))


def test_pickle_file_refused(tiny_drafter, saved):
    torch.save({"x": torch.zeros(1)}, saved / "pytorch_model.bin")
    with pytest.raises(DrafterError, match="pickle"):
        load_drafter(saved, spec_of(tiny_drafter))


def test_other_hidden_size_refused(tiny_drafter, saved):
    with pytest.raises(DrafterError, match="hidden_size"):
        load_drafter(saved, TargetSpec(tiny_drafter.shape.hidden_size * 2, tiny_drafter.shape.vocab_size,
                                       tiny_drafter.shape.aux_layer_ids))


def test_other_aux_layers_and_vocab_refused(tiny_drafter, saved):
    s = tiny_drafter.shape
    with pytest.raises(DrafterError, match="aux layers"):
        load_drafter(saved, TargetSpec(s.hidden_size, s.vocab_size, (1, 2, 2)))
    with pytest.raises(DrafterError, match="vocab_size"):
        load_drafter(saved, TargetSpec(s.hidden_size, s.vocab_size + 1, s.aux_layer_ids))


def test_different_vocab_mapping_refused(tiny_drafter, saved):
    other = build_d2t(torch.arange(tiny_drafter.shape.vocab_size), tiny_drafter.shape.draft_vocab_size)
    with pytest.raises(DrafterError, match="vocab mapping"):
        load_drafter(saved, spec_of(tiny_drafter), expect_vocab_mapping=mapping_digest(other))


def test_broken_config_and_nan_weights_refused(tiny_drafter, tmp_path):
    folder = save_drafter(tiny_drafter, tmp_path / "n")
    (folder / "tide.json").unlink()  # no checksum recorded: content checks still apply
    state = load_file(str(folder / "model.safetensors"))
    state["lm_head.weight"][0, 0] = float("nan")
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(DrafterError, match="non-finite"):
        load_drafter(folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DrafterError, match="architectures"):
        load_drafter(folder)


def test_missing_files_refused(tmp_path):
    (tmp_path / "e").mkdir()
    with pytest.raises(DrafterError, match="missing config.json"):
        load_drafter(tmp_path / "e")


def test_rounded_weights_are_what_a_bf16_artifact_loads_back(tiny_drafter, tmp_path):
    """The online retrain evaluates the rounded candidate: its metrics describe the served weights."""
    import copy

    from tide.drafter.artifact import round_weights_

    rounded = round_weights_(copy.deepcopy(tiny_drafter), torch.bfloat16)
    assert not torch.equal(rounded.fc.weight, tiny_drafter.fc.weight)
    assert rounded.fc.weight.dtype == torch.float32
    loaded = load_drafter(save_drafter(tiny_drafter, tmp_path / "r", dtype=torch.bfloat16), spec_of(tiny_drafter))
    for (name, a), (_, b) in zip(rounded.named_parameters(), loaded.named_parameters()):
        assert torch.equal(a, b), name


def test_confidence_head_round_trips_and_is_checked(tmp_path, tiny_drafter):
    """The head is saved beside model.safetensors (whose tensors stay SpecForge's), its sha256
    recorded; a tampered, misshapen or missing head refuses the whole drafter."""
    import copy

    import pytest
    import torch
    from safetensors.torch import load_file, save_file

    from tide.drafter.artifact import DrafterError, load_drafter, save_drafter
    from tide.drafter.confidence import Confidence

    d = copy.deepcopy(tiny_drafter)
    h = d.shape.hidden_size
    d.confidence = Confidence(torch.linspace(-1, 1, 2 * h + 1), 0.25, torch.tensor([1.0, 1.3, 1.7]))
    folder = save_drafter(d, tmp_path / "with-head")
    assert set(load_file(str(folder / "model.safetensors"))) == set(tiny_drafter.state_dict())
    back = load_drafter(folder, require_checksum=True)
    assert torch.equal(back.confidence.weight, d.confidence.weight) and back.confidence.bias == 0.25
    assert torch.equal(back.confidence.temperature, d.confidence.temperature)
    assert load_drafter(save_drafter(tiny_drafter, tmp_path / "plain")).confidence is None

    head = folder / "confidence" / "head.safetensors"
    tensors = load_file(str(head))
    save_file({**tensors, "temperature": torch.tensor([1.0, -1.0, 1.0])}, str(head))
    with pytest.raises(DrafterError, match="confidence head: .*checksum"):
        load_drafter(folder)
    head.unlink()
    with pytest.raises(DrafterError, match="confidence head: .*missing"):
        load_drafter(folder)
