"""Batched loops sized to the device: grown to a share of a CUDA device's memory, halved on a
CUDA out-of-memory error.

Certificates, attacks and audits are evaluated batch by batch. The study's models are small,
so on a GPU a batch of the size a params file names (chosen to fit a laptop) is a few thousand
short kernels that leave the device idle between launches; :func:`in_batches` therefore
doubles the batch after a batch whose peak memory shows that twice as many images fit in
``base.batch_memory`` (a share of the device's memory; :func:`set_memory_share`, 0: the
params' sizes as they are). On the CPU the batch never grows. The other way, when a batch
does not fit (a ViT-B/16 audit at 224 pixels), it frees the cached memory, halves the batch
and retries the same images; a single image that does not fit still raises. A halving is
printed and kept for the rest of the loop (and stops the growth). Results do not depend on the
batch (every computation here is per-sample), except that an attack batch of other images
draws other random starts.

A batch's peak is measured by resetting CUDA's peak-memory counter; the peak seen before each
reset is kept, and :func:`device_peak` (what a stage reports as its GPU peak) includes it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["in_batches", "set_memory_share", "memory_share", "device_peak"]

T = TypeVar("T")

_share = 0.0
#: per CUDA device index: the largest peak seen before the counter was reset here
_peak_before_reset: dict[int, int] = {}


def set_memory_share(share: float) -> None:
    """The share of a CUDA device's memory a batch may grow to (``base.batch_memory``)."""
    global _share
    if isinstance(share, bool) or not 0 <= share < 1:
        raise ValueError(f"base.batch_memory: a share of the device's memory in [0, 1), got "
                         f"{share!r}")
    _share = float(share)


def memory_share() -> float:
    return _share


def device_peak(index: int) -> int:
    """Peak CUDA memory allocated on device ``index`` by this process (bytes), across the
    resets :func:`in_batches` makes to measure its batches."""
    return max(torch.cuda.max_memory_allocated(index), _peak_before_reset.get(index, 0))


def _cuda_index(device: torch.device | str | None) -> int | None:
    """The CUDA device a loop runs on when its batches may grow there, else None."""
    if device is None or _share <= 0 or not torch.cuda.is_available():
        return None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_device() if device.index is None else device.index


def _reset_peak(index: int) -> int:
    """Reset the device's peak counter (keeping what it held); the memory allocated now."""
    _peak_before_reset[index] = device_peak(index)
    torch.cuda.reset_peak_memory_stats(index)
    return torch.cuda.memory_allocated(index)


def in_batches(n: int, batch_size: int, run: Callable[[int, int], T], what: str = "batch",
               device: torch.device | str | None = None,
               done: Callable[[int], object] | None = None) -> list[T]:
    """``[run(start, stop) for consecutive [start, stop) covering range(n)]``, in batches of
    ``batch_size``: on a CUDA ``device`` doubled while twice a batch's peak fits in
    :func:`memory_share` of the device, halved (and kept halved) on
    ``torch.OutOfMemoryError``. ``done(k)`` is called after each batch of k items (a
    progress bar's update)."""
    if batch_size < 1:
        raise ValueError(f"{what}: batch size must be >= 1, got {batch_size}")
    index = _cuda_index(device)
    out, start = [], 0
    while start < n:
        stop = min(start + batch_size, n)
        base = _reset_peak(index) if index is not None else 0
        try:
            out.append(run(start, stop))
        except torch.OutOfMemoryError:
            if stop - start == 1:
                raise
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            batch_size, index = max(1, (stop - start) // 2), None
            print(f"{what}: out of device memory at batch {stop - start}; retrying with "
                  f"{batch_size}")
            continue
        if index is not None and stop - start == batch_size and stop < n:
            used = torch.cuda.max_memory_allocated(index) - base
            total = torch.cuda.get_device_properties(index).total_memory
            if base + 2 * used <= _share * total:
                batch_size *= 2
        if done is not None:
            done(stop - start)
        start = stop
    return out
