"""The same retrain window trained on the GPU and on the CPU: held-out simulated acceptance and
training tokens/s on each (what ``scripts/gpu_check_train.sh`` runs on a GPU machine).

Steps:
1. ``--pack-out DIR`` (on a machine with the target cached): a small pack of real captured
   requests (ShareGPT chat answered by SmolLM2-135M-Instruct, bench/retrain.py's source), with
   the target's argmax at each generated position precomputed and only the embedding rows the
   requests use and the lm_head rows of the draft vocab (bf16): small enough to carry to a GPU
   machine with the repository (at most 64 MiB in all), no model download there;
2. ``--pack DIR``: warm-start the packaged static drafter on the pack's training requests, once
   per ``--devices`` entry, with the same seed, schedule and batches; evaluate the parent and
   each candidate on the held-out requests (fp32, on the device that trained it);
3. print per device: precision, training wall, tokens/s (loss-bearing tokens seen / training
   wall) with the 10-90% range of per-step rates, sim accept length parent -> candidate, and
   the GPU/CPU ratios.

    python -m bench.train_device --pack-out .gpu-check/pack          # here, once
    python -m bench.train_device --pack .gpu-check/pack --devices cuda,cpu [--json out.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.report import print_table, write_json

HELDOUT_EVERY = 5  # every 5th request of the pack is held out


def write_pack(out: Path, requests: int, max_len: int) -> None:
    from safetensors.torch import save_file

    from bench.retrain import source_samples
    from tide.config import load_config
    from tide.drafter.artifact import load_drafter
    from tide.drafter.static import static_drafter_path
    from tide.models.target import load_target
    from tide.train.trainer import prepare

    cfg = load_config(None)
    samples, source = source_samples(cfg, 96)
    samples = samples[:requests]
    target, _, _ = load_target(cfg)
    drafter = load_drafter(static_drafter_path(cfg))
    prepare(samples, drafter, target.lm_head_weight)
    tensors = {}
    for i, s in enumerate(samples):
        n = min(len(s), max_len)
        tensors.update({f"{i}.tokens": s.tokens[:n], f"{i}.mask": s.loss_mask[:n].float(),
                        f"{i}.aux": s.aux[:n].bfloat16().contiguous(),
                        f"{i}.final": s.final[:n].bfloat16().contiguous(), f"{i}.top": s.target_top[:n]})
    used = torch.unique(torch.cat([s.tokens for s in samples]))
    head_ids = drafter.draft_to_target
    tensors.update({"embed_ids": used, "embed_rows": target.embed_weight[used].bfloat16().contiguous(),
                    "head_ids": head_ids, "head_rows": target.lm_head_weight[head_ids].bfloat16().contiguous(),
                    "vocab_size": torch.tensor([target.shape.vocab_size])})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "pack.safetensors"))
    (out / "pack.json").write_text(json.dumps({"source": source, "requests": len(samples), "max_len": max_len,
                                               "model_id": cfg.model.model_id}))
    print(f"wrote {out}: {len(samples)} requests, {(out / 'pack.safetensors').stat().st_size / 2**20:.1f} MiB")


def read_pack(folder: Path):
    """(train samples, held-out samples, embed, lm_head): rows absent from the pack are zeros,
    never read (the argmax is precomputed; the teacher uses the draft-vocab rows only)."""
    from safetensors.torch import load_file

    from tide.train.trainer import Sample

    t = load_file(str(folder / "pack.safetensors"))
    vocab = int(t["vocab_size"][0])
    embed = torch.zeros(vocab, t["embed_rows"].shape[1])
    embed[t["embed_ids"]] = t["embed_rows"].float()
    head = torch.zeros(vocab, t["head_rows"].shape[1])
    head[t["head_ids"]] = t["head_rows"].float()
    n = len({k.split(".")[0] for k in t if k.split(".")[0].isdigit()})
    samples = [Sample(tokens=t[f"{i}.tokens"], loss_mask=t[f"{i}.mask"], aux=t[f"{i}.aux"], final=t[f"{i}.final"],
                      target_top=t[f"{i}.top"]) for i in range(n)]
    heldout = [s for i, s in enumerate(samples) if i % HELDOUT_EVERY == 0]
    train = [s for i, s in enumerate(samples) if i % HELDOUT_EVERY != 0]
    return train, heldout, embed, head


def run_device(name: str, precision: str, parent, train_s, heldout, embed, head, args) -> dict:
    from tide.train.device import resolve_device
    from tide.train.trainer import evaluate, train

    device = resolve_device(name)
    eval_kw = dict(gamma=4, ttt_length=4, max_len=args.max_len, batch_tokens=4096, device=device)
    before = evaluate(copy.deepcopy(parent), embed, head, copy.deepcopy(heldout), **eval_kw)
    drafter = copy.deepcopy(parent)
    stamps = [time.monotonic()]
    result = train(drafter, embed, head, copy.deepcopy(train_s), epochs=args.epochs, lr=1e-3,
                   batch_tokens=args.batch_tokens, max_len=args.max_len, ttt_length=4, step_weight=0.8,
                   seed=0, progress=False, device=device, precision=precision,
                   on_step=lambda step, loss: stamps.append(time.monotonic()))
    from tide.drafter.artifact import round_weights_
    round_weights_(drafter, torch.bfloat16)  # as a retrain stores and evaluates it
    after = evaluate(drafter, embed, head, copy.deepcopy(heldout), **eval_kw)
    per_step = sorted(result.tokens_seen / max(1, result.steps) / max(1e-9, b - a)
                      for a, b in zip(stamps[1:], stamps[2:]))  # the first step holds warm-up costs
    q = statistics.quantiles(per_step, n=10) if len(per_step) >= 10 else [float("nan")] * 9
    return {"device": str(device), "precision": precision, "steps": result.steps, "train_wall_s": result.wall_s,
            "tokens_seen": result.tokens_seen, "tokens_per_s": result.tokens_seen / max(1e-9, result.wall_s),
            "step_tokens_per_s_p10": q[0], "step_tokens_per_s_p90": q[-1],
            "final_loss": result.loss_curve[-1], "sim_accept_parent": before.accept_length,
            "sim_accept_candidate": after.accept_length, "heldout_positions": after.positions}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pack-out", help="write a pack of captured requests here and stop")
    parser.add_argument("--requests", type=int, default=30, help="requests in the pack (--pack-out)")
    parser.add_argument("--pack", default=".gpu-check/pack")
    parser.add_argument("--devices", default="cuda,cpu", help="comma-separated: cuda, cpu")
    parser.add_argument("--gpu-precision", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-tokens", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1, help="CPU torch threads")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    if args.pack_out:
        write_pack(Path(args.pack_out), args.requests, args.max_len)
        return 0
    torch.set_num_threads(args.threads)
    from tide.config import load_config
    from tide.drafter.artifact import load_drafter
    from tide.drafter.static import static_drafter_path

    train_s, heldout, embed, head = read_pack(Path(args.pack))
    parent = load_drafter(static_drafter_path(load_config(None)))
    runs = [run_device(d, args.gpu_precision if d == "cuda" else "fp32", parent, train_s, heldout, embed, head, args)
            for d in args.devices.split(",")]
    rows = [(f"{r['device']} {r['precision']}", f"{r['train_wall_s']:.1f} s", f"{r['tokens_per_s']:.0f} tok/s",
             f"(steps 10-90%: {r['step_tokens_per_s_p10']:.0f}-{r['step_tokens_per_s_p90']:.0f})",
             f"loss {r['final_loss']:.3f}",
             f"sim accept {r['sim_accept_parent']:.3f} -> {r['sim_accept_candidate']:.3f}") for r in runs]
    by = {r["device"].split(":")[0]: r for r in runs}
    if "cuda" in by and "cpu" in by:
        g, c = by["cuda"], by["cpu"]
        rows.append(("GPU / CPU training tokens/s", f"{g['tokens_per_s'] / c['tokens_per_s']:.1f}x"))
        rows.append(("held-out sim accept, GPU - CPU candidate", f"{g['sim_accept_candidate'] - c['sim_accept_candidate']:+.3f}"))
    print_table(f"one window ({len(train_s)} train / {len(heldout)} held-out requests, {args.epochs} epochs), "
                f"per device", rows)
    write_json(args.json, {"runs": runs, "train_requests": len(train_s), "heldout_requests": len(heldout)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
