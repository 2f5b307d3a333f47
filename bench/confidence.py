"""Calibration of the draft confidence head on real traffic, and the head a drafter ships with.

The target answers workload prompts greedily (its states at every position, as capture records
them); the head is fitted on the train-split answers of every ``--workload`` together, its
per-depth temperatures on half of each workload's held-out answers, and expected calibration error
(ECE) is measured per workload on the other half for three survival estimates: the draft's raw top
probability (today's stop rule), the head before scaling and after (and, side by side, a head
fitted only on the rows whose chain is alive). The 90% interval resamples held-out requests (rows
within one request correlate). ``--save-into DIR`` writes the head into that drafter folder
(``confidence/head.safetensors``, its checksum and this report in ``tide.json``; the SGLang /
SpecForge files are left as they are), its recorded held-out ECE the worst workload's: serving
uses it only if that is at most 0.05.

    python -m bench.confidence [--workload chat,code] [--train-prompts 96] [--heldout-prompts 64] [--json out.json]
                               [--save-into tide/assets/drafters/smollm2-static]
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

from bench.report import print_table, write_json
from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import META, TargetSpec, load_drafter
from tide.drafter.confidence import CONFIDENCE_SHA, ConfidenceHead, frozen, save_confidence
from tide.drafter.static import static_drafter_path
from tide.models.target import eos_ids_of, load_target
from tide.train.confidence import Features, _features_of, alive_ece, calibration_error, fit_head, fit_temperatures
from tide.train.offline import generate_samples, render_prompt


def answers(target, tok, eos, workload: str, split: str, n: int, max_new_tokens: int, seed: int):
    prompts = workloads.load_workload(workload, split, n, seed=seed)
    ids = [render_prompt(tok, p.chat_messages(), 192) for p in prompts]
    return generate_samples(target, ids, max_new_tokens, eos, batch_size=16, progress=False)


def interval_over_requests(head, test, reps: int = 400, seed: int = 0) -> tuple[float, float]:
    """90% bootstrap interval of the scaled head's ECE, resampling held-out requests."""
    rng = random.Random(seed)
    groups = sorted(set(test.group.tolist()))
    by_group = {g: (test.group == g).nonzero().flatten() for g in groups}
    with torch.no_grad():
        p = head.survival(test.x, test.depth)
    values = []
    for _ in range(reps):
        idx = torch.cat([by_group[rng.choice(groups)] for _ in groups])
        idx = idx[test.alive[idx]]
        values.append(calibration_error(p[idx], test.label[idx]))
    values.sort()
    return values[int(0.05 * reps)], values[int(0.95 * reps) - 1]


def save_into(folder: Path, head: ConfidenceHead, report: dict) -> str:
    """The head beside the drafter's own files; tide.json records its checksum and the report."""
    sha = save_confidence(frozen(head), folder)
    meta_path = folder / META
    meta = json.loads(meta_path.read_text())
    report = {k: v for k, v in report.items() if k != "drafter"} | {"command": " ".join(["python -m bench.confidence",
                                                                                           *sys.argv[1:]])}
    meta[CONFIDENCE_SHA], meta["confidence"] = sha, report
    meta_path.write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n")
    return sha


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="chat", help="one or more, comma-separated: fitted together, scored apart")
    ap.add_argument("--train-prompts", type=int, default=96, help="per workload")
    ap.add_argument("--heldout-prompts", type=int, default=64, help="per workload")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--l2", type=float, default=1e-3, help="the head's L2 penalty")
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--save-into", default=None, help="write the fitted head into this drafter folder")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    cfg = load_config()
    target, tok, folder = load_target(cfg)
    eos = eos_ids_of(tok, folder)
    path = Path(args.drafter) if args.drafter else static_drafter_path(cfg)
    drafter = load_drafter(path, TargetSpec(target.shape.hidden_size, target.shape.vocab_size,
                                            target.aux_layer_ids)).float()
    embed, lm_head = target.embed_weight, target.lm_head_weight
    names = args.workload.split(",")
    feats = lambda samples: _features_of(drafter, embed, lm_head, samples, args.depth, 65536, 4096, 1024, 0)  # noqa: E731
    train, calib, tests = [], [], {}
    for w in names:
        train += answers(target, tok, eos, w, "train", args.train_prompts, args.max_new_tokens, 0)
        held = answers(target, tok, eos, w, "heldout", args.heldout_prompts, args.max_new_tokens, 1)
        calib.append(feats(held[0::2]))
        tests[w] = feats(held[1::2])
    generated_s = time.perf_counter() - t0
    fit_data, calib = feats(train), Features.cat(calib)
    head, alive_fit = (ConfidenceHead(drafter.shape.hidden_size, args.depth) for _ in range(2))
    bce = fit_head(head, fit_data, l2=args.l2)
    fit_head(alive_fit, fit_data, l2=args.l2, alive_only=True)  # the option, side by side
    raw = {w: alive_ece(head, t, raw=True) for w, t in tests.items()}
    fit_temperatures(alive_fit, calib)
    temps = fit_temperatures(head, calib)
    rows = [("metric", *names)]
    per: dict[str, dict] = {}
    for w, test in tests.items():
        lo, hi = interval_over_requests(head, test)
        per[w] = {"test_rows": int(test.alive.sum()), "ece_top_prob": calibration_error(test.x[test.alive, -1].exp(),
                                                                                       test.label[test.alive]),
                  "ece_head_raw": raw[w], "ece_head_scaled": alive_ece(head, test), "ece_scaled_interval_90": [lo, hi],
                  "ece_alive_fit_scaled": alive_ece(alive_fit, test)}
    for key, label in [("test_rows", "held-out rows scored (chains alive)"),
                       ("ece_top_prob", "ECE, raw draft top probability"), ("ece_head_raw", "ECE, head before scaling"),
                       ("ece_head_scaled", "ECE, head after sequential scaling"),
                       ("ece_scaled_interval_90", "  90% interval over requests"),
                       ("ece_alive_fit_scaled", "ECE after scaling, head fitted on alive rows only")]:
        rows.append((label, *(f"{per[w][key][0]:.4f} - {per[w][key][1]:.4f}" if isinstance(per[w][key], list)
                              else f"{per[w][key]:.4f}" if isinstance(per[w][key], float) else per[w][key]
                              for w in names)))
    head.heldout_ece = max(per[w]["ece_head_scaled"] for w in names)  # what serving checks: the worst workload
    wall_s = time.perf_counter() - t0
    summary = {"workloads": per, "train_prompts_per_workload": args.train_prompts,
               "heldout_prompts_per_workload": args.heldout_prompts, "depth": args.depth, "temperatures": temps,
               "train_bce": bce, "heldout_ece": head.heldout_ece, "generate_s": round(generated_s, 1),
               "fit_s": round(wall_s - generated_s, 1), "drafter": str(path)}
    rows += [("temperatures by depth", " ".join(f"{t:.2f}" for t in temps)),
             ("recorded held-out ECE (worst workload)", f"{head.heldout_ece:.4f}"),
             ("seconds: answers / features + fit", f"{generated_s:.0f} / {wall_s - generated_s:.0f}")]
    print_table(f"draft confidence calibration ({args.workload}, depth {args.depth})", rows)
    if args.save_into:
        sha = save_into(Path(args.save_into), head, summary)
        print(f"\nhead written into {args.save_into} (sha256 {sha[:16]})")
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
