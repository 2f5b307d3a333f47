"""The start-up choice of the target's linear kernel: the faster candidate among those that compute
a row bitwise alike at every row count, once per process; oneDNN rows padded to one kernel."""
from __future__ import annotations

import time

import pytest
import torch

from tide.models import kernels, rowkernel
from tide.models.llama import Linears


@pytest.fixture(autouse=True)
def fresh_choices(monkeypatch):
    monkeypatch.setattr(kernels, "_chosen", {})


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(48, 32, generator=g), "b": torch.randn(32, 48, generator=g)}


def _row_by_row(w):
    """Invariant by construction: each row is its own product."""
    return lambda x, name: torch.cat([x[i:i + 1] @ w[name].T for i in range(x.shape[0])])


def _slow(fn, delay_s: float = 0.001):
    def product(x, name):
        time.sleep(delay_s)
        return fn(x, name)
    return product


def test_the_faster_of_two_invariant_candidates_is_chosen():
    w = _weights()
    fast, slow = _row_by_row(w), _slow(_row_by_row(w))
    choice = kernels.choose({"rows": slow, "onednn": fast}, w, ["a", "b"], {"rows": 8, "onednn": 8})
    assert choice.kernel == "onednn" and choice.invariant == {"rows": True, "onednn": True}
    assert choice.pass_ms["rows"] > choice.pass_ms["onednn"]
    kernels._chosen.clear()
    assert kernels.choose({"rows": fast, "onednn": slow}, w, ["a", "b"], {"rows": 8, "onednn": 8}).kernel == "rows"


def test_a_candidate_whose_rows_depend_on_the_row_count_is_never_chosen():
    w = _weights()

    def batch_dependent(x, name):  # faster, but a row's last bits move with the block it is in
        y = x @ w[name].T
        return y + (x.shape[0] > 1) * y.abs().max() * 1e-6

    choice = kernels.choose({"rows": _slow(_row_by_row(w)), "onednn": batch_dependent}, w, ["a", "b"],
                            {"rows": 8, "onednn": 8})
    assert choice.invariant == {"rows": True, "onednn": False}
    assert choice.kernel == "rows"


def test_the_choice_is_made_once_per_process_and_shapes():
    calls = []

    def counted(w):
        def product(x, name):
            calls.append(x.shape[0])
            return _row_by_row(w)(x, name)
        return product

    w = _weights()
    first = kernels.choose({"rows": counted(w)}, w, ["a", "b"], {"rows": 4})
    made = len(calls)
    assert kernels.choose({"rows": counted(w)}, w, ["a", "b"], {"rows": 4}) is first and len(calls) == made
    other = {"a": torch.randn(16, 32), "b": torch.randn(32, 16)}  # other shapes: checked afresh
    kernels.choose({"rows": counted(other)}, other, ["a", "b"], {"rows": 4})
    assert len(calls) > made


def test_onednn_pads_one_and_two_rows_to_one_kernel():
    """One and two rows run oneDNN's kernel for three (its own for fewer is slower, and rounds
    some shapes differently): a row's result is bitwise what it is among three."""
    g = torch.Generator().manual_seed(5)
    w = {"down": torch.randn(576, 1536, generator=g) * 0.05}  # SmolLM2's down projection
    lin = Linears(w, ["down"], packed=True, kernel="onednn")
    assert lin.kernel == "onednn" and set(lin.packed) == {"down"}
    x = torch.randn(3, 1536, generator=g)
    three = torch.ops.mkldnn._linear_pointwise(x, lin.packed["down"], None, "none", [], "")
    assert torch.equal(lin(x[:1], "down"), three[:1])
    assert torch.equal(lin(x[:2], "down"), three[:2])
    assert torch.equal(lin(x, "down"), three)
    assert torch.allclose(lin(x[:1], "down"), x[:1] @ w["down"].T, atol=1e-4)


def test_auto_computes_every_row_bitwise_alike_at_every_row_count():
    """What the lossless guarantee needs of whichever kernel auto picks on this machine."""
    g = torch.Generator().manual_seed(9)
    w = {"qkv": torch.randn(960, 576, generator=g) * 0.05, "down": torch.randn(576, 1536, generator=g) * 0.05}
    lin = Linears(w, ["qkv", "down"], packed=True)
    if rowkernel.cpu_supported() and rowkernel._compiler() is not None:  # both candidates here: a choice made
        assert lin.choice is not None and lin.kernel == lin.choice.kernel
        assert lin.choice.invariant[lin.kernel]
    for name, k in (("qkv", 576), ("down", 1536)):
        x = torch.randn(16, k, generator=g)
        alone = torch.cat([lin(x[i:i + 1], name) for i in range(16)])
        for m in range(2, 17):
            assert torch.equal(lin(x[:m], name), alone[:m]), (name, m)


def test_an_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="auto, rows or onednn"):
        Linears(_weights(), ["a"], packed=True, kernel="mkl")
