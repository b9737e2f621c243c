"""OLSA's pure bounds: the attention's Lipschitz constant and the alpha2 that makes it 1-Lipschitz
(derived in :mod:`attncert.text.olsa`), the certified radius from logits, the certificate
regulariser and its weight ramp."""

from __future__ import annotations

import math

import torch
from torch import Tensor
from torch.nn import functional as F

from attncert.training.losses import logit_margin


def _kappa(n: Tensor, d: Tensor) -> Tensor:
    """Max column sum of a row-stochastic n x n matrix whose row scores spread by <= d."""
    return n / (1.0 + (n - 1.0) * torch.exp(-d))


def olsa_alpha2(alpha1: Tensor | float, radius: float, n: Tensor | int) -> Tensor:
    """alpha2 = sqrt(kappa) + R sqrt(n) / (sqrt(2) alpha1) (0 second term at n = 1): with unit
    weight norms this makes :func:`olsa_attention_lipschitz` exactly 1 (module docstring)."""
    return olsa_attention_lipschitz(alpha1, 1.0, radius, n)


def olsa_attention_lipschitz(alpha1: Tensor | float, alpha2: Tensor | float, radius: float,
                             n: Tensor | int, s_q: float = 1.0, s_k: float = 1.0,
                             s_v: float = 1.0) -> Tensor:
    """Lipschitz bound (in ||.||_F) of OLSA attention on n tokens of norm <= R (float64).

    (s_v / alpha2) [ sqrt(kappa) + R sqrt(n) (s_q + s_k) / (2 sqrt 2 alpha1) ],
    kappa = n / (1 + (n - 1) exp(-s_k R / alpha1)); the second term is 0 for n = 1. s_q, s_k,
    s_v bound the spectral norms of W^Q, W^K, W^V (1 when orthogonal). Derivation: module
    docstring. Batched over n (and alpha1, alpha2) by broadcasting.
    """
    # no constant tensor is made from a Python number where a tensor argument exists: under
    # torch.compile such a constant is a host tensor copied to the device at every call, which
    # a CUDA-graph capture of the training step does not allow
    dev = next((t.device for t in (alpha1, n) if isinstance(t, Tensor)), None)
    a1 = _float64(alpha1, dev)
    n = _float64(n, dev)
    kappa = _kappa(n, s_k * radius / a1)
    score = torch.where(n > 1, radius * n.sqrt() * (s_q + s_k) / (2.0 * math.sqrt(2.0) * a1),
                        torch.zeros_like(n))
    return s_v * (kappa.sqrt() + score) / (alpha2.double() if isinstance(alpha2, Tensor)
                                           else float(alpha2))


def _float64(v: Tensor | float, device: torch.device | None) -> Tensor:
    return v.double() if isinstance(v, Tensor) else torch.tensor(float(v), dtype=torch.float64,
                                                                 device=device)


def certified_radius(logits: Tensor, y: Tensor, lipschitz: Tensor | float) -> Tensor:
    """(B,): r = relu(M) / (sqrt(2) Lip), M = f_y - max_{j != y} f_j (docs/math.md section 6).

    0 for a misclassified point: the mean over every point is our average certified radius
    (OLSA sec. 5.1 averages the radius of the prediction, whatever the label: the text stage
    reports both).
    """
    return F.relu(logit_margin(logits.double(), y)) / (math.sqrt(2.0) * torch.as_tensor(
        lipschitz, dtype=torch.float64, device=logits.device))


def certificate_regulariser(logits: Tensor, y: Tensor, lipschitz: Tensor | float,
                            gamma: float) -> Tensor:
    """-gamma mean(relu(M / (sqrt(2) Lip))): OLSA's -gamma relu(M / sqrt 2) (docs/math.md section 7)
    for a network with Lipschitz constant Lip (differentiable in Lip), i.e. the certified radius."""
    margin = logit_margin(logits, y)
    return -gamma * (F.relu(margin) / (math.sqrt(2.0) * lipschitz)).mean()


def gamma_ramp(step: int, total_steps: int, gamma: float, ramp: float = 1.0) -> float:
    """Linear ramp of the regulariser weight: 0 at step 0, ``gamma`` after ``ramp`` x total."""
    if ramp <= 0:
        return gamma
    return gamma * min(1.0, step / max(1.0, ramp * total_steps))
