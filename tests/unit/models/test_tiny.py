"""The tiny random Llama checkpoint: layout, determinism, and that HF loads it as a working model."""
import json

import pytest
import torch
from safetensors.torch import load_file

from tide.models.checkpoint import load_hf_reference, validate_checkpoint_folder
from tide.models.tiny import CHATML_TEMPLATE, MIN_VOCAB_SIZE, SPECIAL_TOKENS, tiny_llama_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return tiny_llama_checkpoint(tmp_path_factory.mktemp("tiny") / "a")


def test_layout_and_config_follow_the_arguments(tmp_path):
    folder = tiny_llama_checkpoint(tmp_path / "t", vocab_size=300, hidden=32, layers=5, heads=4,
                                   kv_heads=1, seed=3)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json"} <= names
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (300, 32, 5)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 1, 8)
    assert cfg["rope_theta"] == 100000.0 and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    weights = load_file(str(folder / "model.safetensors"))
    assert weights["model.embed_tokens.weight"].shape == (300, 32)
    assert weights["model.layers.4.self_attn.k_proj.weight"].shape == (8, 32)
    assert "lm_head.weight" not in weights  # tied: stored once
    assert validate_checkpoint_folder(folder) == folder


def test_untied_variant_stores_its_own_lm_head(tmp_path):
    folder = tiny_llama_checkpoint(tmp_path / "u", tie_embeddings=False)
    weights = load_file(str(folder / "model.safetensors"))
    assert weights["lm_head.weight"].shape == (512, 64)
    assert not torch.equal(weights["lm_head.weight"], weights["model.embed_tokens.weight"])


def test_same_seed_same_weights_other_seed_other_weights(tmp_path, tiny_folder):
    again = load_file(str(tiny_llama_checkpoint(tmp_path / "b") / "model.safetensors"))
    first = load_file(str(tiny_folder / "model.safetensors"))
    assert first.keys() == again.keys()
    assert all(torch.equal(first[k], again[k]) for k in first)
    other = load_file(str(tiny_llama_checkpoint(tmp_path / "c", seed=1) / "model.safetensors"))
    assert not torch.equal(first["model.embed_tokens.weight"], other["model.embed_tokens.weight"])
    assert (tmp_path / "b" / "tokenizer.json").read_bytes() == (tiny_folder / "tokenizer.json").read_bytes()


def test_building_does_not_disturb_the_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    tiny_llama_checkpoint(tmp_path / "r", seed=7)
    assert torch.equal(torch.rand(4), expected)


def test_tokenizer_encodes_any_text_and_renders_chatml(tiny_folder):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_folder)
    assert len(tok) == 512
    assert tok.convert_ids_to_tokens([0, 1, 2]) == list(SPECIAL_TOKENS)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 2
    for text in ["def add(a, b):\n    return a + b\n", "안녕하세요, 세계! 🌊", "naïve café — ok"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert max(ids) < 512 and tok.decode(ids) == text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                        "<|im_start|>assistant\n")
    assert tok.chat_template == CHATML_TEMPLATE
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert list(ids)[:1] == [1] and list(ids).count(2) == 2


def test_hf_loads_a_model_whose_greedy_output_varies(tiny_folder):
    model, tok = load_hf_reference(tiny_folder)
    ids = tok("The quick brown fox jumps over", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1]:]
    assert logits.shape == (1, ids.shape[1], 512)
    # A near-uniform random model repeats one token forever, which makes spec-decoding tests vacuous.
    assert len(set(out.tolist())) >= 5
    probs = logits[0, -1].softmax(-1)
    assert probs.max() > 5 / 512  # visibly non-uniform


@pytest.mark.parametrize("kwargs, message", [
    ({"vocab_size": MIN_VOCAB_SIZE - 1}, "vocab_size"),
    ({"hidden": 66, "heads": 4}, "divisible by heads"),
    ({"heads": 4, "kv_heads": 3}, "divisible by kv_heads"),
])
def test_bad_shapes_are_refused(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        tiny_llama_checkpoint(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()
