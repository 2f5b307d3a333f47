"""Online-retrain settings side by side on one captured window, scored as the demo scores them.

The demo's old-workload floor asks a retrain to gain on the new traffic without losing the old;
what trades one for the other is the retrain's settings (rate, passes, ``train.anchor``). This
replays one real retrain window under several settings:
1. the window: a finished demo's home (``--home <TIDE_HOME>/demo``): its config
   (``run/tide.yaml``), its Parquet dataset, and the window its first retrain trained on (the
   smallest ``window_end_s`` in its MLflow store; ``--until`` overrides; ``--version`` pins the table
   version a retrain read, its ``data_table_version``, so the window is exactly that retrain's);
2. per variant (``--variant name:key=value,...``, keys of ``train.*``): the parent (default: the
   packaged static drafter) retrained on that window as ``tide train --online`` trains it (the
   home's ``train.*`` with the variant's overrides, its time cap, 1 torch thread), weights rounded
   to bfloat16 as registered;
3. the demo's acceptance comparison: the same held-out prompts of each workload (``--before`` and
   ``--after``, the demo's seeds), greedy, speculation always on with the served draft length and
   stop rule; tokens per target forward of each candidate over the reference's (``--reference``,
   default the parent: a demo's later retrain warm-starts from a retrained parent, and its floors
   are over the static drafter), with a 90% paired bootstrap interval over prompts. Tokens per forward do not depend on timing, so variants may
   run in parallel processes (one ``--variant`` each).
``--fractions 1,0.8,...`` scores each trained candidate at several ``train.update_fraction``s (the
parent plus that fraction of its change: one training run per variant, not one per fraction);
Each trained variant also reports, per fraction, its window's held-out requests' simulated acceptance
by workload tag over the parent's (what the retrain itself measures of each workload, with positions).
``--candidate <folder>`` scores a drafter already trained on the window (a demo's registered
version) the same way, without training.

    python -m bench.retrain_variants --home /tmp/h/demo --variant base: --variant anchor:anchor=4,lr=1.5e-3
                                     [--candidate <folder>] [--fractions 1,0.8] [--prompts 24]
                                     [--max-new-tokens 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import torch

from bench.report import print_table, write_json
from tide.comparison import load_prompts
from tide.config import ConfigError, TrainConfig, load_config, replace
from tide.drafter.artifact import TargetSpec, load_drafter, round_weights_
from tide.drafter.model import for_serving
from tide.drafter.static import static_drafter_path
from tide.models.target import load_target
from tide.report import ModeResult, ratio_interval
from tide.spec.generate import generate
from tide.train.fraction import keep_update_
from tide.train.offline import render_prompt
from tide.train.online import data_dir_of, plan_for
from tide.train.ranks import train_kwargs
from tide.train.rehearsal import load_training
from tide.train.trainer import evaluate, train

SEEDS = {"before": 11, "after": 13}  # the demo comparison's prompt draws (tide/comparison.py)


def parse_variant(text: str) -> tuple[str, dict]:
    """"name:key=value,key=value" -> (name, {key: bool, int, float or text}); "name:" = the home's
    settings. Raises ValueError naming what is wrong (no name, an unknown ``train.*`` key); values are
    checked against the config's rules by the caller (a text where a number belongs is refused there)."""
    name, sep, rest = text.partition(":")
    if not name or not sep:
        raise ValueError(f"{text!r}: expected name:key=value,... (name: alone = the home's settings)")
    known = set(TrainConfig.model_fields)
    overrides = {}
    for item in filter(None, rest.split(",")):
        key, _, value = (part.strip() for part in item.partition("="))
        if key not in known:
            raise ValueError(f"{text!r}: {key!r} is not a train.* setting")
        overrides[key] = _value(value)
    return name, overrides


