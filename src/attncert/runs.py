"""One ViT grid point: its name, its configs from params.yaml, its folder and resumable training.

A grid point (a DVC matrix item of ``vit_grid``) is a dataset, a depth, a number of heads and
gamma_vo; the fixed settings come from the ``train_vit`` section. Its folder
``<runs_dir>/<name>/`` holds ``ckpt/`` (the per-epoch checkpoint, kept between ``dvc repro`` runs
so that training resumes; cleared when the run's :func:`fingerprint` changes,
:func:`attncert.train.train_resumable`), ``model.pt`` (the final model) and ``train.json``
(per-epoch metrics).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from attncert.models import ViTConfig
from attncert.params import NORMALIZE
from attncert.train import TrainConfig

#: train_vit keys that are ViTConfig fields (the others are TrainConfig fields or ``normalize``).
VIT_KEYS = ("kind", "patch", "dim", "mlp_hidden", "block", "pool", "radius_attn",
            "radius_stream", "gamma_qk", "head_norm")


def run_name(dataset: str, depth: int, heads: int, gamma_vo: float) -> str:
    """The grid point's folder name; dvc.yaml spells the same template with ``${item.*}``."""
    return f"{dataset}-L{depth}-H{heads}-vo{gamma_vo}"


def dataset_vit_config(data: Mapping[str, Any], normalize: str, **fields: Any) -> ViTConfig:
    """A ViTConfig sized by a processed dataset (``attncert.data.load_processed``): image size
    and channels from its training images, the number of classes, and its pixel statistics.

    ``normalize`` (one of :data:`attncert.params.NORMALIZE`) puts the statistics inside the
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


def vit_config(data: Mapping[str, Any], settings: Mapping[str, Any], depth: int, heads: int,
               gamma_vo: float) -> ViTConfig:
    """The ViT of a grid point for a processed dataset (:func:`dataset_vit_config`).

    ``settings``: the train_vit section (its ``normalize`` and :data:`VIT_KEYS`).
    """
    kw = {k: settings[k] for k in VIT_KEYS}
    return dataset_vit_config(data, settings["normalize"], depth=depth, heads=heads,
                              gamma_vo=gamma_vo, **kw)


def train_config(settings: Mapping[str, Any], seed: int) -> TrainConfig:
    """The TrainConfig of the train_vit section (every TrainConfig field but the seed)."""
    names = set(TrainConfig.__dataclass_fields__) - {"seed"}
    return TrainConfig(seed=seed, **{k: settings[k] for k in sorted(names)})


def fingerprint(model_cfg: ViTConfig, train_cfg: TrainConfig, dataset: str,
                data_source: str, precision: str | None = None) -> dict[str, Any]:
    """What decides a run's checkpoint; ``precision`` (the resolved training precision,
    :func:`attncert.precision.resolve_precision`) is part of it when given."""
    d = {"dataset": dataset, "data": data_source, "model": model_cfg.to_dict(),
         "train": {k: getattr(train_cfg, k) for k in TrainConfig.__dataclass_fields__}}
    if precision is not None:
        d["precision"] = precision
    d = json.loads(json.dumps(d))  # as stored: tuples become lists
    d["sha"] = hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
    return d
