"""The confidence head's pieces: ECE, temperature scaling, and labels that are the chain
``simulated_acceptance`` scores."""
import torch

from tide.drafter.confidence import ConfidenceHead
from tide.train.confidence import (
    Features,
    _best_temperature,
    alive_ece,
    calibration_error,
    collect,
    fit_head,
    fit_temperatures,
)
from tide.train.objective import Batch, simulated_acceptance


def _synthetic(n, dim=5, scale=1.0, seed=0):
    """Features whose true survival probability is σ(w·x), with ``alive`` on a random 70%."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    w = torch.linspace(-1.0, 1.5, dim)
    p = torch.sigmoid(x @ w * scale)
    label = torch.rand(n, generator=g) < p
    depth = torch.randint(0, 3, (n,), generator=g)
    return Features(x, depth, label, torch.rand(n, generator=g) < 0.7, torch.arange(n)), p


def test_ece_is_zero_for_calibrated_bins_and_large_for_overconfident():
    p = torch.tensor([0.25] * 4 + [0.75] * 4)
    y = torch.tensor([1, 0, 0, 0, 1, 1, 1, 0], dtype=torch.bool)
    assert calibration_error(p, y) < 1e-9
    assert abs(calibration_error(torch.full((4,), 0.95), torch.tensor([1, 0, 0, 1], dtype=torch.bool)) - 0.45) < 1e-6


def test_temperature_search_recovers_a_known_temperature():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(20000, generator=g) * 4
    y = (torch.rand(20000, generator=g) < torch.sigmoid(z / 2.5)).float()
    assert abs(_best_temperature(z, y) - 2.5) < 0.15


def test_sequential_scaling_fixes_an_overconfident_head():
    data, _ = _synthetic(20000, scale=1.0)
    head = ConfidenceHead(2, depth=3)  # 2*2+1 = 5 inputs
    fit_head(head, data.take(torch.arange(10000)))
    with torch.no_grad():
        head.proj.weight.mul_(3.0)  # make it overconfident on purpose
        head.proj.bias.mul_(3.0)
    held = data.take(torch.arange(10000, 20000))
    calib, test = held.take(torch.arange(5000)), held.take(torch.arange(5000, 10000))
    before = alive_ece(head, test, raw=True)
    temps = fit_temperatures(head, calib)
    after = alive_ece(head, test)
    assert before > 0.08 and after < 0.03, (before, after)
    assert all(2.4 < t < 3.6 for t in temps), temps


def test_alive_only_fit_is_calibrated_where_dead_rows_are_harder():
    # rows whose chain broke are harder than their features say: a head fitted on every row is
    # then under-confident exactly where a scheduler reads it
    data, p = _synthetic(20000)
    harder = torch.rand(len(data), generator=torch.Generator().manual_seed(1)) < 0.5
    data.label &= data.alive | harder
    alive = data.take(data.alive.nonzero().flatten())
    fitted, biased = ConfidenceHead(2, depth=3), ConfidenceHead(2, depth=3)
    fit_head(fitted, data, alive_only=True)
    fit_head(biased, data)
    assert alive_ece(fitted, alive, raw=True) < 0.03 < alive_ece(biased, alive, raw=True)


def test_collected_labels_are_the_simulated_acceptance_chain(tiny_target, tiny_drafter):
    g = torch.Generator().manual_seed(0)
    b, t, h = 2, 20, tiny_target.shape.hidden_size
    final = torch.randn(b, t, h, generator=g)
    top = torch.nn.functional.linear(final, tiny_target.lm_head_weight).argmax(-1)
    # the generated tokens are the target's argmax, so some drafts survive more than one depth
    tokens = torch.randint(0, tiny_target.shape.vocab_size, (b, t), generator=g)
    tokens[:, 1:] = top[:, :-1]
    mask = torch.zeros(b, t)
    mask[:, 6:] = 1
    batch = Batch(tokens=tokens, aux=torch.randn(b, t, 3 * h, generator=g), final=final, loss_mask=mask,
                  in_vocab=tiny_drafter.t2d[top], target_top=top)
    data = collect(tiny_drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, [batch], depth=3)
    _, per_pos, n = simulated_acceptance(tiny_drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, batch, 3)
    for k in range(3):
        sel = data.depth == k
        assert abs(float((data.alive[sel] & data.label[sel]).sum()) / n - per_pos[k]) < 1e-9
    assert int((data.depth == 0).sum()) == n and bool(data.alive[data.depth == 0].all())
    assert data.x.shape[1] == 2 * tiny_drafter.shape.hidden_size + 1
    assert set(data.group.tolist()) == {0, 1}
    half = collect(tiny_drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, [batch], depth=3, keep=0.5)
    assert 0 < len(half) < len(data)


def test_a_fitted_head_carries_its_held_out_ece_into_what_serving_checks(tiny_target, agreeing_drafter):
    """fit_confidence records the ECE it measured on the held-out half on the head; the frozen head
    (what a retrain saves) keeps it, so serving can refuse a head that is not calibrated."""
    from tide.drafter.confidence import frozen, serving_head
    from tide.train.confidence import fit_confidence
    from tide.train.offline import generate_samples

    drafter, prompts = agreeing_drafter
    g = torch.Generator().manual_seed(4)
    others = [torch.randint(3, tiny_target.shape.vocab_size, (10,), generator=g).tolist() for _ in range(8)]
    train = generate_samples(tiny_target, prompts + others[:4], 48, (), progress=False)
    held = generate_samples(tiny_target, prompts + others[4:], 48, (), progress=False)
    head, report = fit_confidence(drafter, tiny_target.embed_weight, tiny_target.lm_head_weight, train, held,
                                  depth=3, batch_tokens=512, max_len=128)
    assert report["test_rows"] > 0 and head.heldout_ece == report["ece"]
    conf = frozen(head)
    assert conf.heldout_ece == report["ece"]
    assert (serving_head(conf)[0] is conf) == (report["ece"] <= 0.05)
