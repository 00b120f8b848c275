"""Random Hadamard transform (megalm.precision.hadamard): orthogonality and exact GEMM invariance."""

from __future__ import annotations

import pytest
import torch

from megalm.precision.hadamard import hadamard_matrix, random_signs, rht


def bit_hadamard(n: int) -> torch.Tensor:
    """Sylvester's H_n from its closed form H[i, j] = (-1)^popcount(i & j), independent of the recursion."""
    i = torch.arange(n)
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in range(n)] for a in range(n)])
    assert parity.shape == (len(i), len(i))
    return 1.0 - 2.0 * parity.double()


def dense_rht(length: int, signs: torch.Tensor, block: int) -> torch.Tensor:
    """The block-diagonal R (length x length) with blocks diag(s) H / sqrt(block), built explicitly."""
    signs = signs.double().reshape(-1, block).expand(length // block, block)
    h = bit_hadamard(block) / block**0.5
    return torch.block_diag(*[torch.diag(s) @ h for s in signs])


@pytest.mark.parametrize("n", [1, 2, 4, 16, 64, 128])
def test_hadamard_matrix(n):
    h = hadamard_matrix(n, torch.float64, normalized=False)
    assert torch.equal(h, bit_hadamard(n))
    hn = hadamard_matrix(n, torch.float64)
    assert torch.allclose(hn @ hn.T, torch.eye(n, dtype=torch.float64), atol=1e-14)


def test_hadamard_size_must_be_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        hadamard_matrix(48)


def test_random_signs():
    a = random_signs(4096, torch.Generator().manual_seed(0))
    b = random_signs(4096, torch.Generator().manual_seed(0))
    c = random_signs(4096, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert set(a.unique().tolist()) == {-1.0, 1.0}
    assert abs(a.mean().item()) < 5 / 4096**0.5


@pytest.mark.parametrize("per_block", [False, True])
def test_rht_is_the_block_diagonal_orthogonal_matrix(per_block):
    block, length = 64, 256
    signs = random_signs(length if per_block else block, torch.Generator().manual_seed(2)).double()
    r = rht(torch.eye(length, dtype=torch.float64), signs, dim=-1, block_size=block)  # rows of I R = R
    assert torch.allclose(r, dense_rht(length, signs, block), atol=1e-14)
    assert torch.allclose(r @ r.T, torch.eye(length, dtype=torch.float64), atol=1e-13)
    # along dim 0 the same R acts on columns: rht(X, dim=0) = R^T-side transform of X's columns
    x = torch.randn(length, 5, dtype=torch.float64)
    assert torch.allclose(rht(x, signs, dim=0, block_size=block), (x.T @ r).T, atol=1e-13)


@pytest.mark.parametrize("k", [256, 100])  # 100: zero-padded to 128
def test_transformed_gemm_equals_plain_gemm(k):
    gen = torch.Generator().manual_seed(3)
    signs = random_signs(64, gen).double()
    a = torch.randn(7, k, generator=gen, dtype=torch.float64)
    b = torch.randn(9, k, generator=gen, dtype=torch.float64)
    ra, rb = rht(a, signs), rht(b, signs)
    assert ra.shape[-1] == -(-k // 64) * 64
    assert torch.allclose(ra @ rb.T, a @ b.T, rtol=0, atol=1e-12)
    # K along dim 0 (the weight-gradient GEMM: dy^T x over tokens)
    c = torch.randn(k, 6, generator=gen, dtype=torch.float64)
    d = torch.randn(k, 4, generator=gen, dtype=torch.float64)
    assert torch.allclose(rht(c, signs, dim=0).T @ rht(d, signs, dim=0), c.T @ d, rtol=0, atol=1e-12)
    # different signs on the two operands do not cancel
    other = random_signs(64, gen).double()
    assert not torch.allclose(rht(a, signs) @ rht(b, other).T, a @ b.T, atol=1e-3)


def test_rht_spreads_an_outlier_over_its_block():
    x = torch.zeros(1, 128)
    x[0, 70] = 8.0
    y = rht(x, random_signs(64, torch.Generator().manual_seed(4)))
    assert torch.equal(y[0, :64], torch.zeros(64))  # other block untouched
    assert torch.allclose(y[0, 64:].abs(), torch.full((64,), 1.0))  # 8 / sqrt(64) everywhere
    assert torch.allclose(y.norm(), x.norm())


def test_rht_rejects_wrong_sign_count():
    with pytest.raises(ValueError, match="signs"):
        rht(torch.randn(4, 128), torch.ones(32))


@pytest.mark.parametrize("fake_first", [True, False], ids=["fake-then-real", "real-then-fake"])
def test_fake_tensor_tracing_leaves_the_matrix_cache_real(fake_first):
    """megalm-estimate and the fake-CUDA tier trace the RHT under FakeTensorMode: a fake matrix kept in the cache
    failed every real transform after it in the process, and a cached real one failed under a mode that takes no
    real inputs. A block size of its own (8) so that no other test's call has filled the cache first."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def transform_fake() -> None:
        with FakeTensorMode():
            out = rht(torch.randn(16, 8), random_signs(8), block_size=8)
            assert isinstance(out, FakeTensor)

    x, signs = torch.randn(16, 8), random_signs(8, torch.Generator().manual_seed(0))
    if fake_first:
        transform_fake()
    out = rht(x, signs, block_size=8)
    assert not isinstance(out, FakeTensor)
    torch.testing.assert_close(out, x @ (signs.unsqueeze(1) * hadamard_matrix(8)))
    transform_fake()