def _value(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lstrip("-").isdigit():
        return int(text)
    try:
        return float(text)
    except ValueError:
        return text  # e.g. train.precision=auto


def first_retrain_until(cfg) -> float:
    """The end of the first retrain's window, from the home's MLflow store."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{Path(cfg.home) / 'mlflow' / 'mlflow.db'}")
    ends = [float(r.data.params["window_end_s"]) for e in client.search_experiments()
            for r in client.search_runs([e.experiment_id]) if "window_end_s" in r.data.params]
    if not ends:
        raise SystemExit(f"no retrain window recorded under {cfg.home}; pass --until")
    return min(ends)


def retrain(cfg, parent, target, overrides: dict, until_s: float | None, spill: Path, version: int | None = None,
            fractions: list[float] = ()):
    """The parent retrained on the window as the online retrain does (the home's ``train.*`` with
    ``overrides``, validated as config); returns (candidate as trained, its update fraction, steps,
    train s, training requests, held-out acceptance by workload: {"parent" or fraction: {tag: (acc, positions)}})."""
    cfg = replace(cfg, train=replace(cfg.train, **overrides))
    tc = cfg.train
    plan = plan_for(cfg, until_s, version)
    print(f"window: {len(plan.recent)} recent + {len(plan.replay)} replayed requests ({plan.replay_workloads}) "
          f"+ {plan.rehearsal} rehearsed, "
          f"table version {plan.data_version}", flush=True)
    data = load_training(cfg, data_dir_of(cfg), plan, spill)
    try:
        cand = copy.deepcopy(parent)
        t0 = time.monotonic()
        result = train(cand, target.embed_weight, target.lm_head_weight, data.train, **train_kwargs(tc))
        train_s = time.monotonic() - t0

        def held(drafter) -> dict:  # the window's held-out requests by workload, as the retrain evaluates them
            return evaluate(drafter, target.embed_weight, target.lm_head_weight, data.heldout, cfg.spec.draft_len,
                            tc.ttt_length, tc.step_weight_decay, tc.max_seq_len, tc.batch_tokens,
                            groups=data.heldout_workloads).by_group
        heldout = {"parent": held(parent),
                   **{f: held(at_fraction(cand, parent, f)) for f in (fractions or [tc.update_fraction])}}
        return cand, tc.update_fraction, result.steps, train_s, len(data.train), heldout
    finally:
        data.close()


def at_fraction(trained, parent, fraction: float):
    """The candidate a retrain registers: ``fraction`` of the change kept, rounded to bf16."""
    cand = copy.deepcopy(trained)
    keep_update_(cand, parent, fraction)
    return round_weights_(cand, torch.bfloat16)


def tokens_per_forward(target, drafter, prompts, max_new_tokens: int, cfg) -> ModeResult:
    res = ModeResult()
    served = for_serving(drafter)
    for ids in prompts:
        out, stats = generate(target, served, ids, max_new_tokens, gamma=cfg.spec.draft_len,
                              stop_prob=cfg.spec.draft_stop_prob)
        res.add(tokens=len(out) - 1, decode_s=0.0, forwards=stats.target_forwards, committed=sum(stats.accept_lengths))
    return res


def parse_fractions(text: str) -> list[float]:
    """"1,0.8" -> [1.0, 0.8]; each must be a valid ``train.update_fraction``."""
    fractions = [float(f) for f in text.split(",") if f.strip()]
    for f in fractions:
        replace(TrainConfig(), update_fraction=f)  # ConfigError names the rule
    return fractions


def score(target, prompts, base, drafter, args, cfg) -> tuple[dict, dict]:
    """(tokens per forward by workload, (ratio over the reference's ``base``, 90% interval) by workload)."""
    res = {w: tokens_per_forward(target, drafter, p, args.max_new_tokens, cfg) for w, p in prompts.items()}
    return res, {w: (res[w].tokens_per_forward / base[w].tokens_per_forward,
                     ratio_interval(res[w], base[w], "tokens_per_forward")) for w in prompts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--home", required=True, help="a finished demo's home (<TIDE_HOME>/demo)")
    ap.add_argument("--variant", action="append", default=[], help="name:key=value,... (train.* overrides)")
    ap.add_argument("--candidate", default=None, help="a drafter already trained on the window (scored, not trained)")
    ap.add_argument("--fractions", default="", help="update fractions to score each candidate at "
                                                     "(default: the variant's train.update_fraction; 1 for --candidate)")
    ap.add_argument("--parent", default=None, help="drafter folder (default: the packaged static drafter)")
    ap.add_argument("--reference", default=None, help="drafter folder the ratios are over (default: the parent)")
    ap.add_argument("--until", type=float, default=None, help="window end, unix s (default: the first retrain's)")
    ap.add_argument("--version", type=int, default=None, help="the table version to read (a retrain's data_table_version)")
    ap.add_argument("--before", default="chat")
    ap.add_argument("--after", default="code")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:  # every variant checked (names, keys, values, config rules) before anything loads or trains
        variants = [parse_variant(v) for v in args.variant]
        for _, overrides in variants:
            replace(TrainConfig(), **overrides)
        fractions = parse_fractions(args.fractions)
    except (ValueError, ConfigError) as exc:
        ap.error(str(exc))
    if not variants and not args.candidate:
        ap.error("nothing to score: give --variant and/or --candidate")
    torch.set_num_threads(1)
    home = Path(args.home)
    cfg = load_config(home / "run" / "tide.yaml", env={})
    target, tok, _ = load_target(cfg)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    parent = load_drafter(args.parent or static_drafter_path(cfg), spec)
    prompts = {w: [render_prompt(tok, p.chat_messages(), 256) for p in load_prompts(w, "heldout", args.prompts, SEEDS[k])]
               for k, w in (("before", args.before), ("after", args.after))}
    reference = load_drafter(Path(args.reference), spec) if args.reference else parent
    base = {w: tokens_per_forward(target, reference, p, args.max_new_tokens, cfg) for w, p in prompts.items()}
    rows = [("variant", "fraction", "steps", "train s", *(f"{w} cand/reference (90%)" for w in prompts))]
    out = {"reference": {w: r.tokens_per_forward for w, r in base.items()}, "variants": {}}
    trained = []  # (name, drafter as trained, fractions, what the run was)
    if args.candidate:
        trained.append(("candidate", load_drafter(Path(args.candidate), spec), fractions or [1.0],
                        {"folder": args.candidate, "steps": "-", "train_s": "-"}))
    if variants:
        # a pinned version is the retrain's window as it read it: no time bound unless one is given
        out["until_s"] = until_s = args.until or (None if args.version is not None else first_retrain_until(cfg))
        out["data_table_version"] = args.version
    for name, overrides in variants:
        spill = Path(cfg.home) / "bench-spill" / name
        cand, own, steps, train_s, n_train, heldout = retrain(cfg, parent, target, overrides, until_s, spill,
                                                              args.version, fractions)
        trained.append((name, cand, fractions or [own], {"overrides": overrides, "steps": steps,
                                                         "train_s": round(train_s, 1), "train_requests": n_train,
                                                         "heldout": heldout}))
    for name, cand, fracs, info in trained:
        for f in fracs:
            res, ratios = score(target, prompts, base, at_fraction(cand, parent, f), args, cfg)
            held = info.get("heldout", {})
            by_tag = {t: (acc / held["parent"][t][0], n) for t, (acc, n) in held.get(f, {}).items()}
            out["variants"][f"{name}@{f}"] = {**{k: v for k, v in info.items() if k != "heldout"}, "update_fraction": f,
                                              "heldout_over_parent": by_tag,
                                              "tokens_per_forward": {w: r.tokens_per_forward for w, r in res.items()},
                                              "ratio": {w: r for w, (r, _) in ratios.items()},
                                              "ratio_interval_90": {w: i for w, (_, i) in ratios.items()}}
            rows.append((name, f, info["steps"], f"{info['train_s']}",
                         *(f"{r:.3f} ({lo:.3f}-{hi:.3f})" for r, (lo, hi) in ratios.values())))
            print(f"{name} @ {f}: " + ", ".join(f"{w} {r:.3f}" for w, (r, _) in ratios.items())
                  + "; window held-out over the parent: "
                  + ", ".join(f"{t} {r:.3f} ({n} positions)" for t, (r, n) in by_tag.items()), flush=True)
    print_table(f"retrain candidates on {home} (reference: "
                + ", ".join(f"{w} {r.tokens_per_forward:.3f}" for w, r in base.items()) + " tokens/forward)", rows)
    write_json(args.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
