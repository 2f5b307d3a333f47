"""Our Llama forward (slot KV cache, per-row positions) equals transformers' LlamaForCausalLM."""
import pytest
import torch
from transformers import LlamaForCausalLM

from tide.models.llama import LlamaTarget, default_aux_layer_ids
from tide.models.tiny import tiny_llama_checkpoint


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tiny_llama_checkpoint(tmp_path_factory.mktemp("t") / "m", layers=5)
    hf = LlamaForCausalLM.from_pretrained(folder).eval()
    return hf, LlamaTarget.from_folder(folder, aux_layer_ids=(1, 2, 4), max_seq_len=128)


def test_full_sequence_logits_and_aux_states(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True)
    out = ours.forward(ids, torch.tensor([0, 0]), ours.new_cache(3), torch.tensor([2, 0]))
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    # aux = inputs of layers 1, 2, 4 = hidden_states[1], [2], [4]
    expected = torch.cat([ref.hidden_states[i] for i in (1, 2, 4)], dim=-1)
    assert torch.allclose(out.aux_hidden, expected, atol=1e-5)
    assert torch.allclose(out.final_hidden, ref.hidden_states[-1], atol=1e-5)


def test_batched_rows_at_different_positions_and_slots(pair):
    hf, ours = pair
    g = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 512, (1, 20), generator=g), torch.randint(0, 512, (1, 20), generator=g)
    with torch.no_grad():
        ref_a, ref_b = hf(a).logits[0], hf(b).logits[0]
    cache = ours.new_cache(4)
    ours.forward(a[:, :9], torch.tensor([0]), cache, torch.tensor([3]))
    ours.forward(b[:, :14], torch.tensor([0]), cache, torch.tensor([1]))
    # one batched forward: row a feeds positions 9..13, row b 14..18 (then b's rejected tail is
    # rolled back by simply feeding position 15 again)
    fed = torch.cat([a[:, 9:14], b[:, 14:19]])
    out = ours.forward(fed, torch.tensor([9, 14]), cache, torch.tensor([3, 1]))
    assert torch.allclose(out.logits[0], ref_a[9:14], atol=1e-5)
    assert torch.allclose(out.logits[1], ref_b[14:19], atol=1e-5)
    again = ours.forward(b[:, 15:16], torch.tensor([15]), cache, torch.tensor([1]))
    assert torch.allclose(again.logits[0, 0], ref_b[15], atol=1e-5)


def test_prefill_last_only_and_bad_aux_layers(pair):
    hf, ours = pair
    ids = torch.randint(0, 512, (1, 7))
    out = ours.forward(ids, torch.tensor([0]), ours.new_cache(1), torch.tensor([0]), last_only=True)
    assert out.logits.shape == (1, 1, 512)
    with pytest.raises(ValueError, match="aux_layer_ids"):
        LlamaTarget(ours.shape, {k: v for k, v in ours.w.items() if "." in k or k.endswith("weight")}, (0, 1, 9))
    assert default_aux_layer_ids(30) == (2, 15, 27)


def test_position_past_cache_is_refused(pair):
    _, ours = pair
    with pytest.raises(ValueError, match="exceeds cache length"):
        ours.forward(torch.zeros(1, 4, dtype=torch.long), torch.tensor([30]), ours.new_cache(1, 32), torch.tensor([0]))


def test_prepacked_projections_match_plain_linear():
    """oneDNN's prepacked weights compute x @ W.T at every row count."""
    from tide.models.llama import Linears

    g = torch.Generator().manual_seed(3)
    w = {"a": torch.randn(96, 64, generator=g), "b": torch.randn(64, 96, generator=g)}
    packed = Linears(w, ["a", "b"], packed=True, kernel="onednn")
    plain = Linears(w, ["a", "b"], packed=False, kernel="onednn")
    assert not plain.packed
    if torch.backends.mkldnn.is_available():
        assert set(packed.packed) == {"a", "b"}
    for rows in (1, 5, 40):
        x = torch.randn(2, rows, 64, generator=g)
        y = packed(x, "a")
        assert y.shape == (2, rows, 96)
        assert torch.allclose(y, torch.nn.functional.linear(x, w["a"]), atol=1e-4)
        assert torch.allclose(packed(y, "b"), plain(y, "b"), atol=1e-3)


def test_packed_and_plain_targets_agree(pair):
    _, ours = pair
    plain = LlamaTarget(ours.shape, {k: v for k, v in ours.w.items() if k.endswith("weight")},
                        ours.aux_layer_ids, max_seq_len=128, packed=False, kernel="onednn")
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(5))
    a = ours.forward(ids, torch.tensor([0, 0]), ours.new_cache(2), torch.tensor([0, 1]))
    b = plain.forward(ids, torch.tensor([0, 0]), plain.new_cache(2), torch.tensor([0, 1]))
    assert torch.allclose(a.logits, b.logits, atol=1e-4)
    assert torch.equal(a.logits.argmax(-1), b.logits.argmax(-1))


class _RowCount:
    """Wraps a target's linears and records the rows each call multiplies."""

    def __init__(self, linears):
        self.inner, self.rows = linears, []

    def __call__(self, x, name):
        self.rows.append((name, x.reshape(-1, x.shape[-1]).shape[0]))
        return self.inner(x, name)


def test_a_packed_verify_computes_each_row_s_own_tokens_only(pair, monkeypatch):
    """Rows of 1, 4, 2 and 1 tokens in one forward: the same logits, states and cache as the padded
    forward at every real token, zeros past each row's length, and linears over 8 rows, not 16."""
    hf, ours = pair
    g = torch.Generator().manual_seed(7)
    history = torch.randint(0, 512, (4, 12), generator=g)
    slots, start = torch.tensor([3, 0, 2, 1]), torch.tensor([12, 12, 12, 12])
    caches = ours.new_cache(4), ours.new_cache(4)
    for cache in caches:
        ours.forward(history, torch.zeros(4, dtype=torch.long), cache, slots)
    fed, lengths = torch.randint(0, 512, (4, 4), generator=g), torch.tensor([1, 4, 2, 1])
    padded = ours.forward(fed, start, caches[0], slots)
    counter = _RowCount(ours.linear)
    monkeypatch.setattr(ours, "linear", counter)
    packed = ours.forward(fed, start, caches[1], slots, lengths=lengths)
    assert {rows for name, rows in counter.rows} == {8}  # 1 + 4 + 2 + 1 tokens through every linear
    with torch.no_grad():
        ref = hf(torch.cat([history[1], fed[1]])[None]).logits[0, 12:]
    assert torch.allclose(packed.logits[1], ref, atol=1e-5)  # the long row against transformers
    for b, n in enumerate(lengths.tolist()):
        for out in ("logits", "aux_hidden", "final_hidden"):
            got, want = getattr(packed, out)[b], getattr(padded, out)[b]
            assert torch.allclose(got[:n], want[:n], atol=1e-5), (b, out)
            assert not got[n:].any()
        # the cache holds the same keys and values at each row's real positions
        assert torch.allclose(caches[1].k[:, slots[b], :12 + n], caches[0].k[:, slots[b], :12 + n], atol=1e-5)
    with pytest.raises(ValueError, match="packed lengths"):
        ours.forward(fed, start, caches[1], slots, lengths=torch.tensor([0, 4, 2, 1]))
