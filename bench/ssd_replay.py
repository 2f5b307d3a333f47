"""The gate for speculative speculative decoding (SSD): an offline replay of verify outcomes.

SSD (Saguaro) drafts on separate hardware while the target verifies round T: it predicts the
verify outcome, the accepted count k and the bonus token t*, and pre-drafts for the likeliest
outcomes into a cache keyed by (k, t*); on a hit the next round's draft is ready at once, so the
round costs the verify alone. Is that worth building here? For held-out chat prompts, this replays
ordinary greedy speculative decoding with the real target and the shipped static drafter (the stop
rule at ``--stop-prob``, as the engine drafts) and, each round:
1. records the drafter's chain d1..dK, its top probability a_j per depth and its logits per depth
   (one depth more than drafted: the all-accepted outcome's bonus position);
2. predicts each outcome's probability P(k) = a_1..a_k x (1 - a_{k+1}) (P(K) = a_1..a_K) and spends
   ``--budget`` cached speculations (32) over the outcomes by a capped geometric series: the i-th
   likeliest k gets min(cap, F_0 r^i) of them, F_0 set so they sum to the budget;
3. a speculation for k is one of the drafter's top tokens at depth k+1 (less d_{k+1}, which a
   rejection rules out for k < K): a hit is the real (k, t*) among them.
It reports the hit rate and the predicted gain over ordinary speculative decoding from the measured
costs: a round costs draft D + verify V; SSD hides D on a hit, provided pre-drafting the budget's
speculations (P, timed: ``--budget`` rows drafted to the stop rule's depth in one batch) fits in V:
gain = (D + V) / (V + (1 - h) D + h max(0, P - V)) <= 1 + D / V. Optimistic: a pre-draft after a
hit has no target states for the new positions (the verify is still running), so its acceptance
can only be lower than a normal draft's; the replay counts it as equal. Intervals: 90% bootstrap
over prompts. The gate to build SSD: hit rate >= 0.5 and predicted gain >= 1.02.

    python -m bench.ssd_replay [--prompts 24] [--max-new-tokens 64] [--budget 32] [--json out.json]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch
import torch.nn.functional as F

from bench.report import print_table, write_json
from tide import workloads
from tide.config import load_config
from tide.drafter.artifact import TargetSpec, load_drafter
from tide.drafter.model import for_serving
from tide.drafter.static import static_drafter_path
from tide.engine.reference import load_target
from tide.spec.decode import RowInput, accept_greedy, prefill, verify
from tide.train.offline import render_prompt

GATE_HIT_RATE, GATE_GAIN = 0.5, 1.02


def fan_out(probs: list[float], budget: int, ratio: float = 0.5, cap: int = 16) -> dict[int, int]:
    """{k: speculations} for outcomes k ranked by probability: a capped geometric series summing to
    ``budget`` (the first F_0 found by search; what caps leave over goes down the ranking)."""
    order = sorted(range(len(probs)), key=lambda k: -probs[k])
    best: dict[int, int] = {}
    for f0 in range(1, budget + 1):
        out = {k: min(cap, max(1, int(f0 * ratio ** i))) for i, k in enumerate(order)}
        if sum(out.values()) > budget:
            break
        best = out
    left = budget - sum(best.values())
    for k in order:  # the remainder, to the likeliest outcomes under their cap
        add = min(left, cap - best.get(k, 0))
        best[k] = best.get(k, 0) + add
        left -= add
    return best


def outcome_probs(top: list[float]) -> list[float]:
    """P(k accepted) for k = 0..K from the drafter's per-depth top probabilities (independent)."""
    out, alive = [], 1.0
    for a in top:
        out.append(alive * (1 - a))
        alive *= a
    return out + [alive]


