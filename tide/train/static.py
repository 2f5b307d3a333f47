"""The static pre-trained drafter: the recipe behind ``tide train --static``.

Steps (target states cached under ``<home>/train-cache/static`` so a re-run resumes):
1. load the target and the training text: ``train_prompts`` ShareGPT English chat prompts that
   the target answers itself (batched greedy, ``max_new_tokens``) and ``teacher_conversations``
   ShareGPT chat conversations (plus ``teacher_code_conversations`` code-workload ones) prefilled
   with their recorded replies (``tide/train/teacher.py``: far more tokens per CPU-minute); the
   held-out split is what benches and the demo use;
2. draft vocab = the most frequent tokens of ShareGPT English text (chat and code turns alike,
   so later retrains on new traffic are not capped by the vocab) plus all training tokens;
3. a fresh drafter: lm_head and final norm from the target's, and with ``init_from_target`` its
   mid layer from target layer ``init_layer`` (``tide/train/target_init.py``);
4. train (optionally under a wall-time cap), evaluate on held-out self-generated answers, save it
   in the export layout with its metrics.
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from tide.drafter.artifact import save_drafter
from tide.drafter.confidence import frozen
from tide.drafter.static import cached_static_path
from tide.models.target import eos_ids_of, load_target
from tide.train.confidence import fit_confidence
from tide.train.device import PRECISIONS
from tide.train.generation_pool import TargetSource, generate_sharded, load_samples, save_samples
from tide.train.offline import corpus_counts, generate_samples, new_drafter, render_prompt
from tide.train.static_ranks import train_ranked
from tide.train.target_init import init_from_target
from tide.train.teacher import prompt_conversations, teacher_forced_samples
from tide.train.trainer import Sample, evaluate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StaticRecipe:
    # self-generated share: prompts the target answers itself (0: none)
    train_prompts: int = 1200
    heldout_prompts: int = 24
    max_prompt_tokens: int = 192
    max_new_tokens: int = 96
    # rows decoded together while generating: verify-sized GEMMs are cheap per row (oneDNN)
    generation_batch: int = 32
    # processes generating at once, one core each (tide/train/generation_pool.py); same samples
    generation_workers: int = 1
    # self-generated answers are cached in chunks of this many prompts, so an interrupted run
    # resumes at its last chunk and a larger recipe reuses a smaller one's answers. A whole number
    # of generation batches: every batch then holds the prompts it holds in one unchunked run
    generation_chunk: int = 800
    # teacher-forced share: ShareGPT chat / code-workload conversations prefilled with their
    # recorded replies (0: none). Code stays 0 by default: the demo's shift is to code, and a
    # static drafter already trained on it leaves online adaptation less to show
    teacher_conversations: int = 0
    teacher_code_conversations: int = 0
    max_reply_tokens: int = 256
    # rows per teacher-forced prefill: length-sorted, so padding stays small
    teacher_batch_rows: int = 4
    vocab_text_conversations: int = 3000
    draft_vocab_size: int = 8192
    # None: the target's (a target-initialised mid layer then copies the whole MLP, not a slice)
    intermediate_size: int | None = 1024
    # the mid layer from this target layer (negative: from the end), else random
    init_from_target: bool = False
    init_layer: int = -1
    epochs: int = 3
    # a cap on training wall time (the schedule shrinks to fit, tide/train/trainer.py); None: epochs
    max_train_s: float | None = None
    # training processes, one core each (tide/train/static_ranks.py): a step takes one batch per
    # rank, so N ranks see N times the tokens per step
    train_ranks: int = 1
    lr: float = 2e-3
    batch_tokens: int = 1024
    # training arithmetic (tide/train/device.py): fp32 | bf16 | auto (bf16 where the CPU has native
    # bf16 dot products: AVX512-BF16, AMX); held-out evaluation is fp32 either way
    precision: str = "fp32"
    ttt_length: int = 4
    gamma: int = 4
    seed: int = 0
    # loss on generated positions only: that is where the drafter drafts, and the CE's cost is
    # per position (prompt positions still feed the drafter's attention)
    train_on_prompt: bool = False
    # a calibrated confidence head (tide/train/confidence.py), as every retrain fits one (train.confidence_head)
    confidence_head: bool = True

    def __post_init__(self):
        # refused when the recipe is made, not an hour later when training starts
        if self.precision not in PRECISIONS:
            raise ValueError(f"StaticRecipe.precision must be one of {PRECISIONS}, got {self.precision!r}")
        if self.generation_workers < 1:
            raise ValueError(f"StaticRecipe.generation_workers must be >= 1, got {self.generation_workers}")
        if self.train_ranks < 1:
            raise ValueError(f"StaticRecipe.train_ranks must be >= 1, got {self.train_ranks}")
        if self.generation_chunk < 1 or self.generation_chunk % self.generation_batch:
            raise ValueError(f"StaticRecipe.generation_chunk must be a positive multiple of generation_batch "
                             f"({self.generation_batch}), got {self.generation_chunk}")

    @property
    def max_len(self) -> int:
        return self.max_prompt_tokens + max(self.max_new_tokens, self.max_reply_tokens)


# the first packaged drafter's recipe (1200 self-generated answers, 3 epochs in fp32):
# kept reachable for comparisons
SELF_GENERATED_RECIPE = StaticRecipe()
# the recipe packaged before `large`: more of what won at equal compute (the
# target's own answers, more passes over them) in the same CPU budget: generation on two cores,
# training under bf16 autocast where the CPU multiplies bf16 natively, the schedule capped in time
# so a slower machine stays within the budget (the cap sets the step count: the machine's speed does)
SCALED_RECIPE = StaticRecipe(train_prompts=3200, generation_workers=2, precision="auto", epochs=5,
                             max_train_s=2100.0)
# the packaged drafter's recipe (``make static-drafter``): the scaled recipe grown to the 3 CPU-hour
# budget: nearly every English chat prompt of the train split answered (the first 3200 are the
# scaled recipe's, so its cached chunks are reused), and the training half on both cores (two
# ranks: a step takes one batch per core), in 2048-token batches per rank: a step costs the same per token
# at any batch size here, and at this cap fewer, larger steps train a better drafter
LARGE_RECIPE = replace(SCALED_RECIPE, train_prompts=5600, train_ranks=2, max_train_s=2000.0, batch_tokens=2048)
# ``tide train --static --recipe NAME``
RECIPES = {"default": LARGE_RECIPE, "large": LARGE_RECIPE, "scaled": SCALED_RECIPE,
           "self-generated": SELF_GENERATED_RECIPE}


def cached(path: Path, build) -> tuple[list[Sample], float]:
    """Samples from ``path`` or built (and saved); with the seconds building took (0 if cached)."""
    if path.exists():
        return load_samples(path), 0.0
    start = time.monotonic()
    samples = build()
    spent = time.monotonic() - start
    if samples:
        save_samples(samples, path)
    return samples, spent


def generation_chunks(n: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, end)`` of each cached chunk of ``n`` prompts: fixed boundaries, so the chunks of a
    smaller recipe are the first chunks of a larger one (the prompt order keeps its head)."""
    return [(a, min(n, a + chunk)) for a in range(0, n, chunk)]


