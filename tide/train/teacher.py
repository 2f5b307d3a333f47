"""Teacher-forced training data: the target prefilled over existing conversations.

Generating the target's own answers costs one decode step per token; a prefill over text that
already exists (a ShareGPT prompt plus its recorded reply, a code prompt plus its reference) computes
the target's states and soft labels at every position in one forward, many times more tokens per
CPU-minute. EAGLE-style: the context is the source's text, the labels are still the target's.

Steps (``teacher_forced_samples``):
1. each conversation → prompt ids (the chat template, as at serving) + reply ids (the reference,
   cut to ``max_reply_tokens``; the end-of-turn id closes an uncut reply);
2. sort by length and prefill ``batch_rows`` rows at a time, right-padded: attention is causal,
   so padding never changes a real position's states;
3. one ``Sample`` per conversation: all positions' aux/final states, loss mask on the reply.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from tide.models.llama import LlamaTarget
from tide.train.offline import render_prompt
from tide.train.trainer import Sample


@dataclass(frozen=True)
class Conversation:
    """Token ids of one teacher-forced sequence: the reply starts at ``reply_start``."""

    ids: list[int]
    reply_start: int


def conversation_ids(tokenizer, messages: list[dict], reply: str, max_prompt_tokens: int,
                     max_reply_tokens: int, end_ids: Sequence[int]) -> Conversation | None:
    """Prompt (chat template, generation prompt added) + reply ids; None for an empty reply."""
    prompt = render_prompt(tokenizer, messages, max_prompt_tokens)
    body = tokenizer.encode(reply, add_special_tokens=False)
    if not body:
        return None
    cut = body[:max_reply_tokens]
    if len(cut) == len(body):
        cut = (cut + list(end_ids))[:max_reply_tokens]
    return Conversation(ids=prompt + cut, reply_start=len(prompt))


def prompt_conversations(tokenizer, prompts, max_prompt_tokens: int, max_reply_tokens: int,
                         end_ids: Sequence[int]) -> list[Conversation]:
    """Workload prompts with a ``reference`` → conversations (prompts without one are skipped)."""
    out = []
    for p in prompts:
        if p.reference:
            conv = conversation_ids(tokenizer, p.chat_messages(), p.reference, max_prompt_tokens,
                                    max_reply_tokens, end_ids)
            if conv is not None:
                out.append(conv)
    return out


@torch.no_grad()
def teacher_forced_samples(target: LlamaTarget, conversations: Sequence[Conversation], batch_rows: int = 4,
                           pad_id: int = 0, progress: bool = True) -> list[Sample]:
    """One batched prefill per group of similar-length conversations; Samples in input order."""
    order = sorted(range(len(conversations)), key=lambda i: len(conversations[i].ids))
    samples: list[Sample | None] = [None] * len(conversations)
    bar = tqdm(total=len(conversations), desc="teacher-forced target states", disable=not progress, unit="conv")
    for start in range(0, len(order), batch_rows):
        group = order[start:start + batch_rows]
        width = max(len(conversations[i].ids) for i in group)
        ids = torch.full((len(group), width), pad_id, dtype=torch.long)
        for row, i in enumerate(group):
            ids[row, :len(conversations[i].ids)] = torch.tensor(conversations[i].ids)
        cache = target.new_cache(len(group), width + 1)
        out = target.forward(ids, torch.zeros(len(group), dtype=torch.long), cache,
                             torch.arange(len(group)), last_only=True)
        for row, i in enumerate(group):
            conv = conversations[i]
            n = len(conv.ids)
            mask = torch.zeros(n)
            mask[conv.reply_start:] = 1.0
            samples[i] = Sample(tokens=ids[row, :n].clone(), loss_mask=mask,
                                aux=out.aux_hidden[row, :n].to(torch.bfloat16),
                                final=out.final_hidden[row, :n].to(torch.bfloat16))
        bar.update(len(group))
    bar.close()
    return [s for s in samples if s is not None]
