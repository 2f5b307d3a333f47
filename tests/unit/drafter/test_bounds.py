"""Hostile drafter configs are refused with a DrafterError naming the field, before the drafter
module is built (no memory is allocated from a size read in config.json)."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tide.drafter import artifact
from tide.drafter.artifact import DrafterError, TargetSpec, load_drafter, save_drafter
from tide.drafter.bounds import LIMITS, expected_state
from tide.drafter.model import Eagle3Drafter

# (what, config.json changes, the words the error must carry)
BAD_CONFIGS = [
    ("zero heads", {"num_attention_heads": 0}, "num_heads 0 outside"),
    ("negative kv heads", {"num_key_value_heads": -2}, "num_kv_heads -2 outside"),
    ("heads not a multiple of kv heads", {"num_attention_heads": 3, "num_key_value_heads": 2}, "not a multiple"),
    ("odd head_dim", {"head_dim": 15}, "must be even"),
    ("huge intermediate", {"intermediate_size": 1 << 40}, "intermediate_size"),
    ("float size", {"hidden_size": 64.0}, "hidden_size must be an integer"),
    ("string size", {"intermediate_size": "128"}, "intermediate_size must be an integer"),
    ("bool size", {"draft_vocab_size": True}, "draft_vocab_size must be an integer"),
    ("draft vocab beyond vocab", {"draft_vocab_size": 100_000, "vocab_size": 512}, "exceeds vocab_size"),
    ("huge positions", {"max_position_embeddings": 1 << 30}, "max_position_embeddings"),
    ("positions x head_dim beyond the RoPE limit", {"max_position_embeddings": 1 << 20, "head_dim": 1 << 9},
     "RoPE table"),
    ("NaN rope theta", {"rope_theta": float("nan")}, "rope_theta must be a finite number"),
    ("negative eps", {"rms_norm_eps": -1.0}, "rms_norm_eps must be a finite number"),
    ("two aux layers", {"tide_aux_layer_ids": [1, 2]}, "aux layer ids must be 3 integers"),
    ("aux layer id not an int", {"tide_aux_layer_ids": [1, 2, "x"]}, "aux layer ids must be 3 integers"),
    ("fc_norm as a string", {"fc_norm": "false"}, "fc_norm must be true or false"),
    ("not a mapping", [1, 2, 3], "must hold a JSON object"),
    ("sizes larger than the weights hold", {"intermediate_size": LIMITS.intermediate_size},
     "has shape"),
]


@pytest.fixture()
def saved(tiny_drafter, tmp_path):
    return save_drafter(tiny_drafter, tmp_path / "d")


@pytest.fixture()
def builds(monkeypatch):
    """Every drafter module the loader builds for real (the bounds build theirs on the meta device)."""
    built = []

    class Recording(Eagle3Drafter):
        def __init__(self, shape):
            built.append(shape)
            super().__init__(shape)
    monkeypatch.setattr(artifact, "Eagle3Drafter", Recording)
    return built


def write_config(folder, change):
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, **change} if isinstance(change, dict) else change))


@pytest.mark.parametrize("what,change,words", BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS])
def test_hostile_config_is_refused_before_the_module_is_built(saved, builds, what, change, words):
    write_config(saved, change)
    with pytest.raises(DrafterError, match="config.json|tensor|shape") as info:
        load_drafter(saved)
    assert words in str(info.value), str(info.value)
    assert builds == [], f"{what}: a drafter was allocated before the refusal"


def test_a_valid_drafter_is_built_once(saved, builds, tiny_drafter):
    load_drafter(saved)
    assert builds == [tiny_drafter.shape]


def test_positions_must_cover_the_engine_and_oversized_json_is_not_read(saved, tiny_drafter):
    s = tiny_drafter.shape
    spec = TargetSpec(s.target_hidden_size, s.vocab_size, s.aux_layer_ids, max_positions=s.max_position_embeddings)
    load_drafter(saved, spec)
    write_config(saved, {"max_position_embeddings": 16})
    with pytest.raises(DrafterError, match="max_position_embeddings 16 < the engine's"):
        load_drafter(saved, spec)
    (saved / "tide.json").write_text(" " * (LIMITS.config_bytes + 1))
    with pytest.raises(DrafterError, match="larger than"):
        load_drafter(saved)


def test_header_names_and_shapes_are_checked_without_loading(saved, builds):
    state = load_file(str(saved / "model.safetensors"))
    state["extra.weight"] = torch.zeros(2)
    save_file(state, str(saved / "model.safetensors"))
    (saved / "tide.json").unlink()
    with pytest.raises(DrafterError, match="unexpected \\['extra.weight'\\]"):
        load_drafter(saved)
    assert builds == []


def test_expected_state_equals_the_real_module(tiny_drafter):
    real = {k: tuple(v.shape) for k, v in Eagle3Drafter(tiny_drafter.shape).state_dict().items()}
    assert expected_state(tiny_drafter.shape) == real
