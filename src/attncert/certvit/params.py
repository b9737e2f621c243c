"""The certvit section's schema (params.yaml ``certvit``): :class:`Params` and its groups,
Douglas-Rachford's settings (:class:`DRParams`), CertViT Table 1's small ViTs
(:class:`Table1Params`) and Table 3's ImageNet route (:class:`ImagenetParams`). The stage
(:mod:`attncert.stages.certvit`) and the study (:mod:`attncert.certvit.study`) both read it; it
imports neither.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from attncert.certvit import methods as cv
from attncert.certvit.adapt import NORMS
from attncert.certvit.douglas_rachford import DRConfig
from attncert.certvit.spectral import Budgets
from attncert.certvit.tables import PAPER_EPS, table1_eps
from attncert.pipeline.audit import Audit
from attncert.pipeline.params import (
    IMAGE_DATASETS,
    ParamsError,
    nonneg,
    one_of,
    param,
    positive,
    unique,
    unit_interval,
)
from attncert.pipeline.shapes import VitShape
from attncert.report.paper import certvit_pixel_eps
from attncert.training.recipe import Training

__all__ = ["MARGINS", "TABLE1_DATASETS", "DRParams", "Table1Params", "ImagenetParams", "Params"]

#: the image datasets of CertViT Table 1's ViT rows (TinyImageNet has no route here)
TABLE1_DATASETS = tuple(d for d in IMAGE_DATASETS if certvit_pixel_eps(d) is not None)

#: The fine-tune losses after constraining (``paper`` mode; ``spectral`` trains with the
#: certificate's own margin, :mod:`attncert.training.train`'s "radius").
MARGINS = ("none", "lmt")


@dataclass(frozen=True)
class DRParams:
    """params.yaml ``certvit.dr``: Douglas-Rachford's settings (:class:`DRConfig` but its seed,
    which is ``base.seed``) and the training images whose tokens it records."""

    threshold: float = param(positive, doc="soft threshold / RMS of the layer's weights")
    eta: float = param(positive, doc="output tolerance / RMS of the layer's outputs")
    relaxation: float = param(positive)
    iterations: int = param(positive)
    projection_steps: int = param(positive)
    batch_size: int = param(positive, doc="recorded pairs per constraint set")
    max_pairs: int = param(positive, doc="recorded pairs per layer")
    tol: float = param(positive, doc="a projection's early stop: relative change below it")
    images: int = param(positive, doc="training images whose tokens are recorded")

    def config(self, seed: int) -> DRConfig:
        """The :class:`DRConfig` of these settings: every field of it but the seed, taken
        from this group (a field it lacks fails here, never a silent default)."""
        names = [f.name for f in dataclasses.fields(DRConfig) if f.name != "seed"]
        return DRConfig(**{n: getattr(self, n) for n in names}, seed=seed)


@dataclass(frozen=True)
class Table1Params:
    """params.yaml ``certvit.table1``: CertViT Table 1's small standard ViTs, one per dataset
    of ``datasets`` trained here (shape per dataset from its Table 4, a shape of the ``vit``
    section; schedule from its Table 9), then every step of the section; the mappings need an
    entry per dataset."""

    datasets: list[str] = param(one_of(*TABLE1_DATASETS), unique,
                                doc="the datasets CertViT's Table 1 reports; empty: none")
    vit: dict[str, VitShape] = param(doc="per dataset the name of a shape of the vit section")
    pretrain_epochs: dict[str, int] = param(doc="training from scratch")
    relaxation: dict[str, float] = param(doc="Douglas-Rachford's relaxation per dataset "
                                             "(replaces dr.relaxation for its run)")
    batch_size: int = param(positive, doc="every training phase's")
    lr: float = param(positive, doc="train.lr: training and the adaptation fine-tune")

    def __post_init__(self) -> None:
        for name in ("vit", "pretrain_epochs", "relaxation"):
            values = getattr(self, name)
            lacking = [d for d in self.datasets if d not in values]
            if lacking:
                raise ValueError(f"{name} needs an entry for {lacking} (one per dataset of "
                                 f"datasets), got {sorted(values)}")
        if any(isinstance(v, bool) or not isinstance(v, int) or v <= 0
               for v in self.pretrain_epochs.values()):
            raise ValueError(f"pretrain_epochs must map to ints > 0, got {self.pretrain_epochs}")
        if any(isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 2
               for v in self.relaxation.values()):
            raise ValueError(f"relaxation must map to numbers in (0, 2), got {self.relaxation}")
        for d in self.datasets:
            self.vit[d].require(f"certvit.table1.vit.{d}", "depth", "heads")


@dataclass(frozen=True)
class ImagenetParams:
    """params.yaml ``certvit.imagenet``: CertViT Table 3's route, ImageNet-pretrained ViTs on
    the user's ImageNet validation images (the 20-image sample without them)."""

    sources: list[str] = param(unique, doc="hub ids or HF folders; 'tiny': a tiny random HF "
                                           "ViT (the route, not a result); [none] or []: not "
                                           "run")
    calibration: int = param(positive, doc="the first n images set the norm radii and "
                                           "Douglas-Rachford's pairs (at most half); one image "
                                           "per class of the rest is certified")


