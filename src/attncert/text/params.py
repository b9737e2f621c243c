"""The text section's schema: params.yaml ``text`` (:class:`Params`) and its groups: OLSA's models
(``text.olsa``), LoFAST's small-BERT grid (``text.lofast``) and the OLSA head over a frozen
encoder (``text.frozen``). Each group checks its own values; what ties a group to the rest of
the section (a dataset per entry, a width per head count) is checked by the section."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attncert.pipeline.audit import Audit
from attncert.pipeline.params import (
    TEXT_DATASETS,
    ParamsError,
    nonneg,
    one_of,
    param,
    positive,
    unique,
)
from attncert.text.olsa import RESIDUALS
from attncert.training.recipe import OwnRate

#: Bound variants of attncert.certify usable on LoFAST's text transformer (pairwise test).
LOFAST_VARIANTS = ("lofast_M", "lofast_xi", "naive", "global")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class OlsaParams:
    """``text.olsa``: OLSA trained from scratch (OLSA sections 4-5)."""

    depths: list[int] = param(positive, unique, doc="on every dataset (OLSA Table 1)")
    deep_depths: list[int] = param(positive, unique, doc="on SST-2 only (OLSA Table 9)")
    alpha1: float = param(positive, doc="initial alpha1 of every attention (OLSA: trainable)")
    residual: str = param(one_of(*RESIDUALS),
                          doc="averaged: OLSA's 0.5 x + 0.5 f(x); gated: trainable "
                              "(1 - b) x + b f(x), one b = sigmoid(theta) per sublayer")
    residual_init: float = param(doc="initial b of the gated residual, in (0, 1)")

    def __post_init__(self) -> None:
        both = sorted(set(self.depths) & set(self.deep_depths))
        if both:
            raise ValueError(f"deep_depths {both} already in depths")
        if not 0 < self.residual_init < 1:
            raise ValueError(f"residual_init must be in (0, 1) (b = sigmoid(theta)), got "
                             f"{self.residual_init!r}")


@dataclass(frozen=True)
class LofastParams:
    """``text.lofast``: LoFAST's small-BERT grid (its appendix D, Figure 5), a Lipschitz text
    transformer per (depth, heads, gamma_vo), certified with each of ``variants``."""

    depths: list[int] = param(positive, unique)
    heads: list[int] = param(positive, unique)
    gamma_vo: list[float] = param(positive, unique, doc="spectral norm of every W^V_l, W^O_l")
    dim: int = param(positive)
    mlp_hidden: int = param(positive)
    gamma_qk: float = param(positive, doc="spectral norm of every W^Q_l, W^K_l")
    radius_attn: float = param(positive, doc="LayerProject radius of every attention input")
    variants: list[str] = param(one_of(*LOFAST_VARIANTS), unique)
    epochs: int = param(positive)
    lr: float = param(positive)
    logit_scale: float = param(positive, doc="CE temperature (its head is free, unlike OLSA's)")

    def __post_init__(self) -> None:
        for h in self.heads:
            if self.dim % h:
                raise ValueError(f"dim {self.dim} is not divisible by {h} heads")
        if not self.variants:
            raise ValueError("variants: needs at least one variant")


@dataclass(frozen=True)
class FrozenParams:
    """``text.frozen``: a 1-layer OLSA head over a frozen pre-trained encoder (OLSA section
    5.1, Table 3), gamma 0; per-dataset schedules for each of ``datasets``."""

    datasets: list[str] = param(one_of(*TEXT_DATASETS), unique,
                                doc="need not be trained from scratch")
    source: str = param(doc="the encoder: 'minilm-package', a hub id or a folder")
    dim: int = param(nonneg, doc="the head's width, reached by a 1-Lipschitz map from the "
                                 "encoder's (0 = the encoder's width)")
    epochs: dict[str, int] = param(doc="per dataset")
    lr: dict[str, float] = param(doc="per dataset")
    lr_decay_epochs: dict[str, list[int]] = param(
        doc="per dataset: the LR x 0.1 after each of these epochs (a step schedule); [] = the "
            "cosine schedule")
    max_train: int = param(nonneg, doc="seeded subset of the whole training split, independent "
                                       "of text.max_train (0 = all of it)")

    def __post_init__(self) -> None:
        for key in ("epochs", "lr", "lr_decay_epochs"):
            table = getattr(self, key)
            lacking = [d for d in self.datasets if d not in table]
            if lacking:
                raise ValueError(f"{key} needs an entry for {lacking} (one per dataset of "
                                 f"datasets {self.datasets}), got {sorted(table)}")
        for d, e in self.epochs.items():
            if not _is_int(e) or e <= 0:
                raise ValueError(f"epochs.{d} must be an int > 0, got {e!r}")
        for d, lr in self.lr.items():
            if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
                raise ValueError(f"lr.{d} must be a number > 0, got {lr!r}")
        for d, decays in self.lr_decay_epochs.items():
            last = self.epochs.get(d, 0)
            if not isinstance(decays, list) or any(
                    not _is_int(e) or not 0 < e < last for e in decays):
                raise ValueError(f"lr_decay_epochs.{d} must list epochs in [1, {last - 1}] "
                                 f"(epochs.{d} = {last}), got {decays!r}")


#: the dataset of the whole study (every other dataset adds OLSA's depths only)
STUDY = "sst2"

#: what each text model's job sets itself (:func:`attncert.text.jobs.dataset_jobs`): its schedule
#: and its certificate regulariser; every other field of a TextTrainConfig is the recipe's
JOB_FIELDS = ("epochs", "lr", "gamma")


@dataclass(frozen=True)
class TextRecipe:
    """``text.train``: the training recipe every text model shares (every field of
    :class:`attncert.text.train_text.TextTrainConfig` but the seed and a job's own
    :data:`JOB_FIELDS`); :meth:`config` takes it whole."""

    batch_size: int = param(positive)
    weight_decay: float = param(nonneg, doc="AdamW's (0: Adam)")
    warmup_steps: int = param(nonneg)
    logit_scale: float = param(positive, doc="CE temperature (loss only; never the "
                                             "certificate)")
    gamma_ramp: float = param(nonneg, doc="fraction of all steps gamma grows over (<= 1)")
    grad_clip: float = param(nonneg, doc="max global gradient norm (0 = off)")
    bucket: int = param(positive, doc="batches per length-sorted bucket (1 = plain shuffling)")
    eval_batch_size: int = param(positive, doc="the dev evaluation after every epoch")
    lr_decay_epochs: list[int] = param(doc="the LR x lr_decay after each of these epochs (a "
                                           "step schedule); [] = the cosine schedule")
    lr_decay: float = param(positive)

    def __post_init__(self) -> None:
        if self.gamma_ramp > 1:
            raise ValueError(f"gamma_ramp must be in [0, 1], got {self.gamma_ramp!r}")

    def config(self, seed: int, job: Mapping[str, Any]):
        """The :class:`~attncert.text.train_text.TextTrainConfig` of one job: ``job`` (its
        :data:`JOB_FIELDS`, and any recipe field it changes, such as a frozen head's
        ``lr_decay_epochs``) over this group, every field set (never a silent default)."""
        from attncert.text.train_text import TextTrainConfig

        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        lacking = [k for k in JOB_FIELDS if k not in job]
        unknown = sorted(set(job) - set(own) - set(JOB_FIELDS))
        if lacking or unknown:
            raise TypeError(f"a text job sets {list(JOB_FIELDS)} and recipe fields only: "
                            f"lacks {lacking}, unknown {unknown}")
        cfg = own | dict(job)
        names = {f.name for f in dataclasses.fields(TextTrainConfig)} - {"seed"}
        if set(cfg) != names:  # a bug: keep the recipe, the jobs and the config one set
            raise TypeError(f"TextRecipe and TextTrainConfig differ: {sorted(set(cfg) ^ names)}")
        return TextTrainConfig(**cfg, seed=seed)


@dataclass(frozen=True)
class Params:
    """params.yaml ``text``: OLSA by depth and gamma, Kim et al.'s L2 attention, a standard
    transformer of the same size, LoFAST's small-BERT grid and OLSA over a frozen pre-trained
    encoder; eps is l2 in each model's embedding space."""

    datasets: list[str] = param(one_of(*TEXT_DATASETS), unique,
                                doc="sst2 (the whole study; required), then every dataset "
                                    "OLSA also trains on from scratch at each olsa.depths "
                                    "(one the data stage skipped is reported unavailable)")
    tokenizer: str = param(doc="'minilm-package' (offline), a hub id or a save_pretrained folder")
    max_len: int = param(positive)
    max_train: int = param(nonneg, doc="seeded subset of the training split (0 = all)")
    max_test: int = param(nonneg, doc="seeded subset of the dev and test splits (0 = all)")
    olsa: OlsaParams = param(doc="OLSA from scratch: depths, attention, residual")
    heads: int = param(positive, doc="OLSA, Kim-L2, the standard transformer, the frozen head")
    dim: int = param(positive, doc="OLSA, Kim-L2 and the standard transformer")
    gamma: float = param(nonneg, doc="certificate regulariser after its ramp (OLSA: 2.0)")
    gamma_ablation: list[float] = param(nonneg, unique,
                                        doc="gammas of the shallowest OLSA (OLSA Table 2)")
    epochs: dict[str, int] = param(doc="training epochs per dataset of datasets (Kim-L2 and "
                                       "the standard transformer: SST-2's)")
    train: TextRecipe = param(doc="the recipe every text model shares (each job sets its "
                                  "epochs, lr and gamma)")
    lr: float = param(positive, doc="OLSA-family models (OLSA, Kim-L2)")
    vanilla: OwnRate = param(doc="the standard transformer's learning rate")
    lofast: LofastParams = param(doc="LoFAST's small-BERT grid (LoFAST appendix D)")
    frozen: FrozenParams = param(doc="the OLSA head over a frozen pre-trained encoder")
    attention_alpha1: list[float] = param(positive, unique, doc="the attention sweep: the "
                                          "deepest OLSA, averaged residual, alpha1 fixed at "
                                          "each value (empty: no sweep)")
    n_test: int = param(nonneg, doc="first n test sentences certified (0 = the whole split)")
    cert_batch_size: int = param(positive)
    cert_eps: list[float] = param(positive, unique)
    audit: Audit = param(doc="the PGD soundness audit (attncert.pipeline.audit.Audit)")
    results_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        def fail(key: str, msg: str):
            raise ParamsError(f"text.{key}: {msg}")

        if STUDY not in self.datasets:
            fail("datasets", f"must include {STUDY!r} (the study every other part of the stage "
                             f"reports), got {self.datasets}")
        lacking = [d for d in self.datasets if d not in self.epochs]
        if lacking:
            fail("epochs", f"needs an entry for {lacking} (one per dataset of text.datasets "
                           f"{self.datasets}), got {sorted(self.epochs)}")
        if any(e <= 0 for e in self.epochs.values()):
            fail("epochs", f"must be > 0, got {self.epochs}")
        if self.frozen.dim % self.heads:
            fail("frozen.dim", f"{self.frozen.dim} is not divisible by text.heads = "
                               f"{self.heads}")
        if self.dim % self.heads:
            fail("heads", f"dim = {self.dim} is not divisible by {self.heads}")
