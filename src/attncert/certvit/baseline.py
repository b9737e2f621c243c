"""The trivial baseline beside the constrained ViTs: a linear classifier on pixels.

f(x) = W x + b on the flattened image in [0, 1], with unit rows (w_j / ||w_j||, as the
spectral mode's head). Its features are the pixels (Lipschitz constant 1), so the pairwise
test r(x) = min_{j != y} (f_y - f_j) / ||w_y - w_j|| is exact for it: the l2 distance from x to
the nearest decision boundary of f in R^d. It trains with the same loss and schedule as the
spectral mode's fine-tune and is certified and audited by the same code
(:func:`attncert.certvit.certificate.certify_pairwise`).

A certifiable ViT is worth its cost where it beats this line; where it does not, the
transformer adds nothing certifiable at that eps. With a patch embedding shared by every
patch, a ViT's linear part sees each patch through the same map (position enters only through
the additive position embeddings and the nonlinear blocks), whereas this model weighs every
pixel where it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.certvit.certificate import certify_pairwise
from attncert.pipeline import rng

__all__ = ["PixelLinear", "PixelLinearConfig", "certify_linear"]


@dataclass(frozen=True)
class PixelLinearConfig:
    """What a :class:`PixelLinear` is (its checkpoints are keyed on it, as a ViT's on its
    ``ViTConfig``)."""

    in_features: int
    num_classes: int

    def __post_init__(self) -> None:
        if self.in_features <= 0 or self.num_classes < 2:
            raise ValueError(f"PixelLinear needs in_features > 0 and >= 2 classes, got "
                             f"{self.in_features}, {self.num_classes}")

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "pixel_linear", **asdict(self)}


class PixelLinear(nn.Module):
    """(B, C, H, W) pixels in [0, 1] -> logits W x + b with unit rows; ``in_features`` =
    C H W. The initial rows are drawn from ``seed`` (a generator on the CPU, where the module
    is built)."""

    def __init__(self, in_features: int, num_classes: int, seed: int = 0):
        super().__init__()
        self.config = PixelLinearConfig(in_features, num_classes)
        self.head = nn.Linear(in_features, num_classes)
        with torch.no_grad():
            g = rng.generator(seed, "cpu")
            self.head.weight.copy_(torch.randn(self.head.weight.shape, generator=g) * 0.01)
            self.head.bias.zero_()

    def head_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """(num_classes, in_features): the unit rows the model applies, in ``dtype`` (default:
        the weight's) and normalised in it (float64: the rows of the certificate's copy)."""
        w = self.head.weight if dtype is None else self.head.weight.to(dtype)
        return w / w.norm(dim=1, keepdim=True).clamp_min(1e-12)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x.flatten(1), self.head_weight(), self.head.bias)


def certify_linear(model: PixelLinear, x: Tensor, y: Tensor, eps_grid: Sequence[float],
                   attack_steps: int = 0, attack_restarts: int = 1, batch_size: int = 256,
                   seed: int = 0, n_attack: int | None = None,
                   attack_batch_size: int | None = None) -> dict:
    """The exact pairwise radius of every point and the report of
    :func:`attncert.certvit.certify` (same keys; ``lipschitz`` 1 in place of ``bound``)."""
    if not isinstance(model, PixelLinear):
        raise ValueError(f"expected a PixelLinear, got {type(model).__name__}")
    model.eval()
    with torch.no_grad():
        rows = model.head_weight(torch.float64).detach()  # those of the float64 forward
    return certify_pairwise(model, x, y, rows, 1.0, eps_grid, attack_steps, attack_restarts,
                            batch_size, seed, n_attack=n_attack,
                            attack_batch_size=attack_batch_size) | {"lipschitz": 1.0}
