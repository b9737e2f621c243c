"""A routing task that a token-wise model cannot solve, composed from an image dataset.

Each composed image has the source's size and four quadrants: the top-left one holds a marker
(a bright bar at one of three heights), the other three hold three images of the source
(downsampled 2x, drawn at random), and the label is the class of the image in the quadrant the
marker points to (1: top right, 2: bottom left, 3: bottom right). At a patch of half the
image, each quadrant is one token.

Why attention must matter: a model whose logits are a sum over tokens of a function of each
token and its position (identity attention over a token-wise network) cannot route: the
marker's term cannot change which digit's term counts. Guessing among the three digits
present is the best such a model can do (about 40% on MNIST with ten classes, more with
repeated classes), while a model that attends from the marker to the marked quadrant can
reach the source task's accuracy. Uniform attention is not token-wise: every token receives
the mean of all of them, marker included, so the blocks after it can gate a digit's term by
the marker, and a model can partly route with a mean alone (the frontier study measures how
far: docs/attention.md). The uniform-attention gap measures whether the trained pattern
matters; the identity gap, whether any mixing does.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from attncert.pipeline import rng

__all__ = ["MARKER_ROWS", "compose", "marker_of", "routed_stats"]

#: the first row of the marker's bar (3 rows high) in a 14-row quadrant, per marked quadrant
#: 1-3, scaled to the quadrant's height
MARKER_ROWS = (2 / 14, 6 / 14, 10 / 14)


def compose(part: Mapping[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """As many routed images as ``part`` ({"x": (N, C, H, W) uint8, "y": (N,)}) holds, each of
    three of its images (drawn with replacement, seeded) and a marker; {"x", "y"}."""
    x, y = part["x"], part["y"]
    if x.dim() != 4 or x.dtype != torch.uint8 or x.shape[-1] != x.shape[-2] or x.shape[-1] % 4:
        raise ValueError(f"routing needs square uint8 images (N, C, H, H), H a multiple of 4; "
                         f"got {tuple(x.shape)} {x.dtype}")
    n, c, h = len(y), x.shape[1], x.shape[-1]
    q = h // 2
    g = rng.generator(seed, "cpu")
    pick = torch.randint(0, n, (n, 3), generator=g)
    marked = torch.randint(0, 3, (n,), generator=g)
    small = torch.nn.functional.avg_pool2d(x.float(), 2).round().to(torch.uint8)
    img = torch.zeros(n, c, h, h, dtype=torch.uint8)
    bar = max(1, round(3 * q / 14))
    for k, top in enumerate(MARKER_ROWS):
        r0 = round(top * q)
        img[marked == k, :, r0:r0 + bar, 1:q - 1] = 255
    for j, (r, col) in enumerate(((0, q), (q, 0), (q, q))):
        img[:, :, r:r + q, col:col + q] = small[pick[:, j]]
    return {"x": img, "y": y[pick[torch.arange(n), marked]]}


def marker_of(x: torch.Tensor) -> torch.Tensor:
    """(N,) the quadrant (0-2: top right, bottom left, bottom right) each composed image's
    marker points to: the height of the brightest row band of its top-left quadrant."""
    q = x.shape[-1] // 2
    rows = x[:, :, :q, :q].float().mean((1, 3))  # (N, q)
    starts = torch.tensor([round(t * q) for t in MARKER_ROWS])
    return rows[:, starts].argmax(1)


def routed_stats(train: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """Per-channel mean and std of the composed training images (in [0, 1])."""
    x = train["x"].float() / 255
    return {"mean": x.mean((0, 2, 3)).tolist(), "std": x.std((0, 2, 3)).tolist()}