@torch.inference_mode()
def draft_chain(drafter, embed, cache, row: RowInput, gamma: int, stop_prob: float):
    """The engine's greedy draft for one row under the stop rule, with each depth's logits; then
    one depth more (untimed): the drafter's guess of the bonus token when every draft passes."""
    t0 = time.perf_counter()
    slots = torch.tensor([row.slot])
    positions = (row.feed_start + torch.arange(row.feed_tokens.numel()))[None]
    hidden = drafter.project(row.feed_aux[None])
    h = drafter.step(F.embedding(row.feed_tokens[None], embed), hidden, cache, slots, positions)[:, -1:]
    pos = positions[:, -1:]
    d2t = drafter.draft_to_target
    chain, top, logits_by_depth, hidden_by_depth = [], [], [], []
    for i in range(gamma):
        hidden_by_depth.append((h, pos))
        logits = drafter.logits(h)[0, 0].float()
        logits_by_depth.append(logits)
        p, choice = torch.softmax(logits, -1).max(-1)
        chain.append(int(d2t[choice]))
        top.append(float(p))
        if i + 1 == gamma or float(p) < stop_prob:
            break
        pos = pos + 1
        h = drafter.step(F.embedding(torch.tensor([[chain[-1]]]), embed), h, cache, slots, pos)
    draft_s = time.perf_counter() - t0  # the chain as the engine drafts it; the next depth is the guess
    h = drafter.step(F.embedding(torch.tensor([[chain[-1]]]), embed), h, cache, slots, pos + 1)
    hidden_by_depth.append((h, pos + 1))
    logits_by_depth.append(drafter.logits(h)[0, 0].float())
    return chain, top, logits_by_depth, hidden_by_depth, draft_s


@torch.inference_mode()
def predraft(drafter, embed, cache, slot: int, state, bonus: int, gamma: int, stop_prob: float) -> list[int]:
    """SSD's pre-draft for outcome (k, bonus): the drafter goes on from its own hidden state at depth
    k + 1 (the verify's target states for the accepted positions are not there yet), the bonus
    token fed, then greedy under the stop rule. It writes keys past the accepted positions only,
    which the next round's feed and drafts rewrite before anything attends to them."""
    h, pos = state
    slots, d2t, out = torch.tensor([slot]), drafter.draft_to_target, []
    token = bonus
    for _ in range(gamma):
        pos = pos + 1
        h = drafter.step(F.embedding(torch.tensor([[token]]), embed), h, cache, slots, pos)
        p, choice = torch.softmax(drafter.logits(h)[0, 0].float(), -1).max(-1)
        token = int(d2t[choice])
        out.append(token)
        if float(p) < stop_prob:
            break
    return out


def candidates(logits: torch.Tensor, d2t: torch.Tensor, n: int, exclude: int | None) -> set[int]:
    ids = d2t[torch.topk(logits, min(n + 1, logits.numel())).indices].tolist()
    return set([t for t in ids if t != exclude][:n])


