"""The frontier section's schema (params.yaml ``frontier``): :class:`Params`, read by the stage
(:mod:`attncert.stages.frontier`) and the study (:mod:`attncert.frontier.study`); it imports
neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncert.frontier.settings import settings_ok
from attncert.pipeline.audit import Audit
from attncert.pipeline.params import fail, image_datasets, nonempty, nonneg, param, positive, unique
from attncert.training.recipe import OwnRate, Training

__all__ = ["Params"]


@dataclass(frozen=True)
class Params:
    """params.yaml ``frontier``."""

    datasets: list[str] = param(image_datasets, unique, nonempty)
    settings: list[str] = param(settings_ok, unique, nonempty,
                                doc="<kind>-<value>: lmt-<offset>, lofast-<radius>, "
                                    "linear-<offset>")
    depth: int = param(positive, doc="the grid shape every ViT setting trains")
    heads: int = param(positive)
    gamma_vo: float = param(positive)
    holdout: int = param(positive, doc="the last n training images: the validation split")
    n_val: int = param(positive, doc="first n validation images certified")
    cert_eps: list[float] = param(positive, unique, nonempty)
    select_eps: float = param(positive, doc="the eps the selection rule reads (in cert_eps)")
    audit: Audit = param(doc="the PGD soundness audit (attncert.pipeline.audit.Audit)")
    cert_batch_size: int = param(positive)
    max_radius: float = param(positive, doc="the radius bisection's upper end (pixel l2): a "
                                            "radius is reported as at most this")
    linear: Training = param(doc="the linear baseline's whole recipe (margin radius; each "
                                 "linear-<value> setting trains at lmt_offset <value>)")
    standard: OwnRate = param(doc="the standard ViT's learning rate (train_vit's recipe "
                                  "otherwise, margin none)")
    max_train: int = param(nonneg, doc="first n images of the training part (0 = all of it)")
    min_attention_gap: float = param(nonneg, doc="points of clean accuracy a setting must "
                                                 "lose with uniform attention, on every "
                                                 "dataset, to count as a transformer in the "
                                                 "selection")
    # the bound against PGD as attention sharpens (frontier.study.sharpening_frame)
    sharpen_tokens: list[int] = param(positive, unique, nonempty)
    sharpen_caps: list[float] = param(positive, unique, nonempty)
    sharpen_eps: float = param(positive)
    sharpen_samples: int = param(positive)
    results_dir: str = param(doc="units/, ckpt/, frontier.csv, *.png, sharpening.csv")
    metrics: str = param()

    def __post_init__(self) -> None:
        if self.select_eps not in self.cert_eps:
            fail("frontier.select_eps", f"{self.select_eps} is not one of cert_eps "
                                        f"{self.cert_eps}")
        if self.audit.n > self.n_val:
            fail("frontier.audit.n", f"{self.audit.n} > n_val {self.n_val}")
        if self.max_radius <= max(self.cert_eps):
            fail("frontier.max_radius", f"{self.max_radius} must exceed the largest cert_eps "
                                        f"{max(self.cert_eps)}")
        self.linear.require("frontier.linear", "radius")
        if self.n_val > self.holdout:
            fail("frontier.n_val", f"{self.n_val} > holdout {self.holdout}")
