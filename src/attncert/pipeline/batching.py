"""Batched loops that survive a CUDA out-of-memory error by halving the batch.

Certificates, attacks and audits are evaluated batch by batch; on a GPU the batch a params
file names may not fit next to a large model (a ViT-B/16 audit at 224 pixels). Rather than
lose the stage, :func:`in_batches` frees the cached memory, halves the batch and retries the
same images; a single image that does not fit still raises. The halving is printed and kept
for the rest of the loop. Results do not depend on the batch (every computation here is
per-sample), except that a retried attack batch draws new random starts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def in_batches(n: int, batch_size: int, run: Callable[[int, int], T], what: str = "batch"
               ) -> list[T]:
    """``[run(start, stop) for consecutive [start, stop) covering range(n)]``, in batches of
    ``batch_size``, halved (and kept halved) on ``torch.OutOfMemoryError``."""
    if batch_size < 1:
        raise ValueError(f"{what}: batch size must be >= 1, got {batch_size}")
    out, start = [], 0
    while start < n:
        stop = min(start + batch_size, n)
        try:
            out.append(run(start, stop))
        except torch.OutOfMemoryError:
            if stop - start == 1:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            batch_size = max(1, (stop - start) // 2)
            print(f"{what}: out of device memory at batch {stop - start}; retrying with "
                  f"{batch_size}")
            continue
        start = stop
    return out