@torch.inference_mode()
def predraft_s(drafter, embed, budget: int, depth: int, context: int, reps: int = 5) -> float:
    """Seconds to pre-draft ``budget`` speculations ``depth`` deep in one batch (median of reps)."""
    cache = drafter.new_cache(budget, context + depth + 4)
    slots, times = torch.arange(budget), []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        h = drafter.project(torch.zeros(budget, 1, 3 * embed.shape[1]))
        tok = torch.zeros(budget, 1, dtype=torch.long)
        for d in range(depth):
            pos = torch.full((budget, 1), context + d)
            h = drafter.step(F.embedding(tok, embed), h, cache, slots, pos)
            tok = drafter.draft_to_target[drafter.logits(h)[:, 0].argmax(-1)][:, None]
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[reps // 2]


def replay_prompt(target, drafter, ids: list[int], n: int, gamma: int, stop_prob: float, budget: int) -> dict:
    embed, d2t = target.embed_weight, drafter.draft_to_target
    max_len = len(ids) + n + gamma + 4
    tcache, dcache = target.new_cache(1, max_len), drafter.new_cache(1, max_len)
    out = prefill(target, tcache, 0, ids)
    first = int(out.logits[0, -1].argmax())
    row = RowInput(slot=0, t_len=len(ids), pending=first, feed_start=0,
                   feed_tokens=torch.tensor(ids[1:] + [first]), feed_aux=out.aux_hidden[0])
    made, rounds, hits, draft_s, verify_s, by_k = 1, 0, 0, 0.0, 0.0, {}
    pre, accepted, output = [], [], [first]  # (output index a pre-draft starts at, its tokens); (index, k)
    while made < n:
        chain, top, logits, hidden, d_s = draft_chain(drafter, embed, dcache, row, gamma, stop_prob)
        t0 = time.perf_counter()
        fed, res = verify(target, tcache, [row], torch.tensor([chain]))
        k, bonus = accept_greedy(torch.tensor(chain), res.logits[0])
        verify_s += time.perf_counter() - t0
        draft_s += d_s
        spend = fan_out(outcome_probs(top), budget)
        cached = candidates(logits[k], d2t, spend.get(k, 0), chain[k] if k < len(chain) else None)
        hit = bonus in cached
        hits += hit
        if hit:  # its pre-draft, judged against the target's own continuation once the prompt is done
            pre.append((made + k + 1, predraft(drafter, embed, dcache, 0, hidden[k], bonus, gamma, stop_prob)))
        accepted.append((made, k))
        rounds += 1
        by_k.setdefault(k, [0, 0])[0] += 1
        by_k[k][1] += hit
        committed = chain[:k] + [bonus]
        output += committed
        made += len(committed)
        row.feed_start, row.t_len = row.t_len, row.t_len + len(committed)
        row.pending, row.feed_tokens, row.feed_aux = bonus, torch.tensor(committed), res.aux_hidden[0, :k + 1]
    # a hit's next round starts at its pre-draft's index: what that round accepted of the normal
    # draft (target states fed) against what it would have accepted of the pre-draft
    normal = dict(accepted)
    pairs = [(normal[i], _prefix(d, output[i:])) for i, d in pre if i in normal]
    return {"rounds": rounds, "hits": hits, "draft_s": draft_s, "verify_s": verify_s, "by_k": by_k,
            "hit_rounds_normal_accepted": sum(a for a, _ in pairs), "hit_rounds_predraft_accepted": sum(b for _, b in pairs),
            "hit_rounds_paired": len(pairs), "tokens": made - 1}


def _prefix(draft: list[int], truth: list[int]) -> int:
    n = 0
    for d, t in zip(draft, truth):
        if d != t:
            break
        n += 1
    return n


def gain(hit: float, d: float, v: float, p: float) -> float:
    return (d + v) / (v + (1 - hit) * d + hit * max(0.0, p - v))


def gain_with_predraft_acceptance(per: list[dict], p: float) -> float:
    """tok/s of SSD over speculative decoding when a hit's next round accepts what its pre-draft
    would have (measured), not what the normal draft did: tokens per second both ways."""
    rounds = sum(x["rounds"] for x in per)
    hits = sum(x["hits"] for x in per)
    d, v = sum(x["draft_s"] for x in per) / rounds, sum(x["verify_s"] for x in per) / rounds
    tokens = sum(x["tokens"] for x in per)
    paired = sum(x["hit_rounds_paired"] for x in per)
    lost = sum(x["hit_rounds_normal_accepted"] - x["hit_rounds_predraft_accepted"] for x in per)
    lost *= hits / max(1, paired)  # hits at a prompt's last round have no next round to pair
    ssd_s = rounds * v + (rounds - hits) * d + hits * max(0.0, p - v)
    return ((tokens - lost) / ssd_s) / (tokens / (rounds * (d + v)))


def interval(per: list[dict], fn, draws: int = 2000, level: float = 0.9) -> tuple[float, float]:
    rng, vals = random.Random(0), []
    for _ in range(draws):
        pick = [per[rng.randrange(len(per))] for _ in per]
        vals.append(fn(pick))
    vals.sort()
    tail = (1 - level) / 2
    return vals[round(tail * (draws - 1))], vals[round((1 - tail) * (draws - 1))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--budget", type=int, default=32, help="cached speculations per round")
    ap.add_argument("--stop-prob", type=float, default=None, help="default: config spec.draft_stop_prob")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    cfg = load_config(overrides={"model": {"torch_threads": 1}})
    gamma, stop = cfg.spec.draft_len, cfg.spec.draft_stop_prob if args.stop_prob is None else args.stop_prob
    target, tok, _ = load_target(cfg)
    spec = TargetSpec(target.shape.hidden_size, target.shape.vocab_size, target.aux_layer_ids)
    drafter = for_serving(load_drafter(static_drafter_path(cfg), spec))
    held = workloads.load_workload(args.workload, "heldout", args.prompts, seed=1)
    prompts = [render_prompt(tok, p.chat_messages(), 256) for p in held]
    per = [replay_prompt(target, drafter, ids, args.max_new_tokens, gamma, stop, args.budget) for ids in prompts]
    context = sum(len(p) for p in prompts) // len(prompts) + args.max_new_tokens // 2
    p_s = predraft_s(drafter, target.embed_weight, args.budget, gamma, context)

    def totals(ps):
        r = sum(x["rounds"] for x in ps)
        return (sum(x["hits"] for x in ps) / r, sum(x["draft_s"] for x in ps) / r, sum(x["verify_s"] for x in ps) / r)

    hit, d, v = totals(per)
    g = gain(hit, d, v, p_s)
    hit_lo, hit_hi = interval(per, lambda ps: totals(ps)[0])
    g_lo, g_hi = interval(per, lambda ps: gain(*totals(ps), p_s))
    real = gain_with_predraft_acceptance(per, p_s)
    r_lo, r_hi = interval(per, lambda ps: gain_with_predraft_acceptance(ps, p_s))
    paired = sum(x["hit_rounds_paired"] for x in per)
    acc_normal = sum(x["hit_rounds_normal_accepted"] for x in per) / max(1, paired)
    acc_pre = sum(x["hit_rounds_predraft_accepted"] for x in per) / max(1, paired)
    by_k: dict[int, list[int]] = {}
    for x in per:
        for k, (n, h) in x["by_k"].items():
            by_k.setdefault(k, [0, 0])
            by_k[k] = [by_k[k][0] + n, by_k[k][1] + h]
    build = hit >= GATE_HIT_RATE and min(g, real) >= GATE_GAIN
    summary = {"workload": args.workload, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
               "budget": args.budget, "gamma": gamma, "stop_prob": stop, "rounds": sum(x["rounds"] for x in per),
               "hit_rate": hit, "hit_rate_interval_90": [hit_lo, hit_hi], "draft_ms": d * 1e3, "verify_ms": v * 1e3,
               "predraft_ms": p_s * 1e3, "predicted_gain": g, "predicted_gain_interval_90": [g_lo, g_hi],
               "gain_bound": 1 + d / v, "gain_with_predraft_acceptance": real,
               "gain_with_predraft_acceptance_interval_90": [r_lo, r_hi],
               "after_a_hit_accepted_normal_draft": acc_normal, "after_a_hit_accepted_predraft": acc_pre, "by_k": {k: {"rounds": n, "hit_rate": h / n} for k, (n, h) in sorted(by_k.items())},
               "build_ssd": build}
    rows = [("metric", "value"), ("prompts (held-out) x tokens", f"{len(prompts)} x {args.max_new_tokens}"),
            ("rounds", summary["rounds"]), ("cached speculations per round", args.budget),
            ("hit rate", f"{hit:.3f} (90% {hit_lo:.3f}-{hit_hi:.3f})"),
            ("hit rate by accepted k", " ".join(f"k={k}: {h / n:.2f} ({n})" for k, (n, h) in sorted(by_k.items()))),
            ("a round: draft + verify (ms)", f"{d * 1e3:.2f} + {v * 1e3:.2f}"),
            (f"pre-draft of {args.budget} speculations x {gamma} deep (ms)", f"{p_s * 1e3:.2f}"),
            ("predicted gain over speculative decoding", f"{g:.4f}x (90% {g_lo:.4f}-{g_hi:.4f})"),
            ("bound 1 + draft / verify", f"{1 + d / v:.4f}x"),
            ("after a hit, drafts accepted: normal draft / pre-draft", f"{acc_normal:.3f} / {acc_pre:.3f} ({paired})"),
            ("predicted gain with the pre-drafts' own acceptance", f"{real:.4f}x (90% {r_lo:.4f}-{r_hi:.4f})"),
            ("gate (hit >= 0.5 and both gains >= 1.02)", "build SSD" if build else "do not build SSD")]
    print_table(f"SSD replay ({args.workload}, {args.max_new_tokens} new tokens/prompt)", rows)
    write_json(args.json, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
