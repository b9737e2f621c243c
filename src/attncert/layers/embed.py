"""Patch embedding: one linear map per disjoint patch (docs/math.md section 5)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .linear import NormConstrainedLinear

# exact SVD in float64 is accurate to a few ulps; this relative pad makes the reported
# constant an upper bound on the float64 spectral norm.
SVD_PAD = 1e-10


def spectral_norm_exact(w: Tensor) -> float:
    """Largest singular value by exact SVD in float64, padded by a relative SVD_PAD."""
    return float(torch.linalg.svdvals(w.detach().double()).max()) * (1.0 + SVD_PAD)


def patchify(x: Tensor, patch: int) -> Tensor:
    """(B, C, H, W) -> (B, n, C*patch*patch), patches row-major, each flattened (c, i, j)."""
    b, c, h, w = x.shape
    if h % patch or w % patch:
        raise ValueError(f"image {h}x{w} does not split into {patch}x{patch} patches")
    x = x.reshape(b, c, h // patch, patch, w // patch, patch)
    return x.permute(0, 2, 4, 1, 3, 5).reshape(b, (h // patch) * (w // patch), c * patch * patch)


class PatchEmbed(nn.Module):
    """Tokens E p_i + b for every patch p_i. Lipschitz constant = ||E|| (disjoint patches).

    ``lipschitz=True``: E is a NormConstrainedLinear with gamma 1, so ||E|| <= 1 by construction.
    """

    def __init__(self, channels: int, patch: int, dim: int, lipschitz: bool):
        super().__init__()
        self.patch = patch
        fan_in = channels * patch * patch
        self.proj = (NormConstrainedLinear(fan_in, dim, gamma=1.0, bias=True) if lipschitz
                     else nn.Linear(fan_in, dim))

    def per_patch_matrix(self) -> Tensor:
        """(dim, C*patch*patch): the matrix applied to each flattened patch."""
        p = self.proj
        return p.weight_effective() if hasattr(p, "weight_effective") else p.weight

    def compute_lipschitz(self) -> float:
        """||E||_2 of the per-patch matrix, exact SVD (sound)."""
        return spectral_norm_exact(self.per_patch_matrix())

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(patchify(x, self.patch))
