"""Input normalisation inside the model, so eps stays in pixel space (docs/math.md section 5)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class Normalize(nn.Module):
    """(x - mean) / std per channel on (B, C, H, W); Lipschitz constant 1 / min(std)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        super().__init__()
        if len(mean) != len(std) or min(std) <= 0:
            raise ValueError(f"need one positive std per mean, got mean={mean}, std={std}")
        self.register_buffer("mean", torch.tensor(list(mean), dtype=torch.float32).view(-1, 1, 1))
        self.register_buffer("std", torch.tensor(list(std), dtype=torch.float32).view(-1, 1, 1))

    def compute_lipschitz(self) -> float:
        """1 / min(std), from the stored (float32) std, in float64."""
        return float(1.0 / self.std.double().min())

    @property
    def lipschitz(self) -> float:
        return self.compute_lipschitz()

    def forward(self, x: Tensor) -> Tensor:
        return (x - self.mean) / self.std
