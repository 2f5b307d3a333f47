"""The few-row C linear kernel: exact enough, batch-invariant, refuses bad input, optional."""
import shutil

import pytest
import torch

from tide.models import rowkernel
from tide.models.llama import Linears

AVAILABLE = rowkernel.cpu_supported() and rowkernel._compiler() is not None


@pytest.fixture(scope="module")
def kernel():
    k = rowkernel.load()
    if AVAILABLE:  # on an AVX2 machine with a compiler (CI's) the kernel must build: no silent fallback
        assert k is not None
    else:
        pytest.skip("no AVX2/FMA CPU or C compiler here: the torch fallback is what runs")
    return k


@pytest.mark.parametrize("n,k", [(96, 64), (97, 70), (3, 13), (1536, 576)])
def test_matches_torch_linear(kernel, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g)
    for m in (1, 2, 3, 4, 5, 6, 7, 8, 13, 16):  # both paths, one and several 6-row blocks
        x = torch.randn(m, k, generator=g)
        y = kernel(x, w)
        assert y.shape == (m, n)
        assert torch.allclose(y, x @ w.T, rtol=1e-5, atol=1e-4)


def test_each_row_is_bitwise_independent_of_the_batch(kernel):
    """Why the engine wants it: a token's logits in a 5-token verify equal those of its decode."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(203, 77, generator=g)  # odd sizes: the 4- and 2-row groups' tails and the k tail
    x = torch.randn(14, 77, generator=g)  # past two 6-row blocks
    alone = torch.cat([kernel(x[i:i + 1], w) for i in range(14)])
    for m in range(1, 15):
        assert torch.equal(kernel(x[:m], w), alone[:m])


def test_refuses_wrong_dtype_and_shape(kernel):
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="float32"):
        kernel(torch.randn(2, 16, dtype=torch.float64), w)
    with pytest.raises(ValueError, match="float32"):
        kernel(torch.randn(2, 15), w)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(torch.randn(2, 8), torch.randn(8, 8).T)


def test_build_is_content_addressed_and_reused(tmp_path):
    if not AVAILABLE:
        pytest.skip("no C compiler / AVX2 here")
    path = rowkernel.build(tmp_path)
    assert path.parent == tmp_path and path.name.startswith("linear_rows-") and path.suffix == ".so"
    mtime = path.stat().st_mtime_ns
    assert rowkernel.build(tmp_path) == path and path.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


def test_disabled_by_env_and_without_compiler(monkeypatch, tmp_path):
    monkeypatch.setattr(rowkernel, "_loaded", {})
    monkeypatch.setenv(rowkernel.ENV_SWITCH, "0")
    assert rowkernel.load() is None
    monkeypatch.setattr(rowkernel, "_loaded", {})
    monkeypatch.delenv(rowkernel.ENV_SWITCH)
    monkeypatch.setenv("TIDE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "")
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert rowkernel.load() is None  # no compiler: torch kernels, one warning, no exception
    with pytest.raises(RuntimeError, match="no C compiler"):
        rowkernel.build(tmp_path / "k")


def test_linears_use_the_kernel_for_few_rows_only(kernel):
    g = torch.Generator().manual_seed(4)
    w = {"a": torch.randn(96, 64, generator=g)}
    lin = Linears(w, ["a"], packed=True, kernel="rows")
    assert lin.rows is kernel
    few = torch.randn(1, 5, 64, generator=g)
    assert torch.equal(lin(few, "a"), kernel(few[0], w["a"]).view(1, 5, 96))
    many = torch.randn(2, 20, 64, generator=g)  # 40 rows > ROW_KERNEL_MAX_ROWS: oneDNN / MKL
    assert torch.allclose(lin(many, "a"), many @ w["a"].T, atol=1e-4)


def test_bf16_weights_give_the_float32_result_bitwise(kernel):
    """The drafter serves from bf16 weights: same numbers as its bf16-valued float32 weights."""
    g = torch.Generator().manual_seed(7)
    w16 = torch.randn(203, 77, generator=g).bfloat16()
    for m in (1, 2, 5, 8):  # both paths
        x = torch.randn(m, 77, generator=g)
        assert torch.equal(kernel(x, w16), kernel(x, w16.float()))
        assert torch.allclose(kernel(x, w16), x @ w16.float().T, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="bfloat16"):
        kernel(x, w16.half())
