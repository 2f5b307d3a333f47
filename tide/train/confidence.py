"""Training and calibrating the draft confidence head (``tide/drafter/confidence.py``).

1. ``collect`` unrolls a trained drafter over samples (teacher forcing, exactly the chain that
   ``simulated_acceptance`` scores) and keeps, per draft depth k, the features and the label
   "draft k equals the target's argmax"; ``alive`` marks rows whose drafts 0..k-1 all survived;
2. ``fit_head`` trains w, b with a BCE loss (L2-regularised logistic regression: convex, so
   L-BFGS gives the same answer every run) on every reached row; ``alive_only`` fits only the
   rows whose chain survived so far (the event the head's output is conditioned on): on held-out
   chat it calibrated no better after scaling (docs/benchmarks.md), so it is not the default;
3. ``fit_temperatures`` is sequential temperature scaling: depth by depth, one temperature T_k on
   the held-out rows that reached depth k, so ``σ(z_k / T_k)`` is P(survive k | survived < k) and
   the product over depths is the chain's survival, what a draft-length scheduler needs;
4. ``calibration_error`` is the expected calibration error (ECE, equal-width bins) over the
   alive rows of every depth; ``fit_confidence`` records it on the head (``heldout_ece``), which
   serving checks before it uses the head (tide/drafter/confidence.py ``serving_head``).
Cheap by design: one teacher-forced unroll of the drafter over at most ``max_rows`` rows per
split, then a convex fit of 2H+1 weights (seconds to a few minutes on a CPU).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tide.drafter.confidence import Confidence, ConfidenceHead, features, frozen
from tide.drafter.model import Eagle3Drafter
from tide.train.objective import needed_rows, unroll
from tide.train.trainer import Sample, collate, make_batches, prepare

ECE_BINS = 15
log = logging.getLogger(__name__)


@dataclass
class Features:
    """One row per (position, depth) a chain reached or could have reached under teacher forcing."""

    x: torch.Tensor  # [n, 2H+1] float32: norm(h_k), norm(e(x_k)), log q_top
    depth: torch.Tensor  # [n] int64
    label: torch.Tensor  # [n] bool: draft k == target argmax
    alive: torch.Tensor  # [n] bool: drafts 0..k-1 all survived
    group: torch.Tensor  # [n] int64: which sequence (for intervals over requests)

    def __len__(self) -> int:
        return len(self.depth)

    def take(self, idx: torch.Tensor) -> "Features":
        return Features(self.x[idx], self.depth[idx], self.label[idx], self.alive[idx], self.group[idx])

    @staticmethod
    def cat(parts: list["Features"]) -> "Features":
        return Features(*(torch.cat([getattr(p, f) for p in parts]) for f in ("x", "depth", "label", "alive", "group")))


@torch.no_grad()
def collect(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head_weight: torch.Tensor, batches,
            depth: int, keep: float = 1.0, seed: int = 0) -> Features:
    """Features and labels of every generated position's chain, ``depth`` drafts deep; ``keep`` < 1
    keeps that random share of rows (a row is 2H+1 floats: the window's positions x depth would
    otherwise set the retrain's memory)."""
    g = torch.Generator().manual_seed(seed)
    parts = []
    first_row = 0
    for batch in batches:
        rows = needed_rows(batch.loss_mask, 1)
        chain = rows.at(batch.loss_mask, 0) > 0
        for step, hidden, _ in unroll(drafter, embed, batch, depth, logits=False, rows=rows):
            logits = drafter.logits(hidden)
            valid = (rows.at(batch.loss_mask, step) > 0) & (rows.at(batch.loss_mask, 0) > 0)
            if batch.target_top is not None:
                top = rows.at(batch.target_top, step)
            else:
                top = F.linear(rows.at(batch.final, step).float(), lm_head_weight.float()).argmax(-1)
            label = drafter.draft_to_target[logits.argmax(-1)] == top
            fed = F.embedding(rows.at(batch.tokens, step), embed)
            x = features(hidden, fed, logits, drafter.shape.rms_norm_eps)
            valid = valid & (torch.rand(valid.shape, generator=g) < keep)
            parts.append(Features(x[valid], torch.full((int(valid.sum()),), step), label[valid], chain[valid],
                                  first_row + rows.b[valid]))
            chain = chain & label & valid
        first_row += batch.tokens.shape[0]
    if not parts:
        none = torch.zeros(0, dtype=torch.bool)
        return Features(torch.zeros(0, 2 * drafter.shape.hidden_size + 1), none.long(), none, none, none.long())
    return Features.cat(parts)


def fit_head(head: ConfidenceHead, data: Features, l2: float = 1e-3, iters: int = 100,
             alive_only: bool = False) -> float:
    """Logistic regression of survival on the features; returns the final mean BCE."""
    if alive_only:
        data = data.take(data.alive.nonzero().flatten())
    y = data.label.float()
    opt = torch.optim.LBFGS(head.proj.parameters(), lr=1.0, max_iter=iters, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = F.binary_cross_entropy_with_logits(head.logit(data.x), y) + l2 * head.proj.weight.square().sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return float(F.binary_cross_entropy_with_logits(head.logit(data.x), y))


def _best_temperature(z: torch.Tensor, y: torch.Tensor, lo: float = -3.0, hi: float = 3.0, iters: int = 60) -> float:
    """argmin over T of BCE(σ(z/T), y), golden-section search on log T (BCE is unimodal in it)."""
    def nll(log_t: float) -> float:
        return float(F.binary_cross_entropy_with_logits(z / (2.718281828 ** log_t), y))

    g = 0.6180339887
    a, b = lo, hi
    c, d = b - g * (b - a), a + g * (b - a)
    for _ in range(iters):
        if nll(c) < nll(d):
            b = d
        else:
            a = c
        c, d = b - g * (b - a), a + g * (b - a)
    return float(2.718281828 ** ((a + b) / 2))


@torch.no_grad()
def fit_temperatures(head: ConfidenceHead, data: Features) -> list[float]:
    """Sequential temperature scaling: T_k on the rows that reached depth k (drafts < k survived)."""
    z = head.logit(data.x)
    temps = []
    for k in range(len(head.temperature)):
        sel = (data.depth == k) & data.alive
        temps.append(_best_temperature(z[sel], data.label[sel].float()) if int(sel.sum()) >= 20 else 1.0)
    head.temperature.copy_(torch.tensor(temps))
    return temps


def calibration_error(p: torch.Tensor, y: torch.Tensor, bins: int = ECE_BINS) -> float:
    """ECE: sum over equal-width bins of (bin share) * |mean label - mean confidence|."""
    if len(p) == 0:
        return 0.0
    idx = (p * bins).long().clamp(max=bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        if n:
            total += n / len(p) * abs(float(y[sel].float().mean()) - float(p[sel].mean()))
    return total


@torch.no_grad()
def alive_ece(head: ConfidenceHead, data: Features, raw: bool = False) -> float:
    """ECE of the survival probabilities over the rows a chain reached (what a scheduler sees);
    ``raw``: of the uncalibrated head (temperature 1)."""
    sel = data.alive
    x, depth = data.x[sel], data.depth[sel]
    p = torch.sigmoid(head.logit(x)) if raw else head.survival(x, depth)
    return calibration_error(p, data.label[sel])


@torch.no_grad()
def top_prob_ece(data: Features) -> float:
    """ECE of the raw draft top probability used as a survival estimate (today's stop rule)."""
    sel = data.alive
    return calibration_error(data.x[sel, -1].exp(), data.label[sel])


def _features_of(drafter, embed, lm_head, samples: list[Sample], depth: int, max_rows: int,
                 batch_tokens: int, max_len: int, seed: int) -> Features:
    prepare(samples, drafter, lm_head)
    rows = depth * sum(int((s.loss_mask > 0).sum()) for s in samples)
    keep = min(1.0, max_rows / max(1, rows))
    batches = (collate(group, max_len) for group in make_batches(samples, batch_tokens, max_len))
    return collect(drafter, embed, lm_head, batches, depth, keep, seed)


def fit_confidence(drafter: Eagle3Drafter, embed: torch.Tensor, lm_head: torch.Tensor, train: list[Sample],
                   heldout: list[Sample], depth: int, max_rows: int = 32768, batch_tokens: int = 4096,
                   max_len: int = 1024, seed: int = 0) -> tuple[ConfidenceHead, dict]:
    """Train the head on ``train``, fit its temperatures on half of ``heldout`` (every other
    sample) and report ECE on the other half: raw top probability, raw head, scaled head."""
    torch.manual_seed(seed)
    head = ConfidenceHead(drafter.shape.hidden_size, depth)
    fit_data = _features_of(drafter, embed, lm_head, train, depth, max_rows, batch_tokens, max_len, seed)
    bce = fit_head(head, fit_data)
    del fit_data
    calib = _features_of(drafter, embed, lm_head, heldout[0::2], depth, max_rows, batch_tokens, max_len, seed)
    test = _features_of(drafter, embed, lm_head, heldout[1::2], depth, max_rows, batch_tokens, max_len, seed)
    raw = alive_ece(head, test, raw=True)
    temps = fit_temperatures(head, calib)
    report = {"ece_top_prob": top_prob_ece(test), "ece_raw": raw, "ece": alive_ece(head, test),
              "temperatures": temps, "train_bce": bce, "calib_rows": int(calib.alive.sum()),
              "test_rows": int(test.alive.sum())}
    head.heldout_ece = report["ece"]
    return head.eval().requires_grad_(False), report


def fit_for_retrain(cfg, candidate: Eagle3Drafter, target, data) -> tuple[Confidence | None, dict]:
    """A retrain's candidate head (frozen, its held-out ECE recorded) and its calibration metrics;
    none unless ``train.confidence_head`` (a head inherited from the parent was fitted to other
    weights, so it is dropped either way). A head whose ECE exceeds the serving bar is still
    registered: the engine serves that version on its top-probability chain and says so."""
    if not cfg.train.confidence_head:
        return None, {}
    tc = cfg.train
    head, report = fit_confidence(candidate, target.embed_weight, target.lm_head_weight, data.train, data.heldout,
                                  depth=cfg.spec.draft_len, batch_tokens=tc.batch_tokens, max_len=tc.max_seq_len,
                                  seed=tc.seed)
    log.info("retrain: confidence head ECE %.4f (raw %.4f, top probability %.4f)",
             report["ece"], report["ece_raw"], report["ece_top_prob"])
    return frozen(head), {f"confidence_{k}": v for k, v in report.items() if k != "temperatures"}
