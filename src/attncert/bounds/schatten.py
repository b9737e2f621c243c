"""Upper bounds of spectral norms by matrix products only: Schatten norms of high order.

The training surrogate of the ``lofast`` margin (:mod:`attncert.training.certified_training`)
differentiates dozens of small spectral norms a step. An eigensolver or an SVD gives them
exactly, but on CUDA each reads its status on the host, so a step holding one cannot be
replayed as a CUDA graph, and a batch of small solves is slow there. These bounds need no
solver: for a matrix M whose eigenvalues lambda_i are real and >= 0 (a Gram matrix A A^T, or
a product G_u G_v of two, which has the eigenvalues of G_v^(1/2) G_u G_v^(1/2): AB and BA
share their characteristic polynomial),

    lambda_max(M) <= (tr M^q)^(1/q) <= k^(1/q) lambda_max(M),   q = 2^t, M of size k x k,

reached by t squarings. Each squaring divides the matrix by its trace first (the trace of a
power of M is the sum of the lambda_i's powers, > 0 unless M = 0), and the logarithms of the
traces accumulate the scale, so nothing overflows; the eigenvalues far below the largest
underflow to 0, which lowers the sum by less than the rounding of its largest term, and the
result is padded by 8 (t + 1) k rounding units against the products' rounding. With
t = :data:`SQUARINGS` the bound of a singular value (the square root) is above it by at most
a factor k^(2^-(t+1)): 0.3% at k = 4, 0.7% at k = 32, 1.2% at k = 384. Differentiable
everywhere but at M = 0, also at repeated and zero eigenvalues (where an eigensolver's
derivative is not), and elementwise plus batched products, so ``torch.compile`` fuses it and a
CUDA graph holds it.

These are training bounds: the certificates take exact norms (:mod:`attncert.bounds.spectral`).
The bound holds in exact arithmetic; computed, it is one up to the products' rounding: 1e-12
relative in float64 (``tests/test_certified_training.py`` checks it against the certifier),
1e-7 in float32, and where TF32 is on (a GPU's training step) 5e-4, beyond the padding, which
a training signal can bear and a certificate could not. docs/math.md section 7.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["SQUARINGS", "eigenvalue_upper", "eigenvalues_upper", "gram", "product_gram"]

#: squarings t of the training surrogate's norms: the order q = 2^t of the Schatten norm of
#: the squared singular values (module docstring)
SQUARINGS = 8


def eigenvalue_upper(m: Tensor, squarings: int = SQUARINGS) -> Tensor:
    """(...,): (tr M^q)^(1/q), q = 2^squarings, padded by 8 (squarings + 1) k rounding units,
    an upper bound of the largest eigenvalue of each (..., k, k) matrix M whose eigenvalues are
    real and >= 0 (module docstring), above it by at most a factor k^(1/q) and the padding.
    ``squarings`` 0 gives the trace."""
    if squarings < 0:
        raise ValueError(f"squarings {squarings}: must be >= 0")
    if m.shape[-1] != m.shape[-2]:
        raise ValueError(f"eigenvalue_upper: square matrices, got {tuple(m.shape)}")
    tiny = torch.finfo(m.dtype).tiny
    log_scale = m.new_zeros(m.shape[:-2])
    a = m
    for j in range(squarings + 1):
        s = a.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(tiny)
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
