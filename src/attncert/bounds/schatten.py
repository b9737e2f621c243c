"""Upper bounds of spectral norms by matrix products only: norms of high matrix powers.

The training surrogate of the ``lofast`` margin (:mod:`attncert.training.certified_training`)
differentiates dozens of small spectral norms a step. An eigensolver or an SVD gives them
exactly, but on CUDA each reads its status on the host, so a step holding one cannot be
replayed as a CUDA graph, and a batch of small solves is slow there. These bounds need no
solver. For any square M of size k x k, with rho(M) its spectral radius and q = 2^t,

    rho(M) = rho(M^q)^(1/q) <= ||M^q||_2^(1/q) <= ||M^q||_F^(1/q),

reached by t squarings. The matrices bounded here are a Gram matrix A A^T, whose largest
eigenvalue is A's squared spectral norm, or a product G_u G_v of two, whose eigenvalues are
those of G_v^(1/2) G_u G_v^(1/2) (AB and BA share their characteristic polynomial), real and
>= 0, the largest being rho. How far above it the bound lies:

* a Gram matrix (symmetric, >= 0): ||M^q||_F^(1/q) = (sum lambda_i^(2q))^(1/(2q)) <=
  k^(1/(2q)) lambda_max;
* a product G_u G_v: with S = G_u^(1/2) G_v G_u^(1/2), M^q = G_u^(1/2) S^(q-1) G_u^(1/2) G_v
  (no inverse needed), so ||M^q||_F <= ||G_u|| ||G_v|| sqrt(k) lambda_max^(q-1) and the bound
  is within (sqrt(k) ||G_u|| ||G_v|| / lambda_max)^(1/q) of lambda_max: the factor grows with
  how far from normal the product is (||G_u|| ||G_v|| / lambda_max, at least 1), but only as
  its q-th root.

Each squaring divides the matrix by its Frobenius norm first, and the logarithms of those
norms accumulate the scale, so nothing overflows; every scale is a sum of squares, which
rounding cannot make negative or zero (for M != 0). Until 2026-12-01 each squaring divided by
the trace and the bound was (tr M^q)^(1/q), looser for a Gram matrix (k^(1/q), not
k^(1/(2q))) and fragile for a product: formed in float32, a product G_u G_v far from normal
(its largest singular value 100 times its largest eigenvalue, the W^Q and W^K of a head the
``lofast`` margin had nearly switched off) has a complex pair of top eigenvalues, the trace of
its 128th power was negative, and the next division turned it into NaN: the cpu grid's
training diverged (``tests/data/nonnormal_gram_product.json``; the spectral radius, which the
Frobenius norm bounds, is fine). The result is padded by 8 (t + 1) k rounding units against
the products' rounding. With t = :data:`SQUARINGS` the bound of a singular value (the square
root) is above it by at most a factor k^(2^-(t+2)) for a Gram matrix: 0.1% at k = 4, 0.3% at
k = 32, 0.5% at k = 128, 0.6% at k = 384; on that head's product, 1.0% (its stated worst
case 2.8%). Differentiable away from M = 0 (where its computed gradient is 0), also at
repeated and zero eigenvalues (where an eigensolver's derivative is not), and elementwise plus
batched products, so ``torch.compile`` fuses it and a CUDA graph holds it.

These are training bounds: the certificates take exact norms (:mod:`attncert.bounds.spectral`).
The bound holds in exact arithmetic; computed, it is one up to the rounding of the products
that form M and of the squarings, which is relative to the factors' sizes ||u|| ||v||, not to
||u v^T||: in float64 1e-12 relative for the matrices of a trained model
(``tests/test_certified_training.py`` checks it against the certifier); in float32, on the
diverged model's heads, where ||u v^T|| was down to 1/2700 of ||u|| ||v||, up to 0.13% below
the float64 norm of the same factors; where TF32 is on (a GPU's training step) the products
round at 5e-4 of ||u|| ||v||: a training signal can bear it, a certificate could not.
docs/math.md section 7.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["SQUARINGS", "eigenvalue_upper", "eigenvalues_upper", "gram", "product_gram"]

#: squarings t of the training surrogate's norms: the power q = 2^t whose Frobenius norm's
#: q-th root bounds the largest eigenvalue (module docstring)
SQUARINGS = 8


def eigenvalue_upper(m: Tensor, squarings: int = SQUARINGS) -> Tensor:
    """(...,): ||M^q||_F^(1/q), q = 2^squarings, padded by 8 (squarings + 1) k rounding units,
    an upper bound of the spectral radius of each (..., k, k) matrix M, so of its largest
    eigenvalue where they are real and >= 0 (module docstring: within k^(1/(2q)) of it for a
    Gram matrix). ``squarings`` 0 gives the Frobenius norm."""
    if squarings < 0:
        raise ValueError(f"squarings {squarings}: must be >= 0")
    if m.shape[-1] != m.shape[-2]:
        raise ValueError(f"eigenvalue_upper: square matrices, got {tuple(m.shape)}")
    tiny = torch.finfo(m.dtype).tiny
    log_scale = m.new_zeros(m.shape[:-2])
    a = m
    for j in range(squarings + 1):
        s = a.square().sum((-2, -1)).clamp_min(tiny).sqrt()  # a sum of squares: no cancelling
        log_scale = log_scale + s.log() / 2.0**j
        if j == squarings:
            break
        a = a / s[..., None, None]
        a = a @ a
    pad = 1.0 + 8.0 * (squarings + 1) * m.shape[-1] * torch.finfo(m.dtype).eps
    return log_scale.exp() * pad


def eigenvalues_upper(ms: Sequence[Tensor], squarings: int = SQUARINGS) -> list[Tensor]:
    """:func:`eigenvalue_upper` of each matrix batch of ``ms`` (any batch shapes), those of one
    size in one batched call: the same values, a few kernels a size instead of a few per
    matrix (a training step's dozens of small norms)."""
    out: list[Tensor | None] = [None] * len(ms)
    for k in sorted({m.shape[-1] for m in ms}):
        idx = [i for i, m in enumerate(ms) if m.shape[-1] == k]
        flat = [ms[i].reshape(-1, k, k) for i in idx]
        tops = eigenvalue_upper(torch.cat(flat), squarings).split([len(f) for f in flat])
        for i, t in zip(idx, tops, strict=True):
            out[i] = t.reshape(ms[i].shape[:-2])
    return out


def gram(a: Tensor) -> Tensor:
    """The smaller Gram matrix of each (..., m, n) matrix A, A A^T or A^T A: its eigenvalues
    are A's squared singular values (and zeros)."""
    return a @ a.transpose(-1, -2) if a.shape[-2] <= a.shape[-1] else a.transpose(-1, -2) @ a


def product_gram(u: Tensor, v: Tensor) -> Tensor:
    """For u (..., n, r), v (..., m, r) (batch dims broadcast), a matrix whose eigenvalues are
    the squared singular values of u v^T (and zeros), without forming u v^T: the r x r product
    (u^T u)(v^T v) when both factors have more than r rows, else the smaller Gram matrix of
    u v^T, u (v^T v) u^T or v (u^T u) v^T."""
    r = u.shape[-1]
    if v.shape[-1] != r:
        raise ValueError(f"product_gram: u {tuple(u.shape)} and v {tuple(v.shape)} differ in "
                         "their inner size")
    if min(u.shape[-2], v.shape[-2]) > r:
        return (u.transpose(-1, -2) @ u) @ (v.transpose(-1, -2) @ v)
    a, b = (v, u) if v.shape[-2] <= u.shape[-2] else (u, v)
    return a @ (b.transpose(-1, -2) @ b) @ a.transpose(-1, -2)
