"""One ViT grid point: its name, its folder, its fingerprint; the ViT config sized by a dataset.

A grid point (a DVC matrix item of ``vit_grid``, :class:`GridPoint`) is a dataset, a depth, a
number of heads and gamma_vo; the ``train_vit`` stage (:mod:`attncert.stages.train_vit`) builds
its configs from its section. Its folder ``<results_dir>/<name>/`` holds ``ckpt/`` (the per-epoch
checkpoint, kept between ``dvc repro`` runs so that training resumes; cleared when the run's
:func:`fingerprint` changes, :func:`attncert.training.train.train_resumable`), ``model.pt`` (the
final model) and ``train.json`` (per-epoch metrics).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attncert.models import ViTConfig
from attncert.pipeline.params import IMAGE_DATASETS, NORMALIZE, one_of, param, positive
from attncert.training.train import TrainConfig


@dataclass(frozen=True)
class GridPoint:
    """One point of ``vit_grid`` as a matrix stage gets it (nbrun ``--item``): one value of
    each list, parsed with ``params.parse_section("vit_grid", raw, GridPoint)``."""

    results_dir: str = param()
    dataset: str = param(one_of(*IMAGE_DATASETS))
    depth: int = param(positive)
    heads: int = param(positive)
    gamma_vo: float = param(positive)

    @property
    def name(self) -> str:
        """The point's folder name (:func:`run_name`)."""
        return run_name(self.dataset, self.depth, self.heads, self.gamma_vo)

    @property
    def run_dir(self) -> Path:
        """``<results_dir>/<name>``: the point's checkpoint, model and training metrics."""
        return Path(self.results_dir) / self.name


def run_name(dataset: str, depth: int, heads: int, gamma_vo: float) -> str:
    """The grid point's folder name; dvc.yaml spells the same template with ``${item.*}``."""
    return f"{dataset}-L{depth}-H{heads}-vo{gamma_vo}"


def dataset_vit_config(data: Mapping[str, Any], normalize: str, **fields: Any) -> ViTConfig:
    """A ViTConfig sized by a processed dataset (``attncert.data.load_processed``): image size
    and channels from its training images, the number of classes, and its pixel statistics.

    ``normalize`` (one of :data:`attncert.pipeline.params.NORMALIZE`) puts the statistics inside the
    model: "mean" subtracts the mean only (1-Lipschitz), "std" also divides by the std (the
    certificate counts 1 / min std), "none" feeds pixels as they are. ``fields``: every other
    ViTConfig field.
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    x = data["train"]["x"]
    mean = tuple(data["mean"]) if normalize in ("mean", "std") else None
    std = tuple(data["std"]) if normalize == "std" else None
    return ViTConfig(image_size=int(x.shape[2]), channels=int(x.shape[1]),
                     num_classes=len(data["classes"]), mean=mean, std=std, **fields)


def fingerprint(model_cfg: ViTConfig, train_cfg: TrainConfig, dataset: str,
                data_source: str, precision: str | None = None) -> dict[str, Any]:
    """What decides a run's checkpoint; ``precision`` (the resolved training precision,
    :func:`attncert.training.precision.resolve_precision`) is part of it when given."""
    d = {"dataset": dataset, "data": data_source, "model": model_cfg.to_dict(),
         "train": {k: getattr(train_cfg, k) for k in TrainConfig.__dataclass_fields__}}
    if precision is not None:
        d["precision"] = precision
    d = json.loads(json.dumps(d))  # as stored: tuples become lists
    d["sha"] = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    return d