def prompt_samples(target, tokenizer, eos, prompts, recipe: StaticRecipe, cache: Path, name: str,
                   train_on_prompt: bool, max_new_tokens: int | None = None,
                   source: TargetSource | None = None) -> list[Sample]:
    """Self-generated samples: the target answers ``prompts`` (cached as ``name``); in
    ``recipe.generation_workers`` processes when ``source`` says where the target's checkpoint is."""
    new_tokens = max_new_tokens or recipe.max_new_tokens

    def build():
        ids = [render_prompt(tokenizer, p.chat_messages(), recipe.max_prompt_tokens) for p in prompts]
        # one batch or less: a worker would only reload the target to do what this process can
        if source is not None and recipe.generation_workers > 1 and len(ids) > recipe.generation_batch:
            return generate_sharded(source, ids, new_tokens, tuple(eos), recipe.generation_batch,
                                    recipe.generation_workers, cache)
        return generate_samples(target, ids, new_tokens, eos, batch_size=recipe.generation_batch)

    samples, _ = cached(cache / f"{name}.safetensors", build)
    if train_on_prompt:
        for s in samples:
            s.loss_mask = torch.ones_like(s.loss_mask)
    return samples


def teacher_samples(target, tokenizer, prompts, recipe: StaticRecipe, cache: Path, name: str) -> list[Sample]:
    """Teacher-forced samples over ``prompts``' recorded replies (cached as ``name``)."""
    end_ids = tokenizer.encode("<|im_end|>", add_special_tokens=False)

    def build():
        convs = prompt_conversations(tokenizer, prompts, recipe.max_prompt_tokens, recipe.max_reply_tokens, end_ids)
        return teacher_forced_samples(target, convs, recipe.teacher_batch_rows, pad_id=end_ids[0])

    return cached(cache / f"{name}.safetensors", build)[0]


