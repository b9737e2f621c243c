"""Global Lipschitz bounds and composition rules (docs/math.md section 4)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "GELU_LIPSCHITZ",
    "gelu_lipschitz",
    "kim_l2_attention_lipschitz",
    "olsa_layer_lipschitz",
    "olsa_alpha2",
    "compose",
    "residual",
    "averaged_residual",
]


def gelu_lipschitz() -> float:
    """max_x |GELU'(x)|, GELU'(x) = Phi(x) + x phi(x).

    GELU''(x) = phi(x) (2 - x^2) vanishes at x = +-sqrt(2); the maximum is at sqrt(2)
    (|GELU'(-sqrt(2))| = Phi(-sqrt 2) - sqrt 2 phi(sqrt 2) is smaller in modulus).
    """
    x = math.sqrt(2.0)
    phi = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
    big_phi = 0.5 * (1 + math.erf(x / math.sqrt(2)))
    return big_phi + x * phi


GELU_LIPSCHITZ = gelu_lipschitz()  # ~1.1289, not CertViT's 1.12


def kim_l2_attention_lipschitz(wq: Tensor, wv: Tensor, wo: Tensor, n: int) -> float:
    """Kim et al. (2021) Theorem 3.2 as written in docs/math.md section 4 (queries tied to keys):

    Lip_2(F) <= sqrt(N / d_h) (4 W0((N-1)/e) + 1) sqrt(sum_h ||W^{Q,h}||^2 ||W^{V,h}||^2) ||W^O||.

    wq, wv: (h, d, d_h); wo: (h, d_h, d) per head or the concatenated (h d_h, d) matrix; its
    full spectral norm is used. Valid for Kim's L2-MHA, where head h outputs
    P^h X A_h W^{V,h} with A_h = W^{Q,h} W^{Q,h}^T / sqrt(d_h); see tests/test_global_bounds.py
    for its reach (the ||W^Q|| exponent: it needs ||W^{Q,h}|| <= 1 to dominate the linear part).
    """
    from scipy.special import lambertw  # scipy: imported where used, not by every stage

    if n < 1:
        raise ValueError("n must be >= 1")
    d_h = wq.shape[-1]
    w0 = float(lambertw((n - 1) / math.e).real) if n > 1 else 0.0
    q = torch.linalg.matrix_norm(wq.double(), 2)
    v = torch.linalg.matrix_norm(wv.double(), 2)
    wo_cat = wo.reshape(-1, wo.shape[-1]).double()
    o = float(torch.linalg.matrix_norm(wo_cat, 2))
    heads = float(((q * v) ** 2).sum().sqrt())
    return math.sqrt(n / d_h) * (4 * w0 + 1) * heads * o


def olsa_alpha2(alpha1: float, c: float, n: int, softmax_constant: float = 0.5) -> float:
    """alpha2 = 1 + c sqrt(N) s / alpha1: makes OLSA 1-Lipschitz (s: softmax constant)."""
    return 1.0 + c * math.sqrt(n) * softmax_constant / alpha1


def olsa_layer_lipschitz(
    alpha1: float,
    alpha2: float,
    c: float,
    n: int,
    softmax_constant: float = 0.5,
    allow_unsound: bool = False,
) -> float:
    """OLSA Theorem 4.1: Lip(F) <= (1/alpha2) (1 + c sqrt(N) s / alpha1), ||X||_F, ||X'||_F <= c.

    s = 1/2 is the softmax Lipschitz constant (sound). The paper's proof uses s = 1/4, which
    is UNSOUND (diag(p) - p p^T has eigenvalue 1/2 at p = (1/2, 1/2)); it is only accepted
    with allow_unsound=True, for comparison with the paper.
    """
    if softmax_constant < 0.5 and not allow_unsound:
        raise ValueError(
            "softmax constants below 1/2 are unsound; pass allow_unsound=True "
            "to reproduce the paper's 1/4 form"
        )
    return (1.0 + c * math.sqrt(n) * softmax_constant / alpha1) / alpha2


def compose(*lips: float) -> float:
    """Lip(f_1 o ... o f_k) <= prod Lip(f_i)."""
    return math.prod(lips)


def residual(lip: float) -> float:
    """Lip(x + f(x)) <= 1 + Lip(f)."""
    return 1.0 + lip


def averaged_residual(lip: float) -> float:
    """Lip(0.5 x + 0.5 f(x)) <= 0.5 + 0.5 Lip(f)."""
    return 0.5 + 0.5 * lip
