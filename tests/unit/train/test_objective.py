"""The TTT unroll computes steps >= 1 only where a draft can reach a loss position; on those rows it
must give what unrolling every position gives, in values and in gradients."""
import copy

import torch

from tide.train.objective import Batch, Rows, eagle3_loss, needed_rows, replay_chains, unroll


def _batch(target, drafter, seed=0):
    g = torch.Generator().manual_seed(seed)
    b, t, h = 3, 24, drafter.shape.hidden_size
    mask = torch.zeros(b, t)
    mask[0, 10:] = 1  # a prompt then generated tokens
    mask[1, 17:20] = 1  # a short burst
    mask[2, 4:6] = 1
    mask[2, 15:23] = 1  # two bursts, the last position unmasked
    final = torch.randn(b, t, h, generator=g)
    top = torch.nn.functional.linear(final, target.lm_head_weight).argmax(-1)
    return Batch(tokens=torch.randint(0, drafter.shape.vocab_size, (b, t), generator=g),
                 aux=torch.randn(b, t, 3 * target.shape.hidden_size, generator=g), final=final,
                 loss_mask=mask, in_vocab=drafter.t2d[top], target_top=top)


def test_needed_rows_are_the_positions_a_draft_step_can_score():
    mask = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 0, 0, 0]], dtype=torch.float)
    rows = needed_rows(mask, 3)
    # step i at t predicts t+1+i: positions 2..5 reach 5 or 6 within 3 steps
    assert rows.t.tolist() == [2, 3, 4, 5] and rows.b.tolist() == [0] * 4
    assert needed_rows(torch.zeros(2, 5), 4).t.numel() == 0


def test_unroll_on_needed_rows_equals_unrolling_every_position(tiny_target, tiny_drafter):
    drafter = copy.deepcopy(tiny_drafter).train()
    embed = tiny_target.embed_weight
    batch = _batch(tiny_target, drafter)
    b, t = batch.tokens.shape
    every = Rows(*torch.ones(b, t).nonzero(as_tuple=True))
    weights = torch.randn(4, b * t, drafter.shape.draft_vocab_size, generator=torch.Generator().manual_seed(1))

    def run(rows):
        drafter.zero_grad()
        outs = list(unroll(drafter, embed, batch, 4, rows=rows))
        kept = needed_rows(batch.loss_mask, 4)
        flat = kept.b * t + kept.t
        total = torch.zeros(())
        picked = []
        for step, logits, r in outs:
            # the same (row, position) pairs from either unroll
            index = {(int(x), int(y)): i for i, (x, y) in enumerate(zip(r.b, r.t))}
            at = torch.tensor([index[(int(x), int(y))] for x, y in zip(kept.b, kept.t)], dtype=torch.long)
            picked.append(logits[at])
            total = total + (logits[at] * weights[step, flat]).sum()
        total.backward()
        return picked, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    sparse_logits, sparse_grads = run(None)
    dense_logits, dense_grads = run(every)
    assert needed_rows(batch.loss_mask, 4).t.numel() < b * t  # the sparse path really skips rows
    for s, d in zip(sparse_logits, dense_logits):
        assert torch.allclose(s, d, atol=1e-5), (s - d).abs().max()
    assert sparse_grads.keys() == dense_grads.keys()
    for name in sparse_grads:
        assert torch.allclose(sparse_grads[name], dense_grads[name], atol=1e-5, rtol=1e-4), name


def test_loss_ignores_unmasked_positions(tiny_target, tiny_drafter):
    """Changing the tokens' teacher states where nothing is masked leaves the loss unchanged;
    changing one masked position's teacher changes it."""
    drafter = copy.deepcopy(tiny_drafter)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight
    batch = _batch(tiny_target, drafter)
    base, _, _ = eagle3_loss(drafter, embed, head, batch, 4)
    unmasked = batch.loss_mask == 0
    batch.final[unmasked] = torch.randn(int(unmasked.sum()), batch.final.shape[-1])
    same, _, _ = eagle3_loss(drafter, embed, head, batch, 4)
    assert torch.allclose(base, same)
    b, t = (batch.loss_mask * batch.in_vocab).nonzero()[0].tolist()
    batch.final[b, t] += 5.0
    moved, _, _ = eagle3_loss(drafter, embed, head, batch, 4)
    assert not torch.allclose(base, moved)


def test_replay_steps_from_where_each_step_ended_and_skips_positions_not_generated():
    """Chains at t = 5, 6, 7 (generated), a gap at 8-9 (say, a user turn), then 10, 11: a step at 5
    accepting one draft commits 2 tokens, so the next starts at 7, then 8; 8 and 9 are not steps."""
    rows = Rows(b=torch.zeros(5, dtype=torch.long), t=torch.tensor([5, 6, 7, 10, 11]))
    accepted = torch.tensor([1, 3, 0, 0, 2])
    assert replay_chains(rows, accepted, torch.ones(5, dtype=torch.bool)) == (2 + 1 + 1 + 3, 4)
    assert replay_chains(rows, accepted, torch.ones(5, dtype=torch.bool), max_tokens=3) == (3, 2)
