"""Controlled drafter comparison and the demo's report (JSON summary + PNG plot).

``compare`` runs in one process with nothing else running: for every prompt of every workload,
each mode (target-only, and each named drafter) decodes the same number of greedy tokens; the
order of modes rotates per prompt so drifting machine load hits all modes alike. Prefill time is
measured once per prompt and subtracted, so tokens/s is decode speed.
"""
from __future__ import annotations

import json
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tide.contracts import VersionAcceptance
from tide.drafter.model import for_serving
from tide.models.llama import LlamaTarget
from tide.spec.generate import generate


@dataclass
class ModeResult:
    tokens: int = 0
    decode_s: float = 0.0
    forwards: int = 0
    committed: int = 0
    identical_to_target: int = 0
    prompts: int = 0
    # per prompt, in prompt order: what ``ratio_interval`` resamples
    prompt_tokens: list[int] = field(default_factory=list)
    prompt_decode_s: list[float] = field(default_factory=list)
    prompt_forwards: list[int] = field(default_factory=list)
    prompt_committed: list[int] = field(default_factory=list)

    def add(self, tokens: int, decode_s: float, forwards: int, committed: int) -> None:
        self.prompts += 1
        self.tokens += tokens
        self.decode_s += decode_s
        self.forwards += forwards
        self.committed += committed
        self.prompt_tokens.append(tokens)
        self.prompt_decode_s.append(round(decode_s, 6))
        self.prompt_forwards.append(forwards)
        self.prompt_committed.append(committed)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.decode_s if self.decode_s else 0.0

    @property
    def tokens_per_forward(self) -> float:
        return self.committed / self.forwards if self.forwards else 1.0

    def as_dict(self) -> dict:
        return {**asdict(self), "tokens_per_s": round(self.tokens_per_s, 3),
                "tokens_per_forward": round(self.tokens_per_forward, 4)}


def compare(target: LlamaTarget, drafters: dict, prompts_by_workload: dict[str, list[list[int]]],
            max_new_tokens: int, gamma: int, progress=print,
            stop_prob: float = 0.0, siblings: int = 0,
            drafting: dict | None = None) -> dict[str, dict[str, ModeResult]]:
    """{workload: {mode: ModeResult}}; mode "target" is target-only decoding. Drafters run as the
    engine serves them (``for_serving``); ``drafting``: a mode's draft function where its drafter
    kind has its own (tide/spec/block.py), else ``tide.spec.decode.draft``."""
    modes = [("target", None), *((name, for_serving(d)) for name, d in drafters.items())]
    out: dict[str, dict[str, ModeResult]] = {}
    for workload, prompts in prompts_by_workload.items():
        res = {name: ModeResult() for name, _ in modes}
        for i, ids in enumerate(prompts):
            t0 = time.perf_counter()
            generate(target, None, ids, 1)
            prefill_s = time.perf_counter() - t0
            rotated = modes[i % len(modes):] + modes[: i % len(modes)]
            outputs = {}
            for name, drafter in rotated:
                t0 = time.perf_counter()
                kind = {"drafting": drafting[name]} if drafting and name in drafting else {}
                tokens, stats = generate(target, drafter, ids, max_new_tokens, gamma=gamma, stop_prob=stop_prob,
                                         siblings=siblings, **kind)
                elapsed = time.perf_counter() - t0
                res[name].add(tokens=len(tokens) - 1, decode_s=max(1e-6, elapsed - prefill_s),
                              forwards=stats.target_forwards,
                              committed=sum(stats.accept_lengths) if drafter is not None else stats.target_forwards)
                outputs[name] = tokens
            for name, _ in modes:
                res[name].identical_to_target += outputs[name] == outputs["target"]
            progress(f"  compare {workload}: {i + 1}/{len(prompts)} prompts")
        out[workload] = res
    return out


def compare_served(engines: dict, prompts_by_workload: dict[str, list[list[int]]], max_new_tokens: int,
                   progress=print) -> dict[str, dict[str, ModeResult]]:
    """{workload: {mode: ModeResult}} decoded through serving engines, one per mode (``engines``:
    mode -> Engine, "target" serving no drafter), each request tagged with its workload: what a
    client gets, with the engine's draft-length scheduler and per-workload gate as configured.

    Tokens/s of a prompt = tokens after the first / seconds from the first token to the last
    (prefill excluded); forwards and committed tokens come from the engine's counters. The engines
    live across workloads and prompts, as a serving engine's running acceptance does.
    """
    from tide.engine.base import GenerationRequest, SamplingParams

    modes = list(engines)
    out: dict[str, dict[str, ModeResult]] = {}
    for workload, prompts in prompts_by_workload.items():
        res = {m: ModeResult() for m in modes}
        for i, ids in enumerate(prompts):
            outputs = {}
            for m in modes[i % len(modes):] + modes[: i % len(modes)]:
                eng = engines[m]
                before = _counters(eng)
                req = GenerationRequest(f"compare-{workload}-{m}-{i}", tuple(ids),
                                        SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True),
                                        workload=workload)
                tokens, t_first = [], 0.0
                for ev in eng.submit(req):
                    if not tokens:
                        t_first = time.perf_counter()
                    tokens.extend(ev.token_ids)
                decode_s = time.perf_counter() - t_first
                after = _counters(eng)
                res[m].add(tokens=len(tokens) - 1, decode_s=max(1e-6, decode_s), forwards=after[0] - before[0],
                           committed=after[1] - before[1])
                outputs[m] = tokens
            for m in modes:
                res[m].identical_to_target += outputs[m] == outputs["target"]
            progress(f"  served {workload}: {i + 1}/{len(prompts)} prompts")
        out[workload] = res
    return out


