"""The crown section's schema (params.yaml ``crown``): :class:`Params`, read by the stage
(:mod:`attncert.stages.crown`), the study (:mod:`attncert.crown.study`) and its tables; it
imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncert.crown import METHODS
from attncert.pipeline.audit import Audit
from attncert.pipeline.params import (
    NORMALIZE,
    VIT_POOLS,
    ParamsError,
    image_datasets,
    nonempty,
    nonneg,
    one_of,
    param,
    positive,
    probability,
    unique,
)
from attncert.pipeline.shapes import VitShape
from attncert.training.recipe import Training

__all__ = ["LOFAST_VARIANTS", "Params"]

#: LoFAST's certificate variants compared with CROWN (pairwise test); the CROWN methods are
#: the keys of :data:`attncert.crown.METHODS` (crown, alpha_crown).
LOFAST_VARIANTS = ("lofast_M", "lofast_xi")


@dataclass(frozen=True)
class Params:
    """params.yaml ``crown``: LoFAST vs CROWN / alpha-CROWN (auto_LiRPA) and their
    combination (LoFAST Tables 1-2): Lipschitz ViTs of each depth trained in the stage, l2
    balls in pixel space."""

    datasets: list[str] = param(image_datasets, unique, nonempty,
                                doc="image datasets, each with its own ViTs (LoFAST Table 2: "
                                    "CIFAR-10, SVHN)")
    depths: list[int] = param(positive, unique, doc="one ViT per depth (LoFAST: 3, 4, 5)")
    vit: VitShape = param(doc="the name of a shape of the vit section (depths replace its "
                              "depth)")
    pool: str = param(one_of(*VIT_POOLS))
    radius_attn: float = param(positive)
    gamma_qk: float = param(positive)
    gamma_vo: float = param(positive)
    normalize: str = param(one_of(*NORMALIZE))
    max_train: int = param(nonneg, doc="first n training images (0 = all)")
    train: Training = param(doc="the ViTs' training recipe, one config (every TrainConfig "
                                "field)")
    n_test: int = param(positive, doc="first n test images, the same for every method")
    cert_eps: list[float] = param(positive, unique)
    lofast_variant: str = param(one_of(*LOFAST_VARIANTS))
    methods: list[str] = param(one_of(*METHODS), unique)
    bound_dtype: str = param(one_of("float64", "float32"),
                             doc="CROWN's arithmetic: float64 for a certificate")
    alpha_iterations: int = param(positive)
    time_limit: float = param(nonneg, doc="seconds per (point, eps) bound; 0 = none")
    batch_size: int = param(positive, doc="points bounded together by one call of auto_LiRPA "
                                          "(their seconds shared; on a CUDA device grown to "
                                          "base.batch_memory, halved on out-of-memory)")
    skip_lofast_certified: bool = param(
        doc="CROWN runs only where LoFAST did not certify (all LoFAST Table 2's combination "
            "needs), except on the first alone_points test points")
    alone_points: int = param(nonneg, doc="with skip_lofast_certified: CROWN also runs where "
                                          "LoFAST certified on the first n test points, so its "
                                          "accuracy and seconds alone (Tables 1-2's CROWN rows) "
                                          "are measured on that sample (0: not measured)")
    alpha_after_crown: bool = param(
        doc="alpha-CROWN bounds only the pairs CROWN did not certify (CROWN first, as "
            "alpha,beta-CROWN's own bound does; its rows and seconds are the cascade's); "
            "needs crown before alpha_crown in methods")
    time_budget: float = param(nonneg, doc="seconds of CROWN bounds per method and unit "
                                           "(dataset x depth; 0 = none); past it that method's "
                                           "remaining bounds are not run ('budget')")
    max_error_share: float = param(probability, doc="the stage fails when more of the bounds "
                                                    "that ran ended in an error (time limits "
                                                    "are results, not errors)")
    audit: Audit = param(doc="the PGD soundness audit (attncert.pipeline.audit.Audit)")
    results_dir: str = param()
    metrics: str = param()

    @property
    def cascade(self) -> bool:
        """alpha-CROWN runs after CROWN, only where CROWN did not certify (both methods and
        ``alpha_after_crown``)."""
        return self.alpha_after_crown and {"crown", "alpha_crown"} <= set(self.methods)

    def __post_init__(self) -> None:
        self.vit.require("crown.vit", "heads")
        self.train.require("crown.train", "none", "lmt", "olsa", "lofast")
        if self.audit.batch_size == 0:
            raise ParamsError("crown.audit.batch_size: must be > 0 (the section has no "
                              "certificate batch to take it from)")
        if not self.methods:
            raise ParamsError("crown.methods: needs at least one method")
        if self.cascade and self.methods.index("crown") > self.methods.index("alpha_crown"):
            raise ParamsError("crown.alpha_after_crown: CROWN runs first, so methods must "
                              f"list crown before alpha_crown (got {self.methods})")
