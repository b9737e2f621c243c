"""SpecFormer's local Lipschitz bound (SpecFormer Thm 4.3; LoFAST app. A; docs/math.md sec. 3)."""

from __future__ import annotations

import torch
from torch import Tensor

from .lofast import as_eps
from .spectral import fp_pad
from .weights import AttentionWeights

__all__ = ["specformer_bound"]


def _norms(t: Tensor) -> Tensor:
    return fp_pad(torch.linalg.matrix_norm(t, 2), t.shape[-1] + t.shape[-2])


def specformer_bound(x: Tensor, w: AttentionWeights, eps: float | Tensor, residual: bool) -> Tensor:
    """(B,): delta_spec = (||H|| + sum_l ||W_l^O|| Lip_l) eps, with
    Lip_l = N (N+1) (||X||_F + eps)^2 [||W_l^V|| ||W_l^Q|| ||W_l^K|| + ||W_l^V||].
    """
    w = w.like(x)
    e = as_eps(eps, x)
    n = x.shape[1]
    q, k, v, o = (_norms(t) for t in (w.wq, w.wk, w.wv, w.wo))  # (h,)
    radius = (torch.linalg.matrix_norm(x, "fro") + e) ** 2  # (B,)
    lip = n * (n + 1) * radius[:, None] * (v * q * k + v)  # (B, h)
    return ((1.0 if residual else 0.0) + (o * lip).sum(-1)) * e
