"""Warm-start retrain on ~50k tokens of logged data: wall time, training tokens/s, peak memory.

Steps:
1. target states: ShareGPT chat answered by the real target (SmolLM2-135M-Instruct), taken from
   the static recipe's cache (``<home>/train-cache/static/train-*.safetensors``) or generated
   once (``--prompts`` prompts) and cached under ``<home>/train-cache/bench``;
2. a fresh TIDE home: the static drafter, and the states logged into the Parquet dataset through
   the dataset writer until ``--tokens`` training tokens exist; when the source is smaller,
   conversations repeat under new request ids, and held-out conversations are logged once (their
   ids hash into the held-out slice), so no held-out conversation is ever trained on;
3. ``tide train --online`` as the scheduler runs it (a child process, 1 torch thread): it
   bootstraps the registry with the static drafter, trains the candidate on every training
   token (epochs 1, no time cap), evaluates both on the held-out slice, registers a challenger;
4. wall time of the child, its peak RSS, tokens/s from its result JSON, and the peak of each of
   its phases (``tide/train/memory.py``). The retrain resets the kernel's RSS high-water mark at
   each phase, which also lowers what ``wait4`` reports, so the peak is the largest of: the
   retrain's own fold of every phase's mark, ``wait4``'s figure, and this process sampling the
   child's RSS every 20 ms (a lower bound that needs no cooperation from the child).
Floors: wall <= 10 min, peak RSS <= 4 GiB; ``--scale 4`` (4x the tokens) checks that the peak
does not grow with the window.

    python -m bench.retrain [--tokens 50000] [--scale 1] [--device cpu|cuda|auto] [--precision fp32|bf16] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

from bench.report import print_table, write_json
from tide.config import load_config
from tide.drafter.static import cached_static_path, static_drafter_path
from tide.models.checkpoint import ensure_target_checkpoint
from tide.train.capture_log import log_samples
from tide.train.window import heldout_score

FLOOR_WALL_S = 600.0
FLOOR_RSS_GIB = 4.0
HELDOUT_FRACTION = 0.1


def source_samples(cfg, prompts: int):
    from tide.train.generation_pool import load_samples

    cached = sorted((cfg.home_path / "train-cache" / "static").glob("train-*.safetensors"))
    if cached:
        return load_samples(cached[-1]), str(cached[-1])
    path = cfg.home_path / "train-cache" / "bench" / f"sharegpt-{prompts}.safetensors"
    if not path.exists():
        from tide import workloads
        from tide.engine.reference import eos_ids_of, load_target
        from tide.train.generation_pool import save_samples
        from tide.train.offline import generate_samples, render_prompt

        target, tok, folder = load_target(cfg)
        chat = workloads.sharegpt("train", prompts, 0, kind="chat", home=cfg.home_path)
        ids = [render_prompt(tok, p.chat_messages(), 192) for p in chat]
        path.parent.mkdir(parents=True, exist_ok=True)
        save_samples(generate_samples(target, ids, 80, eos_ids_of(tok, folder)), path)
    return load_samples(path), str(path)


def repeated(samples, tokens: int, max_seq_len: int):
    """(samples, request ids) with >= ``tokens`` training tokens; held-out ids are used once."""
    out, ids, train_tokens, rep = [], [], 0, 0
    while train_tokens < tokens:
        for i, s in enumerate(samples):
            rid, k = f"bench-{i:05d}-r{rep}", 0
            if heldout_score(f"bench-{i:05d}-r0") < HELDOUT_FRACTION:
                if rep:
                    continue
                rid = f"bench-{i:05d}-r0"
            else:
                while heldout_score(rid) < HELDOUT_FRACTION:  # a copy must stay a training request
                    k += 1
                    rid = f"bench-{i:05d}-r{rep}-{k}"
                train_tokens += min(len(s), max_seq_len)
            out.append(s)
            ids.append(rid)
            if train_tokens >= tokens:
                break
        rep += 1
    return out, ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", help="TIDE config (for home and model)")
    parser.add_argument("--tokens", type=int, default=50_000, help="training tokens of logged data")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply --tokens (4: the memory-growth point)")
    parser.add_argument("--prompts", type=int, default=96, help="prompts to generate if nothing is cached")
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--device", default="cpu", choices=("auto", "cpu", "cuda"), help="train.device")
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="train.precision")
    parser.add_argument("--keep", help="keep the bench home here instead of a temporary folder")
    parser.add_argument("--json", help="write results here")
    args = parser.parse_args()
    args.tokens = int(args.tokens * args.scale)

    cfg = load_config(args.config)
    samples, source = source_samples(cfg, args.prompts)
    chosen, ids = repeated(samples, args.tokens, args.max_seq_len)
    home = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="tide-bench-retrain-"))
    try:
        shutil.copytree(static_drafter_path(cfg), cached_static_path(home), dirs_exist_ok=True)
        t0 = time.monotonic()
        # one request per second, so every request lies in the 1-hour default window
        for start in range(0, len(chosen), 256):
            part = chosen[start:start + 256]
            log_samples(home / "dataset", part, target_model_id=cfg.model.model_id,
                        aux_layer_ids=_aux_ids(cfg), start_s=time.time() - len(chosen) + start,
                        request_ids=ids[start:start + 256], first_offset=16 * start)
        log_s = time.monotonic() - t0
        config = {
            "home": str(home),
            "model": {"target": str(ensure_target_checkpoint(cfg.home_path, cfg.model.target)),
                      "model_id": cfg.model.model_id, "torch_threads": 1},
            "train": {"epochs": 1, "max_train_s": 3600.0, "max_train_tokens": args.tokens,
                      "max_seq_len": args.max_seq_len, "heldout_fraction": HELDOUT_FRACTION,
                      "heldout_max_samples": 32, "window_samples": 0, "window_s": 0.0,
                      "device": args.device, "precision": args.precision},
        }
        (home / "bench.yaml").write_text(yaml.safe_dump(config))
        result_path = home / "result.json"
        cmd = [sys.executable, "-m", "tide.cli", "train", "--online", "--config", str(home / "bench.yaml"),
               "--result-json", str(result_path)]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
        sampler = RssSampler(proc.pid)
        _, status, usage = os.wait4(proc.pid, 0)
        sampler.stop()
        wall_s = time.monotonic() - t0
        code = os.waitstatus_to_exitcode(status)
        result = json.loads(result_path.read_text()) if result_path.exists() else {}
    finally:
        if not args.keep:
            shutil.rmtree(home, ignore_errors=True)
    m = result.get("metrics", {})
    phases = {k.split(".", 1)[1]: v for k, v in m.items() if k.startswith("peak_rss_gib.")}
    # ru_maxrss is KiB on Linux; after the child's last reset it covers only its last interval
    rss_gib = max(usage.ru_maxrss / 1024**2, m.get("peak_rss_gib", 0.0), sampler.peak_gib)
    positions = m.get("recent_tokens", 0) + m.get("replay_tokens", 0)
    train_s = max(1e-9, m.get("train_wall_s", float("nan")))
    rows = [
        ("source states", source),
        ("logged requests / training positions", f"{len(chosen)} / {positions}"),
        ("exit code / status", f"{code} / {result.get('status')}"),
        ("retrain wall (s)", f"{wall_s:.1f}", "floor <= 600", "PASS" if wall_s <= FLOOR_WALL_S and code == 0 else "FAIL"),
        ("  of which training (s)", f"{m.get('train_wall_s', float('nan')):.1f}"),
        ("  of which held-out evaluation, both drafters (s)", f"{m.get('eval_s', float('nan')):.1f}"),
        ("  of which start-up + data load (s)", f"{m.get('load_s', float('nan')):.1f}"),
        ("training tokens/s (logged positions / training wall)", f"{positions / train_s:.1f}"),
        ("  loss-bearing tokens/s (generated positions only unless train_on_prompt)",
         f"{m.get('train_tokens_per_s', float('nan')):.1f}"),
        ("peak RSS (GiB)", f"{rss_gib:.2f}", "floor <= 4", "PASS" if rss_gib <= FLOOR_RSS_GIB else "FAIL"),
        ("  retrain's own / sampled every 20 ms / wait4 (GiB)",
         f"{m.get('peak_rss_gib', float('nan')):.2f} / {sampler.peak_gib:.2f} / {usage.ru_maxrss / 1024**2:.2f}"),
        *[(f"  peak in phase {name} (GiB)", f"{v:.2f}") for name, v in phases.items()],
        ("sim accept length champion -> candidate",
         f"{m.get('champion_sim_accept_length', float('nan')):.3f} -> {m.get('candidate_sim_accept_length', float('nan')):.3f}"),
        ("dataset logging (s, not part of the retrain)", f"{log_s:.1f}"),
    ]
    print_table(f"warm-start retrain on {args.tokens} tokens of logged data (1 torch thread, "
                f"train.device {args.device}, {args.precision})", rows)
    write_json(args.json, {"tokens": args.tokens, "wall_s": wall_s, "peak_rss_gib": rss_gib, "exit_code": code,
                           "phase_peak_rss_gib": phases, "sampled_peak_rss_gib": sampler.peak_gib,
                           "wait4_peak_rss_gib": usage.ru_maxrss / 1024**2,
                           "train_positions_per_s": positions / train_s,
                           "result": result, "floors": {"wall_s": FLOOR_WALL_S, "peak_rss_gib": FLOOR_RSS_GIB},
                           "pass": code == 0 and wall_s <= FLOOR_WALL_S and rss_gib <= FLOOR_RSS_GIB})
    return 0 if code == 0 else 1


class RssSampler:
    """The child's resident set every ``period_s`` from /proc/<pid>/status, in a thread."""

    def __init__(self, pid: int, period_s: float = 0.02) -> None:
        self.peak_gib = 0.0
        self._path, self._period_s, self._done = Path(f"/proc/{pid}/status"), period_s, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self._period_s):
            try:
                line = next(x for x in self._path.read_text().splitlines() if x.startswith("VmRSS:"))
            except (OSError, StopIteration):  # exited (or a zombie without a resident set)
                continue
            self.peak_gib = max(self.peak_gib, int(line.split()[1]) / 1024**2)

    def stop(self) -> None:
        self._done.set()
        self._thread.join()


def _aux_ids(cfg) -> tuple[int, ...]:
    from tide.models.llama import default_aux_layer_ids

    if cfg.model.aux_layer_ids:
        return tuple(cfg.model.aux_layer_ids)
    folder = ensure_target_checkpoint(cfg.home_path, cfg.model.target)
    return default_aux_layer_ids(json.loads((folder / "config.json").read_text())["num_hidden_layers"])


if __name__ == "__main__":
    sys.exit(main())
