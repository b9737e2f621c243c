"""Reading the data stage's processed files: the data, or why it was skipped; pixels as floats."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attncert.data.common import (
    DataUnavailable,
)


def _read_processed(name: str, processed_dir: str | Path) -> dict[str, Any]:
    path = Path(processed_dir) / f"{name}.pt"
    if not path.is_file():
        raise DataUnavailable(f"{path}: missing; run the data stage (`dvc repro data`) with "
                              f"{name!r} in data.datasets or data.samples")
    return torch.load(path, weights_only=True)


def load_processed(name: str, processed_dir: str | Path) -> dict[str, Any]:
    """Read a processed dataset; a clear error if the data stage has not produced it or
    skipped it (a sample without a route)."""
    obj = _read_processed(name, processed_dir)
    if "skipped" in obj:
        raise DataUnavailable(f"{name}: skipped by the data stage: {obj['skipped']}")
    return obj


def dataset_skipped(name: str, processed_dir: str | Path) -> str | None:
    """Why the data stage skipped the optional dataset ``name`` (None: it is available)."""
    return _read_processed(name, processed_dir).get("skipped")


def sample_skipped(name: str, processed_dir: str | Path) -> str | None:
    """Why the data stage skipped the sample ``name`` (None: it is available)."""
    return _read_processed(name, processed_dir).get("skipped")


def as_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float in [0, 1] (the space eps is measured in)."""
    return x.to(torch.float32) / 255.0
