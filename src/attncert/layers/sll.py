"""SDP-based Lipschitz Layer, residual form (Araujo et al. 2023, official formula)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

_TINY = 1e-12


class SLLResidual(nn.Module):
    """z = x - 2 W^T diag(t) relu(W x + b), t_i = 1 / sum_j |exp(-q_i) (W W^T)_ij exp(q_j)|.

    W: (hidden, dim), b, q: (hidden,), all trainable. 1-Lipschitz for every W, b, q
    (docs/math.md section 5). Acts on the last dimension, so token-wise on (B, n, dim).
    """

    lipschitz = 1.0

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden, dim))
        self.bias = nn.Parameter(torch.zeros(hidden))
        self.q = nn.Parameter(torch.zeros(hidden))
        nn.init.xavier_normal_(self.weight)

    def compute_t(self) -> Tensor:
        """(hidden,): t_i = 1 / sum_j |exp(-q_i) (W W^T)_ij exp(q_j)| (SLL Theorem 3)."""
        gram = self.weight @ self.weight.T
        scaled = torch.exp(-self.q)[:, None] * gram * torch.exp(self.q)[None, :]
        return 1.0 / (scaled.abs().sum(dim=1) + _TINY)  # the pad only shrinks t: still sound

    def forward(self, x: Tensor) -> Tensor:
        res = F.relu(F.linear(x, self.weight, self.bias)) * self.compute_t()
        return x - 2.0 * res @ self.weight  # z = x - 2 W^T diag(t) relu(W x + b)
