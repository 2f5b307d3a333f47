"""The demo's controlled comparison, run with nothing else on the machine after the loop.

Two passes over the same held-out prompts of each workload:
1. acceptance (``tide.report.compare``): target-only vs each drafter with speculation always on, as
   the drafter-quality figure (tokens per target forward) and the lossless check; with a first
   adapted drafter (the shift's quick retrain, swapped in before the final one) that one too;
2. served (``tide.report.compare_served``): one reference engine per mode with the demo's draft-length
   scheduler and per-workload gate, as a client gets it: decode tok/s over target-only.
Workloads are keyed by the names people use (``workload_names``), never by a file's path; an
operator's file is split into traffic and compared prompts by prompt id, as the built-ins are.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

from tide import workloads
from tide.config import SpecConfig
from tide.report import compare, compare_served, ratio_interval

# the demo's engine and its served comparison run the engine's default scheduler, as an operator gets it
SERVED_SCHEDULER = SpecConfig().scheduler


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_prompts(name_or_path: str, split: str, n: int | None, seed: int):
    # an operator's file is split by prompt id as the built-ins are: the compared prompts never ride
    # in the traffic a retrain trains on
    return workloads.split_workload(name_or_path, split, n, seed)


def workload_names(before: str, after: str) -> tuple[str, str]:
    """The two workloads as people name them (``workloads.workload_name``), told apart when equal."""
    names = workloads.workload_name(before), workloads.workload_name(after)
    return names if names[0] != names[1] else (f"{names[0]}-before", f"{names[1]}-after")


def download(home: Path, tracking_uri: str, version: str) -> Path | None:
    """The adapted drafter's folder, fetched while the MLflow server is still up."""
    from tide.config import load_config
    from tide.registry import Registry

    if not version.isdigit():
        return None
    cfg = load_config(overrides={"home": str(home), "registry": {"tracking_uri": tracking_uri}})
    try:
        return Registry.from_config(cfg).download(int(version))
    except Exception as exc:  # reported, the comparison then covers static vs target only
        say(f"could not download drafter {version}: {exc}")
        return None


def comparison(home: Path, adapted_folder: Path | None, before: str, after: str, s,
               first_folder: Path | None = None) -> dict:
    """``before``/``after``: built-in names or files; ``first_folder``: the first adapted drafter
    when a later one replaced it (its tokens per forward are compared too, not served)."""
    from tide.config import load_config
    from tide.drafter.artifact import TargetSpec, load_drafter
    from tide.drafter.static import static_drafter_path
    from tide.models.target import load_target
    from tide.train.offline import render_prompt

    cfg = load_config(overrides={"home": str(home)})
    target, tok, _ = load_target(cfg)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    drafters = {"static": load_drafter(static_drafter_path(cfg), spec)}
    if adapted_folder is not None:
        drafters["adapted"] = load_drafter(adapted_folder, spec)
    if first_folder is not None and adapted_folder is not None:
        drafters["first"] = load_drafter(first_folder, spec)
    (bname, aname), (bpath, apath) = workload_names(before, after), (before, after)
    prompts = {
        bname: [render_prompt(tok, p.chat_messages(), 256) for p in load_prompts(bpath, "heldout", s.compare_prompts, 11)],
        aname: [render_prompt(tok, p.chat_messages(), 256) for p in load_prompts(apath, "heldout", s.compare_prompts, 13)],
    }
    before, after = bname, aname
    # the engine's own decoding settings (draft length, early stop, siblings), as served
    res = compare(target, drafters, prompts, s.compare_max_tokens, cfg.spec.draft_len, progress=say,
                  stop_prob=cfg.spec.draft_stop_prob, siblings=cfg.spec.draft_siblings)
    out = {w: {m: r.as_dict() for m, r in modes.items()} for w, modes in res.items()}
    out["served"] = served(target, tok, {k: v for k, v in drafters.items() if k != "first"}, prompts, s, cfg)
    if "adapted" in drafters:
        a, st = res[after]["adapted"], res[after]["static"]
        out["ratios"] = {
            f"{after}_accept_adapted_over_static": a.tokens_per_forward / st.tokens_per_forward,
            f"{after}_tok_s_adapted_over_static": a.tokens_per_s / st.tokens_per_s,
            f"{before}_accept_adapted_over_static":
                res[before]["adapted"].tokens_per_forward / res[before]["static"].tokens_per_forward,
        }
        # how much each ratio depends on which prompts were drawn (paired bootstrap over prompts)
        out["ratio_intervals_90"] = {
            f"{after}_accept_adapted_over_static": ratio_interval(a, st, "tokens_per_forward"),
            f"{after}_tok_s_adapted_over_static": ratio_interval(a, st, "tokens_per_s"),
            f"{before}_accept_adapted_over_static":
                ratio_interval(res[before]["adapted"], res[before]["static"], "tokens_per_forward"),
        }
        if "first" in drafters:  # the first swap's drafter: how much it helped while the final one trained
            for w in (after, before):
                f, base = res[w]["first"], res[w]["static"]
                out["ratios"][f"{w}_accept_first_over_static"] = f.tokens_per_forward / base.tokens_per_forward
                out["ratio_intervals_90"][f"{w}_accept_first_over_static"] = ratio_interval(
                    f, base, "tokens_per_forward")
    say(json.dumps({k: {"ratio": round(v, 4), "interval_90": [round(x, 4) for x in out["ratio_intervals_90"][k]]}
                     for k, v in out.get("ratios", {}).items()}, indent=2))
    return out


def served(target, tok, drafters: dict, prompts: dict, s, cfg) -> dict:
    """Decode tok/s as a client gets it: the same prompts through one engine per mode with the
    demo's scheduler and gate, each drafter's ratio to target-only with its 90% interval."""
    from tide.engine.reference import ReferenceEngine

    common = dict(target_model_id=cfg.model.model_id, draft_len=cfg.spec.draft_len, max_batch_size=1,
                  max_seq_len=cfg.model.max_seq_len, draft_stop_prob=cfg.spec.draft_stop_prob,
                  draft_siblings=cfg.spec.draft_siblings)
    engines = {"target": ReferenceEngine(target, tok, None, "none", **common)}
    try:
        for name, d in drafters.items():
            engines[name] = ReferenceEngine(target, tok, d, name, **common, scheduler=SERVED_SCHEDULER)
        res = compare_served(engines, prompts, s.compare_max_tokens, progress=say)
        gates = {name: e.health().get("speculation") for name, e in engines.items() if name != "target"}
    finally:
        for e in engines.values():
            e.close()
    out = {"scheduler": SERVED_SCHEDULER, "gate_at_end": gates,
           "modes": {w: {m: r.as_dict() for m, r in modes.items()} for w, modes in res.items()}, "tok_s_over_target": {}}
    for w, modes in res.items():
        for m in drafters:
            ratio = modes[m].tokens_per_s / modes["target"].tokens_per_s
            out["tok_s_over_target"][f"{w}_{m}"] = {"ratio": ratio, "interval_90": ratio_interval(
                modes[m], modes["target"], "tokens_per_s")}
    say("served decode tok/s over target-only: " + ", ".join(
        f"{k} {v['ratio']:.3f} ({v['interval_90'][0]:.3f}-{v['interval_90'][1]:.3f})"
        for k, v in out["tok_s_over_target"].items()))
    return out
