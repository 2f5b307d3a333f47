"""StarSD scaling: N replay clients against one drafter service, N = 1..32.

StarSD's model: a target's round is its verify V plus the drafter's service time S(d); one drafter
keeps up with about N* = 1 + V / S(d) targets, past which targets only queue (round time
N x S(d)). This bench measures it on the service (``python -m tide.services.drafter``, shipped
static drafter, the one-host transport):
1. capture: the real target decodes a held-out chat prompt greedily; its aux states and tokens are
   what clients send; V is the target's measured verify forward (one row, pending + 2 drafts);
2. for each N, N client processes (no model: numpy and ZeroMQ) replay a request each: a round
   sends the next positions' states (2 per round, the committed tokens of a typical step; the
   prompt on a session's first round), waits for the drafts, then sleeps V (the verify it stands
   in for); every client starts at the same moment and runs ``--duration`` seconds;
3. per N: rounds per second over all clients, each round's latency (send to drafts) percentiles,
   and the service's utilisation, three ways from /health: the share of the window it drafts, the
   share its loop is busy (anything but waiting with nothing queued: a work-conserving loop's
   figure), and its process CPU seconds over the window (preemption by the clients shows there).
The model's N* uses S(d) measured at N = 1 (the service's drafting seconds per request). The
measured saturation point is where the measured throughput's ceiling meets the N = 1 per-client
rate (N_sat = X_max x round time at N = 1); batching across clients lowers S(d) as N grows, so
the measured point may lie past the model's. A plot goes to ``--plot`` (docs/img/starsd-scaling.png).

    python -m bench.starsd_scaling [--clients 1,2,4,8,16,32] [--duration 8] [--json out.json] [--plot PNG]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from bench.report import print_table, write_json

GAMMA, STOP, STEP_POSITIONS = 4, 0.3, 2


def capture(path: Path, tokens_out: int) -> tuple[float, int]:
    """Write the states clients replay; return (verify seconds, prompt length)."""
    import torch

    from tide import workloads
    from tide.config import load_config
    from tide.engine.reference import load_target
    from tide.spec.decode import RowInput, prefill, target_step
    from tide.train.offline import render_prompt

    cfg = load_config(overrides={"model": {"torch_threads": 1}})
    target, tok, _ = load_target(cfg)
    prompt = render_prompt(tok, workloads.load_workload("chat", "heldout", 1, seed=1)[0].chat_messages(), 256)
    cache = target.new_cache(1, len(prompt) + tokens_out + 8)
    out = prefill(target, cache, 0, prompt)
    tokens, aux = list(prompt) + [int(out.logits[0, -1].argmax())], [out.aux_hidden[0]]
    row = RowInput(slot=0, t_len=len(prompt), pending=tokens[-1], feed_start=0, feed_tokens=torch.empty(0),
                   feed_aux=torch.empty(0))
    for _ in range(tokens_out):
        (res,) = target_step(target, cache, [row])
        aux.append(res.aux_hidden)
        tokens += res.committed
        row.t_len, row.pending = row.t_len + 1, res.committed[-1]
    np.savez(path, tokens=np.array(tokens, dtype=np.int64), aux=torch.cat(aux).float().numpy())
    times = []
    fed, start = torch.zeros(1, 3, dtype=torch.long), torch.tensor([len(prompt)])
    for _ in range(9):
        t0 = time.perf_counter()
        target.forward(fed, start, cache, torch.tensor([0]))
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[4], len(prompt)


def client(args) -> None:
    """One replay client: rounds until the window ends; prints its rounds and latencies (JSON)."""
    from tide.drafting import wire
    from tide.drafting.transport import EngineLink

    data = np.load(args.states)
    tokens, aux = data["tokens"], data["aux"]
    link = EngineLink(args.url)
    welcomed = False
    while not welcomed:  # a hello sent before the connection is made is lost: say it again
        link.send({"op": wire.HELLO, "engine": f"replay-{args.seed}", "shm": link.ring_name})
        msg = link.recv(0.2)
        welcomed = msg is not None and msg[0]["op"] == wire.WELCOME
    time.sleep(max(0.0, args.start_at - time.time()))
    end, latencies, session, seq = args.start_at + args.duration, [], 0, 0
    feed_start, t_len = 0, args.prompt_len
    while time.time() < end:
        if t_len + STEP_POSITIONS + GAMMA + 2 > len(aux):  # the replay ends: the next request
            session, feed_start, t_len = session + 1, 0, args.prompt_len
        seq += 1
        row = {"id": f"s{session}", "t_len": t_len, "pending": int(tokens[t_len]), "feed_start": feed_start,
               "first_pos": 0, "n_feed": t_len - feed_start, "temperature": 0.0, "seed": -1}
        t0 = time.perf_counter()
        link.send({"op": wire.DRAFT, "engine": f"replay-{args.seed}", "seq": seq, "gamma": GAMMA, "stop_prob": STOP,
                   "rows": [row]}, {"tokens": tokens[feed_start + 1:t_len + 1], "aux": aux[feed_start:t_len]})
        while True:
            msg = link.recv(30.0)
            if msg is None or (msg[0].get("seq") == seq and msg[0]["op"] in (wire.DRAFTS, wire.ERROR)):
                break
        latencies.append(time.perf_counter() - t0)
        time.sleep(args.verify_s)  # the verify this round stands in for
        feed_start, t_len = t_len, t_len + STEP_POSITIONS
    link.close()
    print(json.dumps({"rounds": len(latencies), "latencies": latencies}))


def health(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=10) as r:
        return json.loads(r.read())


def run_n(n: int, url: str, states: Path, verify_s: float, prompt_len: int, duration: float, port: int) -> dict:
    start_at = time.time() + 4.0 + 0.25 * n  # every client connected and waiting by then
    procs = [subprocess.Popen([sys.executable, "-m", "bench.starsd_scaling", "--client", "--url", url, "--states",
                               str(states), "--verify-s", str(verify_s), "--prompt-len", str(prompt_len),
                               "--duration", str(duration), "--start-at", str(start_at), "--seed", str(i)],
                              stdout=subprocess.PIPE, text=True) for i in range(n)]
    time.sleep(max(0.0, start_at - time.time()))
    h0, t0 = health(port), time.monotonic()
    time.sleep(duration)
    h1, t1 = health(port), time.monotonic()
    results = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    lat = np.array([x for r in results for x in r["latencies"]])
    rounds = sum(r["rounds"] for r in results)
    return {"clients": n, "rounds_per_s": rounds / duration, "rounds": rounds,
            "utilisation": (h1["busy_s"] - h0["busy_s"]) / (t1 - t0),
            "loop_busy": 1.0 - (h1["idle_s"] - h0["idle_s"]) / (t1 - t0),
            "service_cpu": (h1["cpu_s"] - h0["cpu_s"]) / (t1 - t0),
            "drafting_s_per_round": (h1["busy_s"] - h0["busy_s"]) / max(1, rounds),
            "latency_ms": {f"p{q}": float(np.percentile(lat, q) * 1e3) for q in (50, 90, 99)} if len(lat) else {}}


def plot(rows: list[dict], model_n: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = [r["clients"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(ns, [r["rounds_per_s"] for r in rows], marker="o", label="measured rounds/s")
    per = rows[0]["rounds_per_s"]
    a.plot(ns, [min(n * per, model_n * per) for n in ns], ls="--", label=f"model (N* = {model_n:.1f})")
    a2 = a.twinx()
    a2.plot(ns, [r["utilisation"] for r in rows], color="gray", marker=".", label="share of time drafting")
    a2.plot(ns, [r["loop_busy"] for r in rows], color="black", marker="x", ls=":", label="loop busy")
    a2.set_ylim(0, 1.05)
    a.set_xlabel("replay clients (targets)")
    a.set_ylabel("rounds / s (all clients)")
    a.legend(loc="upper left")
    a2.legend(loc="lower right")
    for q in ("p50", "p90", "p99"):
        b.plot(ns, [r["latency_ms"].get(q) for r in rows], marker="o", label=q)
    b.set_xlabel("replay clients (targets)")
    b.set_ylabel("draft latency per round (ms)")
    b.legend()
    fig.suptitle("StarSD: one drafter service, N targets")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1,2,4,8,12,16,24,32")
    ap.add_argument("--duration", type=float, default=8.0)
    ap.add_argument("--tokens", type=int, default=96, help="positions each replay decodes")
    ap.add_argument("--metrics-port", type=int, default=9124)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default="docs/img/starsd-scaling.png")
    for flag, kind in (("--url", str), ("--states", str), ("--verify-s", float), ("--prompt-len", int),
                       ("--start-at", float), ("--seed", int)):
        ap.add_argument(flag, type=kind, help=argparse.SUPPRESS)
    ap.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.client:
        client(args)
        return 0
    work = Path(tempfile.mkdtemp())
    states = work / "states.npz"
    verify_s, prompt_len = capture(states, args.tokens)
    sock = work / "drafter.sock"
    env = {**os.environ, "TIDE_OPS__FOLLOW_REGISTRY": "false"}
    service = subprocess.Popen([sys.executable, "-m", "tide.services.drafter", "--port", "0", "--ipc-path", str(sock),
                                "--metrics-port", str(args.metrics_port), "--log-level", "WARNING"], env=env)
    try:
        deadline = time.time() + 300
        while True:
            try:
                health(args.metrics_port)
                break
            except OSError:
                if time.time() > deadline or service.poll() is not None:
                    raise SystemExit("the drafter service did not start")
                time.sleep(1)
        rows = [run_n(n, f"ipc://{sock}", states, verify_s, prompt_len, args.duration, args.metrics_port)
                for n in [int(x) for x in args.clients.split(",")]]
    finally:
        service.terminate()
        service.wait(timeout=30)
    s_d = rows[0]["drafting_s_per_round"]
    model_n = 1 + verify_s / s_d
    x_max = max(r["rounds_per_s"] for r in rows)
    round_1 = rows[0]["clients"] / rows[0]["rounds_per_s"]
    measured_n = x_max * round_1
    first_95 = next(r["clients"] for r in rows if r["rounds_per_s"] >= 0.95 * x_max)
    at_sat = min(rows, key=lambda r: abs(r["clients"] - measured_n))
    summary = {"verify_ms": verify_s * 1e3, "service_ms_per_request_at_1": s_d * 1e3, "model_saturation": model_n,
               "measured_saturation": measured_n, "first_n_at_95pct_of_max": first_95, "max_rounds_per_s": x_max,
               "utilisation_at_saturation": at_sat["utilisation"], "loop_busy_at_saturation": at_sat["loop_busy"],
               "service_cpu_at_saturation": at_sat["service_cpu"], "rows": rows}
    table = [("clients", "rounds/s", "drafting", "loop busy", "service CPU", "drafting ms/round", "latency p50/p90/p99 ms")]
    table += [(r["clients"], f"{r['rounds_per_s']:.1f}", f"{r['utilisation']:.2f}", f"{r['loop_busy']:.2f}",
               f"{r['service_cpu']:.2f}", f"{r['drafting_s_per_round'] * 1e3:.2f}",
               "/".join(f"{r['latency_ms'][q]:.1f}" for q in ("p50", "p90", "p99"))) for r in rows]
    print_table("StarSD scaling: replay clients against one drafter service", table)
    print(f"\nverify {verify_s * 1e3:.1f} ms, S(d) at N=1 {s_d * 1e3:.2f} ms: model N* = {model_n:.1f}; measured "
          f"N_sat = {measured_n:.1f} (first N at 95% of the ceiling: {first_95}); there the service drafts "
          f"{at_sat['utilisation']:.2f} of the time, its loop is busy (not waiting for work) "
          f"{at_sat['loop_busy']:.2f}, and it uses {at_sat['service_cpu']:.2f} of a core")
    if args.plot:
        plot(rows, model_n, Path(args.plot))
        print(f"plot: {args.plot}")
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
