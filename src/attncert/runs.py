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
from attncert.train import TrainConfig

#: train_vit keys that are ViTConfig fields (the others are TrainConfig fields or ``normalize``).
VIT_KEYS = ("kind", "patch", "dim", "mlp_hidden", "block", "pool", "radius_attn",
            "radius_stream", "gamma_qk", "head_norm")


def run_name(dataset: str, depth: int, heads: int, gamma_vo: float) -> str:
    """The grid point's folder name; dvc.yaml spells the same template with ``${item.*}``."""
    return f"{dataset}-L{depth}-H{heads}-vo{gamma_vo}"


def vit_config(data: Mapping[str, Any], settings: Mapping[str, Any], depth: int, heads: int,
               gamma_vo: float) -> ViTConfig:
    """The ViT of a grid point for a processed dataset (``attncert.data.load_processed``).

    ``settings``: the train_vit section. ``normalize`` puts the dataset's statistics inside the
    model: "mean" subtracts the mean only (1-Lipschitz), "std" also divides by the std (the
    certificate counts 1 / min std), "none" feeds pixels as they are.
    """
    x = data["train"]["x"]
    channels, size = int(x.shape[1]), int(x.shape[2])
    norm = settings["normalize"]
    mean = tuple(data["mean"]) if norm in ("mean", "std") else None
    std = tuple(data["std"]) if norm == "std" else None
    kw = {k: settings[k] for k in VIT_KEYS}
    return ViTConfig(image_size=size, channels=channels, depth=depth, heads=heads,
                     gamma_vo=gamma_vo, num_classes=len(data["classes"]), mean=mean, std=std,
                     **kw)


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