def training_samples(target, tokenizer, eos, recipe: StaticRecipe, cache: Path, home: Path,
                     source: TargetSource | None = None) -> list[Sample]:
    """The self-generated share then the teacher-forced shares, as the recipe sizes them."""
    from tide import workloads

    samples: list[Sample] = []
    if recipe.train_prompts:
        prompts = workloads.sharegpt("train", recipe.train_prompts, recipe.seed, kind="chat", home=home)
        for a, b in generation_chunks(len(prompts), recipe.generation_chunk):
            samples += prompt_samples(target, tokenizer, eos, prompts[a:b], recipe, cache,
                                      f"train-{a}-{b}x{recipe.max_new_tokens}", recipe.train_on_prompt, source=source)
    # teacher conversations come from the train split's far end, so they never repeat the prompts
    # the target answered itself (select() orders the split by seed; taking a larger n keeps the head)
    if recipe.teacher_conversations:
        n = recipe.train_prompts + recipe.teacher_conversations
        prompts = workloads.sharegpt("train", n, recipe.seed, kind="chat", home=home)[recipe.train_prompts:]
        samples += teacher_samples(target, tokenizer, prompts, recipe, cache,
                                   f"teacher-chat-{recipe.train_prompts}+{recipe.teacher_conversations}"
                                   f"x{recipe.max_prompt_tokens}+{recipe.max_reply_tokens}")
    if recipe.teacher_code_conversations:
        prompts = workloads.code("train", recipe.teacher_code_conversations, recipe.seed, home=home)
        samples += teacher_samples(target, tokenizer, prompts, recipe, cache,
                                   f"teacher-code-{recipe.teacher_code_conversations}"
                                   f"x{recipe.max_prompt_tokens}+{recipe.max_reply_tokens}")
    return samples


def build_drafter(target, tokenizer, eos, recipe: StaticRecipe, samples: list[Sample], home: Path):
    """The untrained drafter: draft vocab from text + samples, weights as the recipe says."""
    from tide import workloads

    texts = [t for kind in ("chat", "code")
             for p in workloads.sharegpt("train", recipe.vocab_text_conversations, recipe.seed, kind=kind, home=home)
             for t in (p.chat_messages()[-1]["content"], p.reference or "")]
    counts = corpus_counts(tokenizer, texts, target.shape.vocab_size, samples)
    drafter = new_drafter(target, recipe.draft_vocab_size, counts.counts, recipe.intermediate_size,
                          always_ids=eos, seed=recipe.seed)
    if recipe.init_from_target:
        init_from_target(drafter, target, recipe.init_layer)
    return drafter


