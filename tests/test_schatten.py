"""The training surrogate's norms by matrix products only (attncert.bounds.schatten): upper
bounds of the dense spectral norms within their stated factor, finite derivatives where a
solver's are not, and one batched call a matrix size giving the per-matrix values."""

import pytest
import torch

from attncert.bounds.schatten import (
    SQUARINGS,
    eigenvalue_upper,
    eigenvalues_upper,
    gram,
    product_gram,
)


def _factor(k: int, dtype, squarings: int = SQUARINGS) -> float:
    """The stated worst case above the largest eigenvalue: k^(1/q) and the padding."""
    return k ** (1 / 2**squarings) * (1 + 8 * (squarings + 1) * k * torch.finfo(dtype).eps)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_largest_eigenvalue_is_bounded_above_within_the_stated_factor(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 7, 5, generator=g, dtype=torch.float64)
    sym = a @ a.transpose(-1, -2)  # PSD, rank 5 of 7
    b = torch.randn(64, 7, 7, generator=g, dtype=torch.float64)
    prod = sym @ (b @ b.transpose(-1, -2))  # a product of two PSD matrices: not symmetric
    for m in (sym, prod):
        dense = torch.linalg.eigvals(m).real.amax(-1)
        up = eigenvalue_upper(m.to(dtype)).double()
        tol = 1e-12 if dtype == torch.float64 else 1e-6
        assert (up >= dense * (1 - tol)).all()
        assert (up <= dense * _factor(7, dtype) * (1 + tol)).all()
    # fewer squarings: looser, still above; none: the trace
    assert (eigenvalue_upper(sym, 2) >= eigenvalue_upper(sym)).all()
    pad = 1 + 8 * 7 * torch.finfo(torch.float64).eps
    torch.testing.assert_close(eigenvalue_upper(sym, 0) / pad,
                               sym.diagonal(dim1=-2, dim2=-1).sum(-1))
    # far apart scales: the rescaling keeps every entry finite
    huge = sym * 1e150
    assert torch.isfinite(eigenvalue_upper(huge)).all()


def test_norms_of_products_are_upper_bounds_in_both_forms_with_finite_derivatives():
    """Tall factors (the weights' ||W^V W^O||: d rows, d_h columns) go to the r x r product,
    short ones (X W^K at a few tokens) to the row Gram matrix; never below the dense norm,
    a finite derivative at rank-deficient factors (where QR's can be NaN), and near the dense
    derivative's direction at full rank."""
    g = torch.Generator().manual_seed(1)
    for rows_u, rows_v, r in ((24, 20, 6), (4, 16, 8)):
        u = torch.randn(2, rows_u, r, generator=g, dtype=torch.float64)
        v = torch.randn(2, rows_v, r, generator=g, dtype=torch.float64)
        k = r if min(rows_u, rows_v) > r else min(rows_u, rows_v)
        assert product_gram(u, v).shape[-1] == k
        for rank_deficient in (False, True):
            if rank_deficient:
                u = u.clone()
                u[..., r // 2:] = u[..., :r // 2]
            dense = torch.linalg.svdvals(u @ v.transpose(-1, -2))[..., 0]
            uu, vv = u.clone().requires_grad_(True), v.clone().requires_grad_(True)
            value = eigenvalue_upper(product_gram(uu, vv)).sqrt()
            assert (value >= dense * (1 - 1e-12)).all()
            assert (value <= dense * _factor(k, torch.float64) ** 0.5).all()
            grads = torch.autograd.grad(value.sum(), (uu, vv))
            assert all(torch.isfinite(t).all() for t in grads)
            if not rank_deficient:
                ud, vd = u.clone().requires_grad_(True), v.clone().requires_grad_(True)
                ref = torch.autograd.grad(torch.linalg.svdvals(ud @ vd.transpose(-1, -2))
                                          [..., 0].sum(), (ud, vd))
                for o, d in zip(grads, ref, strict=True):
                    cos = (o * d).sum() / (o.norm() * d.norm())
                    assert cos > 0.99
    with pytest.raises(ValueError, match="inner size"):
        product_gram(torch.ones(3, 2), torch.ones(3, 4))


def test_one_batched_call_a_size_gives_each_matrix_s_own_bound():
    g = torch.Generator().manual_seed(2)
    ms = [gram(torch.randn(5, 3, 4, 6, generator=g)), gram(torch.randn(2, 9, 3, generator=g)),
          gram(torch.randn(7, 4, 4, generator=g)), gram(torch.randn(5, 5, generator=g))]
    assert [m.shape[-1] for m in ms] == [4, 3, 4, 5]
    together = eigenvalues_upper(ms)
    for m, t in zip(ms, together, strict=True):
        assert t.shape == m.shape[:-2]
        torch.testing.assert_close(t, eigenvalue_upper(m), rtol=1e-6, atol=0)


def test_bad_shapes_and_orders_are_refused():
    with pytest.raises(ValueError, match="square"):
        eigenvalue_upper(torch.ones(2, 3))
    with pytest.raises(ValueError, match="squarings"):
        eigenvalue_upper(torch.eye(2), -1)
