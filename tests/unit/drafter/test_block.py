"""The block drafter (DSpark's semi-autoregressive kind): its cached drafting computes what its
training unroll computes, it drafts losslessly through the engine's step, and its objective trains it."""
from __future__ import annotations

import pytest
import torch

from tide.drafter.block import BlockDrafter
from tide.spec.block import block_draft
from tide.spec.decode import RowInput, draft
from tide.spec.generate import generate
from tide.spec.rules import FixedLength
from tide.train.block_objective import block_loss
from tide.train.objective import Batch, Rows, block_logits, chain_lengths, unroll
from tide.train.trainer import collate, prepare, train


@pytest.fixture(scope="module")
def block(tiny_drafter):
    """A block drafter off the tiny chain drafter, its Markov head made non-zero (so the bias counts)."""
    b = BlockDrafter.from_chain(tiny_drafter, rank=8, seed=3)
    with torch.no_grad():
        b.markov_out.weight.copy_(torch.randn(b.markov_out.weight.shape, generator=torch.Generator().manual_seed(4)))
    return b


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(4, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _row(target, prompt: list[int], slot: int = 0, cache=None) -> RowInput:
    cache = cache if cache is not None else target.new_cache(1, 128)
    out = target.forward(torch.tensor([prompt]), torch.tensor([0]), cache, torch.tensor([slot]))
    nxt = int(out.logits[0, -1].argmax())
    return RowInput(slot=slot, t_len=len(prompt), pending=nxt, feed_start=0,
                    feed_tokens=torch.tensor(prompt[1:] + [nxt]), feed_aux=out.aux_hidden[0])


def test_from_a_chain_its_first_depth_is_the_chains(tiny_target, tiny_drafter):
    """Same layer and head, Markov bias zero: the first draft of every row is the chain's."""
    block = BlockDrafter.from_chain(tiny_drafter, rank=8)
    embed = tiny_target.embed_weight
    for prompt in _prompts(tiny_target.shape.vocab_size, 4, seed=1):
        row = _row(tiny_target, prompt)
        chain = draft(tiny_drafter, embed, tiny_drafter.new_cache(1, 128), [row], 4, FixedLength())
        ours = block_draft(block, embed, block.new_cache(1, 128), [row], 4, FixedLength())
        assert ours.tokens.shape == (1, 4) and int(ours.tokens[0, 0]) == int(chain.tokens[0, 0])
        assert torch.allclose(ours.prob[:, 0], chain.prob[:, 0], atol=1e-5)


def test_cached_drafting_computes_the_training_unroll(tiny_target, block):
    """At every anchor t of a sequence, the cached feed + mask-row forward gives the logits the
    teacher-forced unroll trains (Markov bias of the sequence's own tokens): what is trained is
    what drafts."""
    gamma = 4
    prompt = _prompts(tiny_target.shape.vocab_size, 1, seed=7)[0] + [5, 9, 11, 13, 17, 19]
    out = tiny_target.forward(torch.tensor([prompt]), torch.tensor([0]), tiny_target.new_cache(1, 128),
                              torch.tensor([0]))
    t_len = len(prompt)
    batch = Batch(tokens=torch.tensor([prompt]), aux=out.aux_hidden.float(), final=out.final_hidden.float(),
                  loss_mask=torch.ones(1, t_len), in_vocab=torch.ones(1, t_len, dtype=torch.bool))
    embed, d2t = tiny_target.embed_weight, block.draft_to_target
    for t in (3, t_len - gamma - 1):
        rows = Rows(b=torch.tensor([0]), t=torch.tensor([t]))
        trained = torch.stack([block_logits(block, logits, rows.at(batch.tokens, step))[0]
                               for step, logits, _ in unroll(block, embed, batch, gamma, rows=rows, block=True)])
        cache = block.new_cache(1, 128)
        feed = torch.tensor([prompt[1:t + 2]])
        with torch.inference_mode():
            h = block.step(torch.nn.functional.embedding(feed, embed), block.project(batch.aux[:, :t + 1]), cache,
                           torch.tensor([0]), torch.arange(t + 1)[None])
            hidden = block.block_hidden(h[:, -1:], cache, torch.tensor([0]), torch.tensor([[t]]), gamma)
            # the walk feeds the sequence's own next tokens (where they are in the draft vocab)
            ids = [(d2t == prompt[t + 2 + k]).nonzero().flatten()[:1] for k in range(gamma - 1)] + [[]]
            cached, _ = block.chained_logits(block.logits(hidden).float(), torch.tensor([prompt[t + 1]]), d2t,
                                             pick=lambda k, lg: ids[k] if len(ids[k]) else lg.argmax(-1))
        in_vocab = [len(ids[k]) > 0 for k in range(gamma - 1)]
        upto = 1 + (in_vocab.index(False) if False in in_vocab else gamma - 1)
        assert torch.allclose(cached[0, :upto], trained[:upto], atol=2e-4), (t, upto)


@pytest.mark.parametrize("gamma,stop_prob", [(1, 0.0), (4, 0.0), (5, 0.3)])
def test_block_drafting_is_lossless(tiny_target, block, gamma, stop_prob):
    for prompt in _prompts(tiny_target.shape.vocab_size, 6, seed=gamma):
        ref, _ = generate(tiny_target, None, prompt, 32)
        out, stats = generate(tiny_target, block, prompt, 32, gamma=gamma, stop_prob=stop_prob, drafting=block_draft)
        assert out == ref
        assert stats.target_forwards <= len(ref)


def test_sampled_block_drafts_carry_their_q(tiny_target, block):
    """A sampled row's drafts come with q per depth (what rejection sampling reads) and their own
    probability under it; a sampled generation runs to length."""
    row = _row(tiny_target, _prompts(tiny_target.shape.vocab_size, 1, seed=5)[0])
    row.temperature, row.generator = 0.8, torch.Generator().manual_seed(0)
    drafts = block_draft(block, tiny_target.embed_weight, block.new_cache(1, 128), [row], 3)
    assert len(drafts.q_probs[0]) == 3
    for k in range(3):
        q = drafts.q_probs[0][k]
        assert abs(float(q.sum()) - 1.0) < 1e-4 and float(q[drafts.tokens[0, k]]) == pytest.approx(float(drafts.prob[0, k]))
    out, _ = generate(tiny_target, block, [5, 6, 7, 8], 24, gamma=3, temperature=0.8, seed=1, drafting=block_draft)
    assert len(out) == 24


def test_its_objective_trains_the_block(tiny_target, tiny_drafter):
    """On the target's own greedy answers, DSpark's loss raises the block's simulated greedy
    acceptance past where it started (the chain's first depth copied, mask rows untrained)."""
    from tide.train.offline import generate_samples

    prompts = _prompts(tiny_target.shape.vocab_size, 4, seed=9)
    samples = generate_samples(tiny_target, prompts, 48, (), progress=False)
    block = BlockDrafter.from_chain(tiny_drafter, rank=8)
    embed, head = tiny_target.embed_weight, tiny_target.lm_head_weight

    def accepted() -> float:
        prepare(samples, block, head)
        batch = collate(samples, 128)
        _, acc, counted = chain_lengths(block, embed, head, batch, 4, block=True)
        return float(acc[counted].float().mean())

    before = accepted()
    with torch.no_grad():
        loss0 = float(block_loss(block, embed, head, collate(samples, 128), 4)[0])
    train(block, embed, head, samples, epochs=60, lr=3e-3, batch_tokens=512, max_len=128, ttt_length=4,
          step_weight=0.8, progress=False, objective=lambda d, e, h, b: block_loss(d, e, h, b, 4))
    with torch.no_grad():
        assert float(block_loss(block, embed, head, collate(samples, 128), 4)[0]) < 0.5 * loss0
    after = accepted()
    assert after > before + 0.5, (before, after)