def fit(drafter, target, samples: list[Sample], held_samples: list[Sample], recipe: StaticRecipe,
        progress: bool = True, scratch_dir: Path | None = None):
    """Train ``drafter`` in place (on ``recipe.train_ranks`` processes, their files in a folder
    under ``scratch_dir``); (result, held-out eval before, after)."""
    embed, head = target.embed_weight, target.lm_head_weight
    before = evaluate(drafter, embed, head, held_samples, recipe.gamma)
    # (the trainer defaults: SpecForge's soft cross-entropy only, lm_head trained)
    result = train_ranked(drafter, embed, head, samples, recipe.train_ranks, scratch_dir, progress=progress,
                          epochs=recipe.epochs, lr=recipe.lr, batch_tokens=recipe.batch_tokens, max_len=recipe.max_len,
                          ttt_length=recipe.ttt_length, step_weight=0.8, seed=recipe.seed,
                          max_wall_s=recipe.max_train_s, precision=recipe.precision)
    after = evaluate(drafter, embed, head, held_samples, recipe.gamma)
    return result, before, after


def heldout_chat(target, tokenizer, eos, recipe: StaticRecipe, cache: Path, home: Path,
                 source: TargetSource | None = None) -> list[Sample]:
    from tide import workloads

    held = workloads.sharegpt("heldout", recipe.heldout_prompts, recipe.seed, kind="chat", home=home)
    return prompt_samples(target, tokenizer, eos, held, recipe, cache,
                          f"heldout-{recipe.heldout_prompts}x{recipe.max_new_tokens}", False, source=source)


def train_static(cfg, recipe: StaticRecipe = StaticRecipe(), out: Path | None = None,
                 cache: Path | None = None) -> Path:
    torch.manual_seed(recipe.seed)
    target, tokenizer, folder = load_target(cfg)
    eos = eos_ids_of(tokenizer, folder)
    cache = cache or cfg.home_path / "train-cache" / "static"
    cache.mkdir(parents=True, exist_ok=True)
    home = cfg.home_path
    source = TargetSource(str(folder), target.aux_layer_ids, cfg.model.dtype, cfg.model.max_seq_len)
    t0 = time.monotonic()
    samples = training_samples(target, tokenizer, eos, recipe, cache, home, source)
    held_samples = heldout_chat(target, tokenizer, eos, recipe, cache, home, source)
    data_s = time.monotonic() - t0
    drafter = build_drafter(target, tokenizer, eos, recipe, samples, home)
    result, before, after = fit(drafter, target, samples, held_samples, recipe, scratch_dir=cache)
    log.info("static drafter: simulated accept length %.3f -> %.3f (replayed as decoding steps: %.3f)",
             before.accept_length, after.accept_length, after.replayed_accept_length)
    confidence = {}
    if recipe.confidence_head:
        embed, head = target.embed_weight, target.lm_head_weight
        conf_head, confidence = fit_confidence(drafter, embed, head, samples, held_samples, depth=recipe.gamma,
                                               batch_tokens=recipe.batch_tokens, seed=recipe.seed)
        drafter.confidence = frozen(conf_head)
    meta = {
        "version": "static",
        "recipe": asdict(recipe),
        "train_tokens": sum(len(s) for s in samples),
        "loss_tokens": int(sum(float(s.loss_mask.sum()) for s in samples)),
        "generation_s": round(data_s, 1),
        "train_s": round(result.wall_s, 1),
        "final_loss": result.loss_curve[-1] if result.loss_curve else None,
        "heldout_sim_accept_length": round(after.accept_length, 4),
        "heldout_position_rates": [round(r, 4) for r in after.position_rates],
        "heldout_replayed_accept_length": round(after.replayed_accept_length, 4),
        "untrained_sim_accept_length": round(before.accept_length, 4),
        "target": cfg.model.model_id,
        "confidence": confidence,
    }
    dest = out or cached_static_path(cfg.home_path)
    save_drafter(drafter, dest, metadata=meta, dtype=torch.bfloat16)
    (dest.parent / f"{dest.name}.train.json").write_text(json.dumps(
        {**meta, "loss_curve": result.loss_curve}, indent=1))
    return dest