def _counters(engine) -> tuple[int, int]:
    """(target forwards, tokens committed) of the engine's serving drafter so far."""
    acc = engine.stats().acceptance.get(engine.drafter_version, VersionAcceptance())
    return acc.forwards, acc.committed


def speculation_timeline(events: list[dict], t0_unix: float) -> dict[str, list[dict]]:
    """The engine's gate changes (``SpecPolicy.events``) by workload, timed in seconds from
    ``t0_unix``: when each workload's speculation went on or off, for which drafter, and why."""
    out: dict[str, list[dict]] = {}
    for e in sorted(events, key=lambda e: e["t_unix"]):
        out.setdefault(e["workload"], []).append(
            {"t_s": round(e["t_unix"] - t0_unix, 1), "on": e["on"], "reason": e["reason"],
             "drafter_version": e["drafter_version"], "acceptance_by_depth": e["acceptance_by_depth"]})
    return out


def timeline_lines(timeline: dict[str, list[dict]]) -> list[str]:
    """One line per workload: ``chat: on at 0.0 s (default, drafter 1); off at 41.2 s (...)``."""
    return [f"{w}: " + "; ".join(f"{'on' if e['on'] else 'off'} at {e['t_s']:.0f} s ({e['reason']}, drafter "
                                 f"{e['drafter_version']})" for e in changes)
            for w, changes in timeline.items()]


def ratio_interval(a: ModeResult, b: ModeResult, metric: str, level: float = 0.9, draws: int = 2000,
                   seed: int = 0) -> tuple[float, float]:
    """Paired bootstrap interval of ``metric(a) / metric(b)`` over prompts.

    ``metric`` is "tokens_per_forward" (committed / forwards) or "tokens_per_s" (tokens /
    decode_s). Steps: draw prompt indices with replacement (the same draw for both modes: they
    decoded the same prompts), recompute each mode's ratio of sums, take their quotient; the
    interval is the central ``level`` of the draws. It measures how much the figure depends on
    which prompts were drawn (and, for tokens/s, on timing noise per prompt): with 8 prompts a
    ratio can move by several percent.
    """
    columns = {"tokens_per_forward": ("prompt_committed", "prompt_forwards"),
               "tokens_per_s": ("prompt_tokens", "prompt_decode_s")}
    if metric not in columns:
        raise ValueError(f"metric must be one of {sorted(columns)}, got {metric!r}")
    num, den = columns[metric]
    n = len(getattr(a, num))
    if n == 0 or n != len(getattr(b, num)):
        raise ValueError(f"both modes need the same prompts (got {n} and {len(getattr(b, num))})")
    series = [getattr(a, num), getattr(a, den), getattr(b, num), getattr(b, den)]
    rng = random.Random(seed)
    out = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        an, ad, bn, bd = (sum(values[i] for i in idx) for values in series)
        if ad > 0 and bd > 0 and bn > 0:
            out.append((an / ad) / (bn / bd))
    if not out:  # e.g. no prompt decoded a token: nothing to resample
        return float("nan"), float("nan")
    out.sort()
    tail = (1.0 - level) / 2
    return out[round(tail * (len(out) - 1))], out[round((1.0 - tail) * (len(out) - 1))]


def plot_acceptance(sampler, path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.5))
    versions = sorted({p.version for p in sampler.points}, key=lambda v: (len(v), v))
    for v in versions:
        pts = [p for p in sampler.points if p.version == v]
        ax.plot([p.t_s / 60 for p in pts], [p.tokens_per_forward for p in pts], marker="o", ms=3,
                label=f"drafter {v}")
    for t_s, label in sampler.marks:
        ax.axvline(t_s / 60, color="grey", ls="--", lw=1)
        ax.text(t_s / 60, ax.get_ylim()[1], f" {label}", rotation=90, va="top", fontsize=8)
    ax.set_xlabel("minutes since traffic start")
    ax.set_ylabel("tokens per target forward (live)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_summary(path: Path, summary: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str))
    return path
