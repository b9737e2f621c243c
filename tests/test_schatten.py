"""The training surrogate's norms by matrix products only (attncert.bounds.schatten): upper
bounds of the dense spectral norms within their stated factors, finite on a product far from
normal (where the trace-scaled squarings divided by a rounded zero), finite derivatives where a
solver's are not, and one batched call a matrix size giving the per-matrix values."""

import json
from pathlib import Path

import pytest
import torch

from attncert.bounds.schatten import (
    SQUARINGS,
    eigenvalue_upper,
    eigenvalues_upper,
    gram,
    product_gram,
)


def _pad(k: int, dtype, squarings: int = SQUARINGS) -> float:
    return 1 + 8 * (squarings + 1) * k * torch.finfo(dtype).eps


def _factor(k: int, dtype, squarings: int = SQUARINGS) -> float:
    """The stated worst case above the largest eigenvalue of a Gram matrix: k^(1/(2q)) and the
    padding."""
    return k ** (1 / 2 ** (squarings + 1)) * _pad(k, dtype, squarings)


def _product_factor(k: int, dtype, norms: float, top: torch.Tensor) -> torch.Tensor:
    """The stated worst case for a product G_u G_v: (sqrt(k) ||G_u|| ||G_v|| / lambda_max)^(1/q)
    and the padding (``norms``: ||G_u|| ||G_v||)."""
    return (k ** 0.5 * norms / top) ** (1 / 2**SQUARINGS) * _pad(k, dtype)


def _top(m: torch.Tensor) -> torch.Tensor:
    return torch.linalg.eigvals(m.double()).real.amax(-1)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_largest_eigenvalue_is_bounded_above_within_the_stated_factor(dtype):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(64, 7, 5, generator=g, dtype=torch.float64)
    sym = a @ a.transpose(-1, -2)  # PSD, rank 5 of 7
    b = torch.randn(64, 7, 7, generator=g, dtype=torch.float64)
    gb = b @ b.transpose(-1, -2)
    prod = sym @ gb  # a product of two PSD matrices: not symmetric
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    norms = torch.linalg.matrix_norm(sym, 2) * torch.linalg.matrix_norm(gb, 2)
    for m, factor in ((sym, _factor(7, dtype)), (prod, _product_factor(7, dtype, norms,
                                                                          _top(prod)))):
        dense = _top(m)
        up = eigenvalue_upper(m.to(dtype)).double()
        assert (up >= dense * (1 - tol)).all()
        assert (up <= dense * factor * (1 + tol)).all()
    # fewer squarings: looser, still above; none: the Frobenius norm
    assert (eigenvalue_upper(sym, 2) >= eigenvalue_upper(sym)).all()
    torch.testing.assert_close(eigenvalue_upper(sym, 0) / _pad(7, torch.float64, 0),
                               torch.linalg.matrix_norm(sym))
    # far apart scales: the rescaling keeps every entry finite
    huge = sym * 1e150
    assert torch.isfinite(eigenvalue_upper(huge)).all()


def test_a_product_far_from_normal_stays_finite_and_above_in_float32():
    """A float32 product of two Gram matrices whose largest singular value is 100 times its
    largest eigenvalue (W^Q's and W^K's of a head the lofast margin had nearly switched off,
    whose strong directions it had made orthogonal): rounded, its top eigenvalues are a
    complex pair, the trace of a power came out negative and scaling each squaring by the
    trace gave NaN. Scaled by Frobenius norms, the bound is finite, above the float64
    eigenvalue and within the stated factor, and so is its derivative; at M = 0 both are
    finite too."""
    rec = json.loads((Path(__file__).parent / "data" / "nonnormal_gram_product.json").read_text())
    m = torch.tensor([float.fromhex(h) for h in rec["float32_hex"]]).reshape(rec["shape"])
    assert torch.linalg.matrix_norm(m.double(), 2) > 50 * _top(m)  # far from normal
    mm = m.clone().requires_grad_(True)
    up = eigenvalue_upper(mm)
    (grad,) = torch.autograd.grad(up, mm)
    assert torch.isfinite(up) and torch.isfinite(grad).all()
    top = _top(m)
    assert top * (1 - 1e-6) <= up.double() <= top * _product_factor(
        32, torch.float32, rec["norm_gu"] * rec["norm_gv"], top)
    zero = torch.zeros(2, 5, 5, requires_grad=True)
    (grad,) = torch.autograd.grad(eigenvalue_upper(zero).sum(), zero)
    assert torch.isfinite(grad).all()


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
            if k == r:  # the r x r product of the two Gram matrices
                norms = torch.linalg.matrix_norm(u, 2) ** 2 * torch.linalg.matrix_norm(v, 2) ** 2
                factor = _product_factor(k, torch.float64, norms, dense**2)
            else:  # the Gram matrix of u v^T
                factor = _factor(k, torch.float64)
            assert (value <= dense * factor**0.5).all()
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
