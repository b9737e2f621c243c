"""LayerProject: per-token projection onto the l2 ball of radius R (LoFAST eq. 29)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

_TINY = 1e-12


class LayerProject(nn.Module):
    """x if ||x||_2 <= R else R x / ||x||_2, per token (last dimension).

    A projection onto a convex set, hence 1-Lipschitz per token and in ||.||_F on the token
    matrix. ``radius = inf`` is the identity. Note the factor R: dividing by ||x|| alone
    (the pre-release LoFAST code) is only right for R = 1.
    """

    lipschitz = 1.0

    def __init__(self, radius: float):
        super().__init__()
        if not radius > 0:
            raise ValueError(f"LayerProject radius must be > 0, got {radius!r}")
        self.radius = float(radius)

    def compute_scale(self, x: Tensor) -> Tensor:
        """min(1, R / ||x||_2) per token, shape x.shape[:-1] + (1,)."""
        if math.isinf(self.radius):
            return torch.ones_like(x[..., :1])
        norm = x.norm(dim=-1, keepdim=True).clamp_min(_TINY)
        return (self.radius / norm).clamp(max=1.0)

    def forward(self, x: Tensor) -> Tensor:
        return x * self.compute_scale(x)  # eq. 29

    def extra_repr(self) -> str:
        return f"radius={self.radius:g}"


def project_local_lipschitz(x: Tensor, radius: float, eps: Tensor | float) -> Tensor:
    """(B,) float64 local Lipschitz factor of LayerProject(radius) at the clean tokens x
    (B, n, d) for perturbations ||X' - X||_F <= eps (B,): R / (rho - eps) where
    rho - eps > R, rho = min_i ||x_i||, else 1 (the global constant).

    Why: when rho - eps > R every token x_i and its perturbed x_i' lie outside the ball, where
    the projection is x -> R x / ||x||, and ||x / ||x|| - y / ||y|| || <= ||x - y|| /
    sqrt(||x|| ||y||) (expand both squares: ||x - y||^2 >= ||x|| ||y|| (2 - 2 cos)), so token i
    moves by at most R ||x_i' - x_i|| / (rho - eps); summing squares over the tokens gives
    the factor for the whole matrix. Increasing in eps, so bisection over eps stays exact.
    """
    rho = x.detach().double().norm(dim=-1).amin(dim=-1)
    e = torch.as_tensor(eps, dtype=torch.float64, device=rho.device)
    gap = rho - e
    if math.isinf(radius):
        return torch.ones_like(gap)
    return torch.where(gap > radius, radius / gap.clamp_min(_TINY), torch.ones_like(gap))
