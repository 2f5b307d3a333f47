"""The real SmolLM2 conversion: GGUF → cached safetensors folder with identical logits.

Uses the real cache (``TIDE_HOME`` or ~/.cache/tide) so a machine converts only once; the first
run takes ~45 s on 2 cores, later runs load the GGUF once for the logits comparison (~25 s).
"""
import json
import time

import pytest
import torch
from safetensors import safe_open

from tide.config import default_home
from tide.models.checkpoint import CONVERSION_RECORD, SMOLLM2_CACHE_NAME, ensure_target_checkpoint, smollm2_gguf_path

pytestmark = pytest.mark.slow
torch.set_num_threads(1)

MESSAGES = [
    {"role": "system", "content": "You are a concise assistant."},
    {"role": "user", "content": "Explain in two sentences why the sky is blue, then write a "
                                "Python function that reverses a string."},
]


@pytest.fixture(scope="module")
def converted():
    started = time.monotonic()
    folder = ensure_target_checkpoint(default_home(), progress=False)
    first_s = time.monotonic() - started
    started = time.monotonic()
    again = ensure_target_checkpoint(default_home(), progress=False)
    print(f"\nensure_target_checkpoint: first call {first_s:.1f} s, "
          f"second call {time.monotonic() - started:.4f} s")
    assert again == folder
    return folder, time.monotonic() - started


@pytest.fixture(scope="module")
def gguf_reference():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32).eval()
    return model, tokenizer


def test_second_call_is_a_cache_hit(converted):
    folder, second_s = converted
    assert folder == default_home() / "models" / SMOLLM2_CACHE_NAME
    assert second_s < 1.0
    leftovers = [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert leftovers == []


def test_folder_is_a_plain_fp32_llama_with_tied_embeddings(converted):
    folder, _ = converted
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", CONVERSION_RECORD):
        assert (folder / name).is_file(), name
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["vocab_size"], cfg["num_hidden_layers"], cfg["hidden_size"]) == (49152, 30, 576)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"]) == (9, 3)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    assert "quantization_config" not in cfg  # the weights are dequantized, not GGUF any more
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
        assert len(keys) == 2 + 30 * 9
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    record = json.loads((folder / CONVERSION_RECORD).read_text())
    assert record["verify_logits_max_abs_diff"] <= 1e-4


def test_saved_tokenizer_matches_the_gguf_tokenizer(converted, gguf_reference):
    from transformers import AutoTokenizer

    folder, _ = converted
    _, reference = gguf_reference
    saved = AutoTokenizer.from_pretrained(folder)
    assert len(saved) == len(reference) == 49152
    assert (saved.eos_token, saved.bos_token) == ("<|im_end|>", "<|im_start|>")
    for text in ["Hello, world!", "def f(x):\n    return x * 2\n", "안녕하세요 세계", "  spaces\t\ttabs"]:
        assert saved.encode(text) == reference.encode(text)
    rendered = saved.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered == reference.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")


def test_reloaded_checkpoint_has_the_gguf_models_logits(converted, gguf_reference):
    from transformers import AutoModelForCausalLM

    folder, _ = converted
    model, tokenizer = gguf_reference
    started = time.monotonic()
    reloaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    reload_s = time.monotonic() - started
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True,
                                        return_dict=False)
    input_ids = torch.tensor([list(ids)])
    with torch.no_grad():
        expected = model(input_ids).logits
        got = reloaded(input_ids).logits
        generated = reloaded.generate(input_ids, max_new_tokens=8, do_sample=False)
        generated_ref = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    diff = float((expected - got).abs().max())
    print(f"\nreload {reload_s:.2f} s, {input_ids.shape[1]} tokens, logits max abs diff {diff:.3g}")
    assert torch.allclose(expected, got, atol=1e-5, rtol=0)
    assert torch.equal(generated, generated_ref)
