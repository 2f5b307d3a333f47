"""The static pre-trained drafter: the recipe behind ``tide train --static``.

Steps (each cached under ``<home>/train-cache`` so a re-run resumes):
1. load the target and N ShareGPT English chat prompts (train split; the held-out split is what
   benches and the demo use);
2. let the target answer them (batched greedy, ``max_new_tokens``), keeping its states at every
   fed position; prompts and answers both train (the loss covers all positions: the soft labels
   are the target's own distribution either way);
3. draft vocab = the most frequent tokens of ShareGPT English text (chat and code turns alike,
   so later retrains on new traffic are not capped by the vocab) plus everything generated;
4. train a fresh drafter (lm_head warm-started from the target's rows), evaluate on held-out
   prompts, save it in the export layout with its metrics.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tide.drafter.artifact import save_drafter
from tide.drafter.confidence import frozen
from tide.drafter.static import cached_static_path
from tide.models.target import eos_ids_of, load_target
from tide.train.confidence import fit_confidence
from tide.train.offline import corpus_counts, generate_samples, new_drafter, render_prompt
from tide.train.trainer import Sample, evaluate, train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticRecipe:
    train_prompts: int = 1200
    heldout_prompts: int = 24
    max_prompt_tokens: int = 192
    max_new_tokens: int = 96
    # rows decoded together while generating: verify-sized GEMMs are cheap per row (oneDNN)
    generation_batch: int = 32
    vocab_text_conversations: int = 3000
    draft_vocab_size: int = 8192
    intermediate_size: int = 1024
    epochs: int = 3
    lr: float = 2e-3
    batch_tokens: int = 1024
    ttt_length: int = 4
    gamma: int = 4
    seed: int = 0
    # loss on generated positions only: that is where the drafter drafts, and the CE's cost is
    # per position (prompt positions still feed the drafter's attention)
    train_on_prompt: bool = False
    # a calibrated confidence head (tide/train/confidence.py); off for the reason train.confidence_head is
    confidence_head: bool = False


def save_samples(samples: list[Sample], path: Path) -> None:
    tensors = {}
    for i, s in enumerate(samples):
        tensors.update({f"{i}.tokens": s.tokens, f"{i}.mask": s.loss_mask, f"{i}.aux": s.aux.contiguous(),
                        f"{i}.final": s.final.contiguous()})
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp))
    tmp.replace(path)


def load_samples(path: Path) -> list[Sample]:
    t = load_file(str(path))
    n = len({k.split(".")[0] for k in t})
    return [Sample(tokens=t[f"{i}.tokens"], loss_mask=t[f"{i}.mask"], aux=t[f"{i}.aux"], final=t[f"{i}.final"])
            for i in range(n)]


def prompt_samples(target, tokenizer, eos, prompts, recipe: StaticRecipe, cache: Path, name: str,
                   train_on_prompt: bool) -> list[Sample]:
    path = cache / f"{name}.safetensors"
    if path.exists():
        samples = load_samples(path)
    else:
        ids = [render_prompt(tokenizer, p.chat_messages(), recipe.max_prompt_tokens) for p in prompts]
        samples = generate_samples(target, ids, recipe.max_new_tokens, eos, batch_size=recipe.generation_batch)
        save_samples(samples, path)
    if train_on_prompt:
        for s in samples:
            s.loss_mask = torch.ones_like(s.loss_mask)
    return samples


def train_static(cfg, recipe: StaticRecipe = StaticRecipe(), out: Path | None = None) -> Path:
    from tide import workloads

    torch.manual_seed(recipe.seed)
    target, tokenizer, folder = load_target(cfg)
    eos = eos_ids_of(tokenizer, folder)
    cache = cfg.home_path / "train-cache" / "static"
    cache.mkdir(parents=True, exist_ok=True)
    home = cfg.home_path
    train_prompts = workloads.sharegpt("train", recipe.train_prompts, recipe.seed, kind="chat", home=home)
    held = workloads.sharegpt("heldout", recipe.heldout_prompts, recipe.seed, kind="chat", home=home)
    t0 = time.monotonic()
    samples = prompt_samples(target, tokenizer, eos, train_prompts, recipe, cache, f"train-{recipe.train_prompts}x{recipe.max_new_tokens}",
                             recipe.train_on_prompt)
    held_samples = prompt_samples(target, tokenizer, eos, held, recipe, cache, f"heldout-{recipe.heldout_prompts}x{recipe.max_new_tokens}", False)
    gen_s = time.monotonic() - t0
    texts = [t for kind in ("chat", "code")
             for p in workloads.sharegpt("train", recipe.vocab_text_conversations, recipe.seed, kind=kind, home=home)
             for t in (p.chat_messages()[-1]["content"], p.reference or "")]
    counts = corpus_counts(tokenizer, texts, target.shape.vocab_size, samples)
    drafter = new_drafter(target, recipe.draft_vocab_size, counts.counts, recipe.intermediate_size,
                          always_ids=eos, seed=recipe.seed)
    embed, head = target.embed_weight, target.lm_head_weight
    before = evaluate(drafter, embed, head, held_samples, recipe.gamma)
    result = train(drafter, embed, head, samples, epochs=recipe.epochs, lr=recipe.lr,
                   batch_tokens=recipe.batch_tokens, max_len=recipe.max_prompt_tokens + recipe.max_new_tokens,
                   ttt_length=recipe.ttt_length, step_weight=0.8, seed=recipe.seed)
    # (the trainer defaults: SpecForge's soft cross-entropy only, lm_head trained)
    after = evaluate(drafter, embed, head, held_samples, recipe.gamma)
    log.info("static drafter: simulated accept length %.3f -> %.3f", before.accept_length, after.accept_length)
    confidence = {}
    if recipe.confidence_head:
        conf_head, confidence = fit_confidence(drafter, embed, head, samples, held_samples, depth=recipe.gamma,
                                          batch_tokens=recipe.batch_tokens, seed=recipe.seed)
        drafter.confidence = frozen(conf_head)
    meta = {
        "version": "static",
        "recipe": asdict(recipe),
        "train_tokens": sum(len(s) for s in samples),
        "generation_s": round(gen_s, 1),
        "train_s": round(result.wall_s, 1),
        "final_loss": result.loss_curve[-1] if result.loss_curve else None,
        "heldout_sim_accept_length": round(after.accept_length, 4),
        "heldout_position_rates": [round(r, 4) for r in after.position_rates],
        "untrained_sim_accept_length": round(before.accept_length, 4),
        "target": cfg.model.model_id,
        "confidence": confidence,
    }
    dest = out or cached_static_path(cfg.home_path)
    save_drafter(drafter, dest, metadata=meta, dtype=torch.bfloat16)
    (dest.parent / f"{dest.name}.train.json").write_text(json.dumps(
        {**meta, "loss_curve": result.loss_curve}, indent=1))
    return dest
