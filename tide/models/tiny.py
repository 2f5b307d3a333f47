"""A tiny random Llama checkpoint, built in code, for fast tests (no download, no GGUF).

It has the same folder layout as the converted target (config.json, model.safetensors,
generation_config.json, tokenizer files with a ChatML chat template like SmolLM2's), so every
component that loads the real target loads this one unchanged.

Build steps (``tiny_llama_checkpoint``):
1. train a byte-level BPE tokenizer on a fixed built-in corpus (English, Python, a little
   Korean) up to ``vocab_size`` tokens; special tokens take ids 0-2 as in SmolLM2
   (``<|endoftext|>``, ``<|im_start|>``, ``<|im_end|>``), and byte-level fallback means any text
   encodes;
2. seed torch, build ``LlamaForCausalLM`` from a config in SmolLM2's style (GQA, tied
   embeddings, RoPE theta 1e5) and draw its weights with ``init_std``;
3. save model and tokenizer into ``folder``.

Why ``init_std`` defaults to 0.2 rather than HF's 0.02: at 0.02 a tiny random model's next-token
distribution is nearly uniform and greedy decoding repeats one token forever, which makes
speculative-decoding tests trivially pass (every draft of "the same token" is accepted) and
sampling tests weak. At 0.2 greedy output varies and the distribution has visible structure.

Same arguments give the same weights and the same tokenizer, so tests can rebuild it freely.
"""
from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# SmolLM2's template minus its default system prompt: short prompts keep tiny-model tests fast.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Byte-level BPE has 256 base symbols; the special tokens come on top.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)

_CORPUS = """\
The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital.
Please write a short story about a robot who learns to paint. Summarize the following text.
How do I make a cup of tea? Boil the water, add the tea, wait three minutes and then pour it.
Can you explain how speculative decoding works? A small draft model proposes tokens and the
target model verifies them in one forward pass, accepting the longest matching prefix.
Tell me a joke about computers. Why did the computer go to the doctor? It had a virus.
The weather today is sunny with a chance of rain in the evening. I would like to book a table.
def add(a, b):
    \"\"\"Return the sum of a and b.\"\"\"
    return a + b

def fibonacci(n: int) -> list[int]:
    \"\"\"Return the first n Fibonacci numbers.\"\"\"
    result = []
    a, b = 0, 1
    for _ in range(n):
        result.append(a)
        a, b = b, a + b
    return result

class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

import os
for name in sorted(os.listdir(".")):
    if name.endswith(".py"):
        print(name)
안녕하세요. 오늘 날씨가 좋네요. 인공지능이 뭐지? 저는 파이썬으로 만들어졌습니다.
"""


def build_tiny_tokenizer(vocab_size: int = 512):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with a ChatML template (steps in the module doc)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB_SIZE} (256 bytes + special tokens), "
                         f"got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>", chat_template=CHATML_TEMPLATE,
        model_max_length=2048)


def tiny_llama_config(vocab_size: int = 512, hidden: int = 64, layers: int = 4, heads: int = 4,
                      kv_heads: int = 2, intermediate: int | None = None,
                      tie_embeddings: bool = True, init_std: float = 0.2,
                      max_positions: int = 2048):
    """An HF ``LlamaConfig`` shaped like SmolLM2's, scaled down."""
    from transformers import LlamaConfig

    if hidden % heads:
        raise ValueError(f"hidden ({hidden}) must be divisible by heads ({heads})")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be divisible by kv_heads ({kv_heads})")
    special = {name: i for i, name in enumerate(SPECIAL_TOKENS)}
    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=hidden // heads, hidden_act="silu", max_position_embeddings=max_positions,
        rms_norm_eps=1e-5, rope_theta=100000.0, initializer_range=init_std,
        tie_word_embeddings=tie_embeddings, attention_bias=False, mlp_bias=False,
        bos_token_id=special["<|im_start|>"], eos_token_id=special["<|im_end|>"],
        pad_token_id=special["<|im_end|>"], unk_token_id=special["<|endoftext|>"],
        dtype="float32")


def tiny_llama_checkpoint(folder: Path, vocab_size: int = 512, hidden: int = 64, layers: int = 4,
                          heads: int = 4, kv_heads: int = 2, seed: int = 0,
                          intermediate: int | None = None, tie_embeddings: bool = True,
                          init_std: float = 0.2) -> Path:
    """Write a tiny random Llama checkpoint + tokenizer into ``folder`` and return it.

    ``layers`` must be at least 4 for the EAGLE3 default aux layers (2, n//2, n-3) to be distinct
    and inside the model.
    """
    import torch
    from transformers import LlamaForCausalLM

    folder = Path(folder)
    tokenizer = build_tiny_tokenizer(vocab_size)
    config = tiny_llama_config(vocab_size, hidden, layers, heads, kv_heads, intermediate,
                               tie_embeddings, init_std)
    # Seed a private generator state: tests that build a model must not shift each other's RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32).eval()
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    config_path = folder / "config.json"
    data = json.loads(config_path.read_text())
    # transformers 4.x readers look for rope_theta at the top level (5.x nests it).
    data.setdefault("rope_theta", (data.get("rope_parameters") or {}).get("rope_theta", 100000.0))
    config_path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return folder