@dataclass(frozen=True)
class Params:
    """params.yaml ``certvit``: a pre-trained standard ViT, adapted (L2 attention, Lipschitz
    norms), constrained by Douglas-Rachford splitting, fine-tuned, certified."""

    source: str = param(doc="'pipeline' (train a standard ViT here), an HF hub id, an HF "
                            "folder or a save_vit checkpoint file")
    dataset: str = param(one_of(*IMAGE_DATASETS))
    vit: VitShape = param(doc="source 'pipeline' only: the name of a shape of the vit "
                              "section, the standard ViT trained here")
    train: Training = param(doc="pipeline: training from scratch; loaded: fine-tuning on the "
                                "dataset (epochs 0: as loaded); with adapt_epochs, the "
                                "adaptation fine-tune's recipe")
    norm: str = param(one_of(*NORMS), doc="LayerNorm replacement")
    radius_quantile: float = param(unit_interval, doc="ProjectNorm radius: this quantile of "
                                                      "the pre-trained token norms")
    adapt_epochs: int = param(nonneg, doc="the adapted model's fine-tune (train's recipe; "
                                          "spectral mode: at spectral.logit_scale)")
    dr: DRParams = param(doc="Douglas-Rachford constraining (paper mode), one config")
    finetune: Training = param(doc="paper mode: the fine-tune after constraining (margin "
                                   "none or lmt)")
    finetune_scope: str = param(one_of(*cv.FINETUNE_SCOPES),
                                doc="masked: every weight, pruned ones kept at zero; "
                                    "bound_free: only what the bound does not depend on")
    constrain: list[str] = param(one_of(*cv.MODES), unique,
                                 doc="modes run side by side: paper (l1 Douglas-Rachford, "
                                     "the steps above) | spectral (spectral-norm balls)")
    budget: Budgets = param(doc="spectral mode: the spectral-norm budget of every map "
                                "(attncert.certvit.spectral.Budgets)")
    spectral: Training = param(doc="spectral mode: the projected fine-tune after "
                                   "constraining, margin radius at offset L lmt_offset (L the "
                                   "sets' bound; the linear baseline's offset: lmt_offset)")
    n_test: int = param(nonneg, doc="the first n test images are certified (0 = the whole "
                                    "split)")
    eval_batch_size: int = param(positive, doc="images per certificate and accuracy pass")
    cert_eps: list[float] = param(positive, unique)
    audit: Audit = param(doc="the PGD soundness audit (attncert.pipeline.audit.Audit)")
    table1: Table1Params = param(doc="CertViT Table 1: a small standard ViT per dataset, "
                                     "trained here, then every step above")
    imagenet: ImagenetParams = param(doc="CertViT Table 3: ImageNet-pretrained ViTs")
    results_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        self.vit.require("certvit.vit", "depth", "heads")
        self.train.require("certvit.train", "none", "lmt", skip=True)
        self.finetune.require("certvit.finetune", *MARGINS, skip=True)
        self.spectral.require("certvit.spectral", "radius", skip=True)
        if not 0 < self.dr.relaxation < 2:
            raise ParamsError(f"certvit.dr.relaxation: must be in (0, 2), got "
                              f"{self.dr.relaxation!r}")
        if not self.constrain:
            raise ParamsError("certvit.constrain: needs at least one mode (paper, spectral)")
        if PAPER_EPS not in self.cert_eps:
            raise ParamsError(f"certvit.cert_eps: must include {PAPER_EPS} (CertViT's MNIST "
                              "eps, compared in the report)")
        for d in self.table1.datasets:
            if table1_eps(d) not in self.cert_eps:
                raise ParamsError(f"certvit.cert_eps: must include {table1_eps(d)} (CertViT's "
                                  f"eps for {d}) while table1.datasets lists {d!r}")

    def table1_run(self, dataset: str, image_size: int) -> Params:
        """The section for the Table 1 run on ``dataset`` (images of ``image_size`` pixels):
        a small ViT trained here, its own folder and metrics file, no further runs."""
        t = self.table1
        vit = t.vit[dataset]
        if image_size % vit.patch:
            raise ParamsError(f"certvit.table1.vit: {dataset}'s {image_size}-pixel images do "
                              f"not split into patches of {vit.patch} pixels")
        work = Path(self.results_dir) / "table1" / dataset
        return dataclasses.replace(
            self, source=cv.PIPELINE, dataset=dataset, vit=vit,
            train=dataclasses.replace(self.train, epochs=t.pretrain_epochs[dataset],
                                      batch_size=t.batch_size, lr=t.lr),
            finetune=dataclasses.replace(self.finetune, batch_size=t.batch_size),
            spectral=dataclasses.replace(self.spectral, batch_size=t.batch_size),
            dr=dataclasses.replace(self.dr, relaxation=float(t.relaxation[dataset])),
            table1=dataclasses.replace(t, datasets=[]),
            imagenet=dataclasses.replace(self.imagenet, sources=[]), results_dir=str(work),
            metrics=str(work / "metrics.json"))
