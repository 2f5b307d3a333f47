"""Offline drafter training from a workload: prompts → target states → trained drafter.

Steps (``train_from_prompts``):
1. render each prompt with the chat template and let the target answer it greedily (batched,
   target-only); the states it computed at every fed position are the training sample, exactly
   as online capture would record them (self-distillation: the drafter learns the target's own
   continuations);
2. build the draft vocab from token frequencies of the samples plus a text corpus (fixed from
   then on: retrains keep it);
3. train with the EAGLE3 objective and evaluate simulated acceptance on held-out prompts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
from tqdm import tqdm

from tide.drafter.model import DrafterShape, Eagle3Drafter
from tide.drafter.vocab import build_d2t, count_tokens
from tide.models.llama import LlamaTarget
from tide.spec.decode import RowInput, prefill, target_step
from tide.train.trainer import Sample


def render_prompt(tokenizer, prompt: dict | str, max_prompt_tokens: int) -> list[int]:
    """Chat messages (or a plain prompt as one user turn) → token ids, keeping the prompt's tail."""
    messages = prompt if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    ids = list(ids)
    if len(ids) > max_prompt_tokens:
        # keep the head (system/user start) and the generation prompt at the end
        ids = ids[: max_prompt_tokens - 8] + ids[-8:]
    return ids


def generate_samples(target: LlamaTarget, prompts_ids: Sequence[list[int]], max_new_tokens: int,
                     eos_ids: Iterable[int], batch_size: int = 8, progress: bool = True) -> list[Sample]:
    """Greedy target-only generation, batched; returns one Sample per prompt with all fed positions."""
    eos = set(eos_ids)
    samples: list[Sample] = []
    bar = tqdm(total=len(prompts_ids), desc="generate target states", disable=not progress, unit="prompt")
    for start in range(0, len(prompts_ids), batch_size):
        group = prompts_ids[start:start + batch_size]
        max_len = max(len(p) for p in group) + max_new_tokens + 2
        cache = target.new_cache(len(group), max_len)
        rows, toks, auxs, finals, done = [], [], [], [], []
        for slot, ids in enumerate(group):
            out = prefill(target, cache, slot, ids)
            first = int(out.logits[0, -1].argmax())
            rows.append(RowInput(slot=slot, t_len=len(ids), pending=first, feed_start=0,
                                 feed_tokens=torch.empty(0), feed_aux=torch.empty(0)))
            toks.append(list(ids))
            auxs.append([out.aux_hidden[0].to(torch.bfloat16)])
            finals.append([out.final_hidden[0].to(torch.bfloat16)])
            done.append(first in eos)
        n_new = [1] * len(group)
        while True:
            active = [b for b in range(len(group)) if not done[b] and n_new[b] < max_new_tokens]
            if not active:
                break
            results = target_step(target, cache, [rows[b] for b in active])
            for b, res in zip(active, results):
                r = rows[b]
                toks[b].append(r.pending)
                auxs[b].append(res.aux_hidden.to(torch.bfloat16))
                finals[b].append(res.final_hidden.to(torch.bfloat16))
                r.t_len += 1
                r.pending = res.committed[0]
                n_new[b] += 1
                done[b] = r.pending in eos
        for b, ids in enumerate(group):
            tokens = torch.tensor(toks[b])
            mask = torch.zeros(len(tokens))
            mask[len(ids):] = 1.0
            # the prompt's last position predicts the first generated token: include it via the
            # shifted mask in the objective (mask at t+1), nothing to do here
            samples.append(Sample(tokens=tokens, loss_mask=mask, aux=torch.cat(auxs[b]),
                                  final=torch.cat(finals[b])))
        bar.update(len(group))
    bar.close()
    return samples


def new_drafter(target: LlamaTarget, draft_vocab_size: int, counts: torch.Tensor,
                intermediate_size: int | None = None, always_ids: Iterable[int] = (), seed: int = 0) -> Eagle3Drafter:
    """A fresh drafter shaped for ``target`` with the draft vocab from ``counts``."""
    s = target.shape
    shape = DrafterShape(
        hidden_size=s.hidden_size, intermediate_size=intermediate_size or s.intermediate_size,
        num_heads=s.num_heads, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
        vocab_size=s.vocab_size, draft_vocab_size=draft_vocab_size, target_hidden_size=s.hidden_size,
        rms_norm_eps=s.rms_norm_eps, rope_theta=s.rope_theta,
        max_position_embeddings=s.max_position_embeddings, aux_layer_ids=target.aux_layer_ids, fc_norm=True)
    drafter = Eagle3Drafter(shape)
    drafter.init_weights(seed)
    drafter.set_vocab_mapping(build_d2t(counts, draft_vocab_size, always=always_ids))
    # warm start the output head from the target's lm_head rows of the draft vocab: the drafter's
    # job is to predict the target's next token, so the target's own head is the best prior
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.lm_head_weight[drafter.draft_to_target].float())
        drafter.norm.weight.copy_(target.w["norm.weight"].float())
    return drafter


@dataclass
class CorpusCounts:
    counts: torch.Tensor
    tokens: int


def corpus_counts(tokenizer, texts: Iterable[str], vocab_size: int, samples: Sequence[Sample] = ()) -> CorpusCounts:
    seqs = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    seqs += [s.tokens.tolist() for s in samples]
    counts = count_tokens(seqs, vocab_size)
    return CorpusCounts(counts=counts, tokens=int(counts.sum()))


def timed(fn, *args, **kwargs):
    start = time.monotonic()
    out = fn(*args, **kwargs)
    return out, time.monotonic() - start
