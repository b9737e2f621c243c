"""The ViT grid's schema: params.yaml ``train_vit`` (the fixed settings of every grid point,
and the grid point's model, :func:`model_config`) and ``certify_vit`` (the certificate and audit
of each point). Read by the two stages, the frontier (which trains ``train_vit``'s ViT with
other margins) and the cost model."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attncert.bounds.variants import TESTS, VARIANTS
from attncert.models import ViTConfig
from attncert.models.config import KINDS, dataset_vit_config
from attncert.pipeline.audit import Audit
from attncert.pipeline.params import (
    NORMALIZE,
    VIT_BLOCKS,
    VIT_POOLS,
    ParamsError,
    nonneg,
    one_of,
    one_of_numbers,
    param,
    positive,
    unique,
)
from attncert.pipeline.runs import GridPoint
from attncert.pipeline.shapes import VitShape
from attncert.training.recipe import Training

__all__ = ["CertifyVitParams", "TrainVitParams", "model_config"]


@dataclass(frozen=True)
class TrainVitParams:
    """params.yaml ``train_vit``: the fixed settings of every grid point."""

    kind: str = param(one_of(*KINDS))
    vit: VitShape = param(doc="the name of a shape of the vit section (the grid point sets "
                              "depth and heads)")
    block: str = param(one_of(*VIT_BLOCKS))
    pool: str = param(one_of(*VIT_POOLS))
    radius_attn: float = param(positive)
    radius_stream: float | None = param(doc="null = sqrt(dim)")
    gamma_qk: float = param(positive)
    head_norm: bool = param(doc="head rows scaled to unit norm (margins are feature margins)")
    normalize: str = param(one_of(*NORMALIZE), doc="inside the model; eps stays in pixel space")
    train: Training = param(doc="the training recipe, one config (every TrainConfig field)")

    def __post_init__(self) -> None:
        self.train.require("train_vit.train", "none", "lmt", "olsa", "lofast")
        if self.radius_stream is not None and self.radius_stream <= 0:
            raise ParamsError(f"train_vit.radius_stream: must be > 0 or null, got "
                              f"{self.radius_stream!r}")


def model_config(p: TrainVitParams, point: GridPoint, data: Mapping[str, Any]) -> ViTConfig:
    """The grid point's ViT, sized by its processed dataset
    (:func:`attncert.models.config.dataset_vit_config`)."""
    return dataset_vit_config(
        data, p.normalize, kind=p.kind, **p.vit.arch(depth=point.depth, heads=point.heads),
        block=p.block, pool=p.pool, radius_attn=p.radius_attn, radius_stream=p.radius_stream,
        gamma_qk=p.gamma_qk, head_norm=p.head_norm, gamma_vo=point.gamma_vo)


@dataclass(frozen=True)
class CertifyVitParams:
    """params.yaml ``certify_vit``."""

    n_test: int = param(nonneg, doc="first n test images (the same points for every "
                                    "variant; 0 = the whole test split)")
    cert_batch_size: int = param(positive)
    variants: list[str] = param(one_of(*VARIANTS), unique)
    tests: list[str] = param(one_of(*TESTS), unique)
    softmax_lipschitz: float = param(one_of_numbers(0.5, 1.0))
    max_radius: float = param(positive)
    cert_eps: list[float] = param(positive, unique)
    audit: Audit = param(doc="the PGD soundness audit (attncert.pipeline.audit.Audit)")
    results_dir: str = param()
