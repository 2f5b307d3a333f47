"""A TIDE drafter in SGLang's own EAGLE3 draft model (``LlamaForCausalLMEagle3``), through the
plugin's swap path, on CPU: the manifest goes through SGLang's own deserializer, TIDE's loader
(``plugin.load_draft``, what ``--custom-weight-loader`` names) checks it against the live model and
loads it with the model's ``load_weights``. Misfits are refused and leave every parameter as it was.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tide import metrics
from tide.drafter.artifact import DrafterError, save_drafter
from tide.engine.sglang import plugin, weights
from tide.engine.sglang.engine import SGLangEngine, serialize_named_tensors
from tide.train.offline import new_drafter


def build_sglang_draft(folder: Path):
    """SGLang's draft model for ``folder``'s config, loaded as SGLang's model loader does at start
    (the safetensors' tensors through ``load_weights``)."""
    import sglang.srt.layers.rotary_embedding.base as rope
    from sglang.srt.models.llama_eagle3 import LlamaForCausalLMEagle3
    from transformers import LlamaConfig

    config = LlamaConfig(**json.loads((folder / "config.json").read_text()))
    # RotaryEmbedding looks for a CUDA rope kernel at construction unless SGLang runs its CPU
    # engine (which needs sgl-kernel's CPU build); construction only needs the native path
    cpu, rope._is_cpu = rope._is_cpu, True
    try:
        model = LlamaForCausalLMEagle3(config)
    finally:
        rope._is_cpu = cpu
    model.load_weights(load_file(str(folder / "model.safetensors")).items())
    with torch.no_grad():  # SGLang shares the target's embeddings into the draft; none here (uninitialised memory)
        model.model.embed_tokens.weight.zero_()
    return model


def sglang_params_of(drafter) -> dict[str, torch.Tensor]:
    """The SGLang parameters a TIDE drafter should become (q/k/v and gate/up stacked)."""
    sd = drafter.state_dict()
    want = {"model.fc.weight": sd["fc.weight"], "model.norm.weight": sd["norm.weight"],
            "lm_head.weight": sd["lm_head.weight"],
            "model.layers.0.self_attn.qkv_proj.weight": torch.cat(
                [sd[f"midlayer.self_attn.{p}_proj.weight"] for p in "qkv"]),
            "model.layers.0.mlp.gate_up_proj.weight": torch.cat(
                [sd["midlayer.mlp.gate_proj.weight"], sd["midlayer.mlp.up_proj.weight"]])}
    for name in ("self_attn.o_proj", "mlp.down_proj", "input_layernorm", "hidden_norm", "post_attention_layernorm"):
        want[f"model.layers.0.{name}.weight"] = sd[f"midlayer.{name}.weight"]
    for i in range(3):
        if f"fc_norm.{i}.weight" in sd:
            want[f"model.fc_norm.{i}.weight"] = sd[f"fc_norm.{i}.weight"]
    return want


@pytest.fixture(scope="module")
def drafters(tiny_target, tiny_drafter, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sglang-drafters")
    serving = save_drafter(tiny_drafter, tmp / "serving", metadata={"version": "1"})
    other = new_drafter(tiny_target, tiny_drafter.shape.draft_vocab_size, torch.zeros(512), seed=7)
    other.set_vocab_mapping(tiny_drafter.d2t.clone())
    candidate = save_drafter(other.eval(), tmp / "candidate")
    remapped = new_drafter(tiny_target, tiny_drafter.shape.draft_vocab_size, torch.arange(512), seed=8)
    assert not torch.equal(remapped.d2t, tiny_drafter.d2t)
    vocab = save_drafter(remapped.eval(), tmp / "vocab")
    return {"serving": serving, "candidate": candidate, "other": other, "vocab": vocab, "tmp": tmp}


def _edited(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _swap(model, folder: Path, version: str) -> None:
    """What SGLang does with TIDE's update_weights_from_tensor request, minus the HTTP hop."""
    from sglang.srt.utils import MultiprocessingSerializer

    (payload,) = serialize_named_tensors(weights.manifest(folder, version), tp_size=1)
    plugin.load_draft(model, MultiprocessingSerializer.deserialize(payload))


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.named_parameters()}


def test_a_tide_drafter_loads_into_sglangs_eagle3_model_and_ends_with_its_parameters(sglang_dist, drafters,
                                                                                      tiny_drafter):
    model = build_sglang_draft(drafters["serving"])
    for name, value in sglang_params_of(tiny_drafter).items():  # SGLang's own start-up load
        assert torch.equal(dict(model.named_parameters())[name], value), name
    hot = model.get_hot_token_id().clone()
    embed = model.model.embed_tokens.weight.detach().clone()
    applied = metrics.ENGINE_DRAFTER_LOADS.labels("applied")._value.get()

    _swap(model, drafters["candidate"], "2")

    got = dict(model.named_parameters())
    want = sglang_params_of(drafters["other"])
    assert set(want) == set(got) - {"model.embed_tokens.weight"}  # every drafter parameter, nothing else
    for name, value in want.items():
        assert torch.equal(got[name], value), name
    assert torch.equal(model.model.embed_tokens.weight, embed)  # the embeddings are the target's
    assert torch.equal(model.get_hot_token_id(), hot)  # the vocab mapping stays fixed
    assert plugin.PROCESS.version == "2"
    assert metrics.ENGINE_DRAFTER_LOADS.labels("applied")._value.get() == applied + 1


@pytest.mark.parametrize("misfit", ["vocab mapping", "hidden size", "aux layers", "checksum"])
def test_a_misfit_drafter_is_refused_and_every_parameter_stays(sglang_dist, drafters, misfit):
    tmp = drafters["tmp"]
    folder = {
        "vocab mapping": lambda: drafters["vocab"],
        "hidden size": lambda: _edited(drafters["candidate"], tmp / "hidden", hidden_size=128, target_hidden_size=128),
        "aux layers": lambda: _edited(drafters["candidate"], tmp / "aux", tide_aux_layer_ids=[1, 2, 4],
                                      eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 3]}),
        "checksum": lambda: _edited(drafters["candidate"], tmp / "sha"),
    }[misfit]()
    if misfit == "checksum":
        meta = json.loads((folder / "tide.json").read_text())
        (folder / "tide.json").write_text(json.dumps({**meta, "sha256": "0" * 64}))
    model = build_sglang_draft(drafters["serving"])
    before, version = _params(model), plugin.PROCESS.version
    refused = metrics.ENGINE_DRAFTER_LOADS.labels("refused")._value.get()

    _swap(model, folder, "bad")

    after = _params(model)
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert plugin.PROCESS.version == version
    assert metrics.ENGINE_DRAFTER_LOADS.labels("refused")._value.get() == refused + 1
    # the engine side refuses it too, off the serving path, with the reason
    engine = SGLangEngine("http://127.0.0.1:9", drafters["serving"], "1", target_model_id="tiny", max_seq_len=200)
    reason = {"vocab mapping": "vocab mapping", "hidden size": "hidden_size", "aux layers": "aux_layer_ids",
              "checksum": "checksum"}[misfit]
    with pytest.raises(DrafterError, match=reason):
        engine.validate_drafter(folder, [5, 6])


def test_the_loader_never_touches_a_target_model(sglang_dist, drafters):
    """With the default selector ("all") SGLang would hand the manifest to the target too."""
    target_like = torch.nn.Linear(4, 4)
    before = target_like.weight.detach().clone()
    refused = metrics.ENGINE_DRAFTER_LOADS.labels("refused")._value.get()
    _swap(target_like, drafters["candidate"], "3")
    assert torch.equal(target_like.weight, before)
    assert metrics.ENGINE_DRAFTER_LOADS.labels("refused")._value.get() == refused + 1


def test_prepare_reads_the_serving_shape_from_sglangs_model_config(sglang_dist, drafters):
    model = build_sglang_draft(drafters["serving"])
    shape = weights.serving_shape_of(model)
    assert shape == weights.shape_of_config(json.loads((drafters["serving"] / "config.json").read_text()))
    assert weights.serving_mapping_of(model) == json.loads((drafters["serving"] / "tide.json").read_text())[
        "vocab_mapping"]
