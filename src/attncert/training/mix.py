"""Mixup (Zhang et al. 2018) and CutMix (Yun et al. 2019) on training batches, per batch.

A batch is mixed with probability ``mix_prob``; a mixed batch is paired with itself reversed
(example i with example B-1-i) and takes one coefficient lam drawn from Beta(alpha, alpha):

* Mixup:  x = lam x + (1 - lam) x_rev;
* CutMix: a box of area (1 - lam) H W (side ratio sqrt(1 - lam), centre uniform over the
  image, clipped to it) is pasted from x_rev, and lam becomes the share of the image left
  uncovered (the box can be clipped);

and the loss is lam CE(f(x), y) + (1 - lam) CE(f(x), y_rev). With both alphas > 0, CutMix is
chosen with probability ``mix_switch_prob``. This is the "batch" mode of common ViT recipes
(timm's Mixup with mode "batch", pairs by reversal).

Every random choice of an epoch (mixed or not, which method, lam, the box) is drawn on the
host when the epoch is planned, from a generator seeded by the run's seed and the epoch: a
resumed epoch mixes exactly as the uninterrupted one, on any device, and applying a mix to a
batch needs no random numbers and no host synchronisation (Python numbers and slices only).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from torch import Tensor

__all__ = ["Mix", "MixSpec", "apply", "plan_epoch"]

#: mixes a generator stream apart from the epoch's other draws
_STREAM = 0x4D4958


@dataclass(frozen=True)
class MixSpec:
    """Mixup / CutMix settings (module docstring); mixing is off when ``mix_prob`` is 0."""

    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    mix_prob: float = 0.0
    mix_switch_prob: float = 0.5

    def __post_init__(self) -> None:
        for name in ("mixup_alpha", "cutmix_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise ValueError(f"{name} must be a number >= 0, got {v!r}")
        for name in ("mix_prob", "mix_switch_prob"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v <= 1:
                raise ValueError(f"{name} must be a number in [0, 1], got {v!r}")
        if self.mix_prob > 0 and self.mixup_alpha == 0 and self.cutmix_alpha == 0:
            raise ValueError(f"mix_prob {self.mix_prob} needs mixup_alpha or cutmix_alpha > 0")

    @property
    def enabled(self) -> bool:
        return self.mix_prob > 0


@dataclass(frozen=True)
class Mix:
    """One batch's mix: ``lam`` of the batch's own labels; ``box`` (top, bottom, left, right)
    for CutMix, None for Mixup."""

    lam: float
    box: tuple[int, int, int, int] | None = None


def plan_epoch(spec: MixSpec, n_batches: int, height: int, width: int, seed: int,
               epoch: int) -> list[Mix | None]:
    """Each batch's :class:`Mix` (None: not mixed) for one epoch of ``n_batches`` batches of
    ``height`` x ``width`` images, drawn on the host from (``seed``, ``epoch``)."""
    if not spec.enabled:
        return [None] * n_batches
    g = np.random.default_rng([seed, epoch, _STREAM])
    out: list[Mix | None] = []
    for _ in range(n_batches):
        mixed = g.random() < spec.mix_prob
        use_cutmix = spec.cutmix_alpha > 0 and (
            spec.mixup_alpha == 0 or g.random() < spec.mix_switch_prob)
        alpha = spec.cutmix_alpha if use_cutmix else spec.mixup_alpha
        lam = float(g.beta(alpha, alpha))
        centre = (int(g.integers(height)), int(g.integers(width)))
        if not mixed:
            out.append(None)
        elif use_cutmix:
            out.append(_cutmix(lam, centre, height, width))
        else:
            out.append(Mix(lam))
    return out


def _cutmix(lam: float, centre: tuple[int, int], height: int, width: int) -> Mix:
    """The box of area about (1 - lam) H W at ``centre``, clipped, and the uncovered share."""
    ratio = math.sqrt(1.0 - lam)
    half_h, half_w = int(height * ratio) // 2, int(width * ratio) // 2
    top, bottom = max(centre[0] - half_h, 0), min(centre[0] + half_h, height)
    left, right = max(centre[1] - half_w, 0), min(centre[1] + half_w, width)
    covered = (bottom - top) * (right - left) / (height * width)
    return Mix(1.0 - covered, (top, bottom, left, right))


def apply(x: Tensor, y: Tensor, mix: Mix) -> tuple[Tensor, Tensor]:
    """(mixed images, partner labels) of a batch x (B, C, H, W) with labels y: the partner of
    example i is example B-1-i (module docstring). ``x`` is not modified."""
    partner = x.flip(0)
    if mix.box is None:
        return mix.lam * x + (1.0 - mix.lam) * partner, y.flip(0)
    top, bottom, left, right = mix.box
    out = x.clone()
    out[..., top:bottom, left:right] = partner[..., top:bottom, left:right]
    return out, y.flip(0)
