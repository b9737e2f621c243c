"""Numeric precision: reduced precision in training only, never in a certificate.

``base.precision`` (one value for every training loop of the pipeline):

* ``bf16``: the training forward pass and loss run under ``torch.autocast`` with bfloat16;
  on CUDA the float32 matmuls left outside autocast (backward, optimizer) may use TF32;
* ``tf32``: float32 with TF32 matmuls (CUDA; plain float32 elsewhere);
* ``fp32``: plain float32;
* ``auto``: ``bf16`` on CUDA, ``fp32`` on any other device (CPU runs stay as reproducible
  as before: autocast on a CPU changes the numbers for little gain).

Weights and optimizer state stay float32 in every mode (bfloat16 needs no loss scaling).
Certificates run in float64 and refuse to run under autocast or with TF32 allowed
(:func:`require_full_precision`); PGD audits attack in float32 (TF32 on CUDA,
:func:`attack_matmuls`) and re-check every success in the certificate's precision
(:func:`attncert.attacks.verified_pgd_l2`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from attncert.pipeline.device import resolve_precision

#: device types whose autocast state a certificate checks
AUTOCAST_DEVICES = ("cpu", "cuda")


@contextlib.contextmanager
def training_matmuls(precision: str, device: torch.device | str) -> Iterator[None]:
    """TF32 float32 matmuls for ``bf16``/``tf32`` on CUDA inside the block, restored after."""
    p = resolve_precision(precision, device)
    if p not in ("bf16", "tf32") or torch.device(device).type != "cuda":
        yield
        return
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


def attack_matmuls(device: torch.device | str) -> contextlib.AbstractContextManager:
    """TF32 float32 matmuls on CUDA inside an attack: an attack is a lower bound, its
    precision changes its strength only; every success is confirmed in full precision."""
    return training_matmuls("tf32", device)


def autocast(precision: str, device: torch.device | str) -> contextlib.AbstractContextManager:
    """The autocast context of a training forward pass (a no-op unless ``bf16``)."""
    p = resolve_precision(precision, device)
    if p != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


@contextlib.contextmanager
def full_precision(device: torch.device | str) -> Iterator[None]:
    """float32 (or wider) arithmetic inside a training step: autocast off on ``device``'s type
    and IEEE float32 matmuls (TF32 off), both restored after. For the few computations that
    reduced precision breaks, such as OLSA's orthogonalisation (a bfloat16 Newton-Schulz step
    leaves ||W W^T - I|| near 1e-2 instead of 1e-7)."""
    kind = torch.device(device).type
    before = torch.get_float32_matmul_precision()
    off = (torch.autocast(kind, enabled=False) if kind in AUTOCAST_DEVICES
           else contextlib.nullcontext())  # a device type without autocast has none to undo
    with off:
        torch.set_float32_matmul_precision("highest")
        try:
            yield
        finally:
            torch.set_float32_matmul_precision(before)


def require_full_precision(what: str) -> None:
    """Raise unless autocast is off on every device type and float32 matmuls are IEEE.

    Certificates call this first: a bound computed in bfloat16 or TF32 is not a bound.
    """
    on = [d for d in AUTOCAST_DEVICES if torch.is_autocast_enabled(d)]
    if on:
        raise RuntimeError(f"{what} must not run under autocast ({', '.join(on)}): "
                           "certificates are computed in full precision")
    if torch.get_float32_matmul_precision() != "highest":
        raise RuntimeError(f"{what} must not run with reduced-precision float32 matmuls "
                           f"(torch.get_float32_matmul_precision() = "
                           f"{torch.get_float32_matmul_precision()!r})")
