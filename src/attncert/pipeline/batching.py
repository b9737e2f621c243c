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

import numbers
from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["BatchSize", "in_batches", "set_memory_share", "memory_share", "device_peak"]

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


class BatchSize:
    """The batch size of a loop on ``device``, as :func:`in_batches` sizes it: call
    :meth:`begin` before a batch, :meth:`ran` after one that ran (on a CUDA device a full batch
    doubles the size while twice its peak fits in :func:`memory_share` of the device) and
    :meth:`halve` after ``torch.OutOfMemoryError`` (kept halved, growth stopped). For loops
    whose batches are not consecutive ranges (CROWN's bounds, by radius)."""

    def __init__(self, batch_size: int, what: str = "batch",
                 device: torch.device | str | None = None) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or (
                batch_size < 1):
            raise ValueError(f"{what}: batch size must be an integer >= 1, got {batch_size!r}")
        self.size, self.what = int(batch_size), what
        self._index, self._base = _cuda_index(device), 0

    def begin(self) -> None:
        """Before a batch: its peak memory is measured from here."""
        if self._index is not None:
            self._base = _reset_peak(self._index)

    def ran(self, k: int) -> None:
        """After a batch of ``k`` items ran: a full one grows the size when twice it fits."""
        if self._index is None or k != self.size:
            return
        used = torch.cuda.max_memory_allocated(self._index) - self._base
        total = torch.cuda.get_device_properties(self._index).total_memory
        if self._base + 2 * used <= _share * total:
            self.size *= 2

    def halve(self, k: int) -> bool:
        """After a batch of ``k`` items ran out of device memory: False when ``k`` is 1 (the
        error stands), else the cached memory freed, the size halved and kept (printed)."""
        if k <= 1:
            return False
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.size, self._index = max(1, k // 2), None
        print(f"{self.what}: out of device memory at batch {k}; retrying with {self.size}")
        return True


def in_batches(n: int, batch_size: int | BatchSize, run: Callable[[int, int], T],
               what: str = "batch", device: torch.device | str | None = None,
               done: Callable[[int], object] | None = None) -> list[T]:
    """``[run(start, stop) for consecutive [start, stop) covering range(n)]``, in batches of
    ``batch_size``: on a CUDA ``device`` doubled after a full batch while twice its peak fits
    in :func:`memory_share` of the device, halved (and kept halved) on
    ``torch.OutOfMemoryError`` (:class:`BatchSize`). A :class:`BatchSize` passed as
    ``batch_size`` carries its size from one loop to the next (an audit's radii: each starts
    where the last left off; its own ``what`` and device then apply). ``done(k)`` is called
    after each batch of k items (a progress bar's update)."""
    size = (batch_size if isinstance(batch_size, BatchSize)
            else BatchSize(batch_size, what, device))
    out, start = [], 0
    while start < n:
        stop = min(start + size.size, n)
        size.begin()
        try:
            out.append(run(start, stop))
        except torch.OutOfMemoryError:
            if not size.halve(stop - start):
                raise
            continue
        size.ran(stop - start)
        if done is not None:
            done(stop - start)
        start = stop
    return out
