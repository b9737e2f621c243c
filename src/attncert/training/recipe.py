"""A model's training recipe as one params.yaml group (``train_vit.train``, ``crown.train``,
``frontier.linear``).

:class:`Training` holds every field of :class:`~attncert.training.train.TrainConfig` but the
seed, so the config is built from the group whole (:meth:`Training.config`): a field added to
``TrainConfig`` without a key in the group fails at once, never takes a silent default.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from attncert.pipeline.params import (
    AUGMENTS,
    fail,
    nonneg,
    one_of,
    param,
    positive,
    probability,
)
from attncert.training.loop import OPTIMIZERS
from attncert.training.train import ADVERSARIAL, TrainConfig

#: the training margins a recipe offers: "lofast": the pairwise certificate's test with
#: LoFAST's bound at a training radius (:mod:`attncert.training.certified_training`); "radius":
#: the exact radius of a model with head rows, the linear baseline's (a ViT refuses it:
#: :meth:`Training.require`)
MARGINS = ("none", "lmt", "olsa", "lofast", "radius")


@dataclass(frozen=True)
class Training:
    """A stage's training recipe (params.yaml ``train_vit.train``, ``crown.train``): one group
    with every field of :class:`~attncert.training.train.TrainConfig` but the seed
    (``adv_eps_255``: its ``adv_eps`` in units of 1/255); :meth:`config` takes it whole."""

    epochs: int = param(nonneg, doc="0: the phase is skipped (where the section allows it)")
    batch_size: int = param(positive)
    lr: float = param(positive)
    weight_decay: float = param(nonneg)
    warmup_steps: int = param(nonneg)
    optimizer: str = param(one_of(*OPTIMIZERS))
    momentum: float = param(nonneg, doc="sgd only")
    margin: str = param(one_of(*MARGINS), doc="none | lmt | olsa | lofast | radius (the "
                                              "linear baseline's)")
    lmt_offset: float = param(nonneg)
    olsa_gamma: float = param(nonneg)
    lofast_eps: float = param(nonneg, doc="margin lofast: the training radius (pixel l2)")
    lofast_ramp: float = param(probability, doc="margin lofast: share of all steps over "
                                                  "which the radius grows from 0")
    lofast_start: float = param(probability, doc="margin lofast: share of all steps trained "
                                                   "with the plain CE before it starts")
    lofast_mix: float = param(probability, doc="margin lofast: weight of its CE against "
                                                 "the plain CE")
    attn_entropy: float = param(nonneg, doc="+ this x the attention rows' mean entropy / "
                                            "log n (0 = off)")
    logit_scale: float = param(positive)
    augment: str = param(one_of(*AUGMENTS))
    grad_clip: float = param(nonneg)
    mixup_alpha: float = param(nonneg, doc="Mixup / CutMix (mix_prob 0 = off)")
    cutmix_alpha: float = param(nonneg)
    mix_prob: float = param(probability)
    mix_switch_prob: float = param(probability)
    eval_batch_size: int = param(positive)
    msvp_lambda: list[float] = param(nonneg, doc="SpecFormer's MSVP (lam_q, lam_k, lam_v); 0 = off")
    adversarial: str = param(one_of(*ADVERSARIAL))
    adv_eps_255: float = param(positive, doc="l_inf radius of adversarial training (x 1/255)")
    adv_steps: int = param(positive)

    def __post_init__(self) -> None:
        if len(self.msvp_lambda) != 3:
            raise ValueError(f"msvp_lambda: needs 3 values, got {self.msvp_lambda!r}")

    def require(self, key: str, *margins: str, skip: bool = False) -> None:
        """The section's checks of its recipe ``key``: a margin of ``margins`` (the model
        trains with no other) and at least one epoch unless the phase may be ``skip``-ped;
        the one-line params error otherwise."""
        if self.margin not in margins:
            fail(f"{key}.margin", f"{self.margin!r} does not train this model; choose from "
                                  f"{', '.join(margins)}")
        if not skip and self.epochs < 1:
            fail(f"{key}.epochs", f"must be > 0, got {self.epochs!r}")

    def config(self, seed: int, **changes) -> TrainConfig:
        """The :class:`TrainConfig` of this group and ``seed``: every field of it from the
        group (a field the group lacks fails here, never a silent default), but the fields
        named in ``changes`` (fields of this group, such as a phase's ``epochs``)."""
        fields = dataclasses.fields(Training)
        unknown = sorted(set(changes) - {f.name for f in fields})
        if unknown:
            raise TypeError(f"Training.config: {unknown} are not fields of the recipe")
        own = {f.name: getattr(self, f.name) for f in fields} | changes
        own["adv_eps"] = own.pop("adv_eps_255") / 255
        own["msvp_lambda"] = tuple(own["msvp_lambda"])
        names = [f.name for f in dataclasses.fields(TrainConfig) if f.name != "seed"]
        if sorted(own) != sorted(names):
            raise TypeError(f"Training and TrainConfig differ: "
                            f"{sorted(set(names) ^ set(own))}")  # a bug: keep them one set
        return TrainConfig(**own, seed=seed)


@dataclass(frozen=True)
class AdversarialRecipe(Training):
    """A recipe and its adversarial twin (SpecFormer's runs: params.yaml ``specformer.train``,
    ``specformer.finetune``): the standard run takes every field of :class:`Training`
    (``adversarial`` none); the adversarial run the same recipe for ``adv_epochs`` with PGD
    adversarial training at l_inf ``adv_eps_255`` / 255, ``adv_steps`` steps, unmixed (PGD
    attacks the batch's own labels)."""

    adv_epochs: int = param(positive, doc="the PGD adversarial twin's epochs")

    def configs(self, seed: int) -> tuple[TrainConfig, TrainConfig]:
        """(standard, adversarial) :class:`TrainConfig` of the recipe."""
        return self.config(seed), self.config(seed, epochs=self.adv_epochs,
                                              adversarial="pgd_linf", mix_prob=0.0)


@dataclass(frozen=True)
class OwnRate:
    """The learning rate of a model that otherwise trains its section's shared recipe
    (params.yaml ``frontier.standard``: the standard ViT on ``train_vit.train``;
    ``text.vanilla``: the standard text transformer on ``text.train``): a group, so that
    ``lr`` is spelt alike in every section."""

    lr: float = param(positive, doc="its learning rate")
