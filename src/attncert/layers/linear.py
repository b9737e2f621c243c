"""Linear maps with spectral norm <= gamma: AOL/SDP rescaling (docs/math.md section 5), and the
orthogonal map scaled by gamma (every singular value exactly gamma)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

_TINY = 1e-12


class NormConstrainedLinear(nn.Module):
    """y = gamma W diag(sqrt(t)) x (+ b), t_j = 1 / sum_i |(W^T W)_ij|: spectral norm <= gamma.

    ``weight`` is the free parameter (out, in) like nn.Linear; :meth:`weight_effective` is the
    matrix actually applied, for bounds and diagnostics.
    """

    def __init__(self, in_features: int, out_features: int, gamma: float = 1.0,
                 bias: bool = True):
        super().__init__()
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got {gamma!r}")
        self.in_features, self.out_features, self.gamma = in_features, out_features, float(gamma)
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.orthogonal_(self.weight)

    def compute_t(self) -> Tensor:
        """(in,): t_j = 1 / sum_i |(W^T W)_ij| (AOL rescaling)."""
        gram = self.weight.T @ self.weight
        return 1.0 / (gram.abs().sum(dim=0) + _TINY)  # the pad only shrinks t: still sound

    def weight_effective(self) -> Tensor:
        """(out, in): gamma W diag(sqrt(t)), spectral norm <= gamma."""
        return self.gamma * self.weight * self.compute_t().sqrt()[None, :]

    @property
    def lipschitz(self) -> float:
        """The claimed bound gamma (use an exact SVD of weight_effective() for the actual norm)."""
        return self.gamma

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_effective(), self.bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"gamma={self.gamma:g}, bias={self.bias is not None}")


class OrthogonalLinear(nn.Module):
    """y = gamma Q x, Q = exp(S - S^T) orthogonal (dim x dim, no bias): every singular value is
    gamma, so the map can neither grow past gamma nor shrink to zero.

    The skew generator ``skew`` is the free parameter, initialised at random so that Q starts as
    a random rotation; Q is recomputed from it in the parameter's dtype (orthogonal to that
    precision: the bounds still take norms of :meth:`weight_effective`, never ``gamma``).
    """

    def __init__(self, dim: int, gamma: float = 1.0, init_scale: float = 1.0):
        super().__init__()
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got {gamma!r}")
        self.in_features = self.out_features = dim
        self.gamma = float(gamma)
        self.skew = nn.Parameter(torch.randn(dim, dim) * (init_scale / dim ** 0.5))
        self.bias = None

    def weight_effective(self) -> Tensor:
        """(dim, dim): gamma exp(S - S^T)."""
        return self.gamma * torch.linalg.matrix_exp(self.skew - self.skew.T)

    @property
    def lipschitz(self) -> float:
        return self.gamma

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_effective())

    def extra_repr(self) -> str:
        return f"dim={self.in_features}, gamma={self.gamma:g} (orthogonal)"
