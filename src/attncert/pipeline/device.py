"""Where and in what precision a stage runs: ``base.device`` and ``base.precision`` resolved
against the machine. A low module (it imports only torch and the params' names), so that the
stage contract (:mod:`attncert.pipeline.context`) needs no training code.
"""

from __future__ import annotations

import torch

from attncert.pipeline.params import PRECISIONS

__all__ = ["resolve_device", "resolve_precision"]


def resolve_device(spec: str | torch.device = "auto") -> torch.device:
    """``base.device`` as a torch.device: "auto" -> the current CUDA device if there is one,
    else cpu; "cpu", "cuda", "cuda:N", "mps" as given, with a one-line error when the machine
    has no such device (rather than a failure deep inside a stage)."""
    if str(spec) == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    dev = torch.device(spec)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {spec!r}: CUDA is not available on this machine "
                             "(use auto or cpu)")
        index = torch.cuda.current_device() if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ValueError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA "
                             "device(s) visible")
        return torch.device("cuda", index)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {spec!r}: MPS is not available on this machine")
    return dev


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere; other values are returned as given."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if torch.device(device).type == "cuda" else "fp32"
    return precision
