"""CertViT's methods that the stage (:mod:`attncert.stages.certvit`) plans with.

* :func:`source_model`: the pre-trained standard ViT named by the ``source`` param: one the
  pipeline trains itself (:data:`PIPELINE`, CertViT's Table 1 setting) or anything
  :func:`attncert.certvit.load_model` reads (a Hugging Face id, a local HF folder, a save_vit
  file), fitted to the dataset by :func:`fit_to_dataset`;
* :func:`phase_fingerprint`: what decides a training phase's resumable checkpoint folder
  (:func:`attncert.training.train.train_resumable` clears it when the phase's starting weights or
  settings change);
* :func:`finetune_scope`: what the fine-tune after constraining may change: every weight with
  the pruned ones kept at zero (CertViT), or only the parameters the bound does not depend on
  (:func:`bound_parameters`), which keeps the constrained model's bound;
* the two constraining modes run side by side (:data:`MODES`): ``paper`` (CertViT's l1
  Douglas-Rachford, then the fine-tune of :func:`finetune_scope`) and ``spectral`` (a
  spectral-norm ball per map, :mod:`attncert.certvit.spectral`, then a projected fine-tune
  with a Lipschitz-margin loss): :func:`adaptation`, :func:`calibration_slots`,
  :func:`constrain_mode`, :func:`finetune_context`, :func:`margin_offset`.

The record of the steps (accuracy, bound and seconds per step, CertViT's Table 1 beside ours)
is :mod:`attncert.certvit.steps`.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.certvit.adapt import Adaptation, ProjectNorm
from attncert.certvit.douglas_rachford import DRConfig, DRResult, constrain, freeze_zeros
from attncert.certvit.load import hub_revision, load_model
from attncert.certvit.spectral import (
    Budgets,
    budget_bound,
    constrain_spectral,
    map_sets,
    project_,
    projected,
)
from attncert.layers import CenterNorm, Normalize
from attncert.models.config import dataset_vit_config
from attncert.models.vit import ViT, ViTConfig, build_vit
from attncert.training.checkpoint import fingerprint, state_sha
from attncert.training.train import TrainConfig

__all__ = [
    "FINETUNE_SCOPES",
    "MODES",
    "PIPELINE",
    "UpsampleNormalize",
    "adaptation",
    "bound_parameters",
    "calibration_slots",
    "constrain_mode",
    "finetune_context",
    "margin_offset",
    "finetune_scope",
    "fit_to_dataset",
    "frozen",
    "phase_fingerprint",
    "pretrain_config",
    "source_model",
    "state_sha",
]

#: The ``source`` value for a standard ViT trained by the stage itself.
PIPELINE = "pipeline"
#: What the fine-tune after constraining trains (:func:`finetune_scope`).
FINETUNE_SCOPES = ("masked", "bound_free")
#: The constraining modes: CertViT's l1 Douglas-Rachford, and spectral-norm balls per map.
MODES = ("paper", "spectral")


class UpsampleNormalize(Normalize):
    """Nearest-neighbour upsampling by an integer ``factor``, then (x - mean) / std.

    Lets a pre-trained ViT of image size factor * H eat a dataset's H x H pixels, so eps stays
    in the dataset's pixel space. Upsampling copies every pixel factor^2 times, so it scales
    every perturbation's l2 norm by exactly ``factor``: the Lipschitz constant is
    factor / min(std), which :func:`attncert.certvit.global_bound` reads from
    :meth:`compute_lipschitz` as the input normalisation's factor.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float], factor: int):
        super().__init__(mean, std)
        if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
            raise ValueError(f"factor must be a positive int, got {factor!r}")
        self.factor = factor

    def compute_lipschitz(self) -> float:
        return self.factor * super().compute_lipschitz()

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(F.interpolate(x, scale_factor=self.factor, mode="nearest"))

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def pretrain_config(data: Mapping[str, Any], patch: int, dim: int, depth: int, heads: int,
                    mlp_hidden: int) -> ViTConfig:
    """The standard ViT the stage trains on a processed dataset (``source: pipeline``).

    Pre-norm blocks, class-token pooling, biased attention and the dataset's pixel statistics
    inside the model (as a Hugging Face ViT and its image processor), so it is adapted
    exactly like a downloaded checkpoint and eps is in pixel space.
    """
    return dataset_vit_config(data, "std", patch=patch, dim=dim, depth=depth, heads=heads,
                                   mlp_hidden=mlp_hidden, kind="standard", block="prenorm",
                                   pool="cls", attn_bias=True)


def fit_to_dataset(model: ViT, data: Mapping[str, Any], seed: int = 0) -> tuple[ViT, list[str]]:
    """Make a loaded ViT take a processed dataset's images and classes (in place).

    A different number of classes gets a new, seeded head. Images smaller than the model's by
    an integer factor are upsampled inside the model (:class:`UpsampleNormalize`, counted by
    the certificate). Returns the model and one note per change, for the report. Raises
    ValueError for other channel counts or sizes.
    """
    x = data["train"]["x"]
    channels, size = int(x.shape[1]), int(x.shape[2])
    cfg = model.config
    notes: list[str] = []
    if channels != cfg.channels:
        raise ValueError(f"the dataset has {channels} channel(s), the model {cfg.channels}")
    if size != cfg.image_size:
        if size > cfg.image_size or cfg.image_size % size:
            raise ValueError(f"{size}-pixel images do not upsample to the model's "
                             f"{cfg.image_size} pixels by an integer factor")
        factor = cfg.image_size // size
        old = model.normalize
        model.normalize = UpsampleNormalize(old.mean.flatten().tolist(),
                                            old.std.flatten().tolist(), factor).to(old.mean)
        notes.append(f"{size}-pixel images upsampled x{factor} (nearest) inside the model: "
                     f"the certificate counts the factor {factor}")
    classes = len(data["classes"])
    if classes != cfg.num_classes:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            head = nn.Linear(cfg.dim, classes)
        model.head = head.to(model.head.weight)
        model.config = dataclasses.replace(cfg, num_classes=classes)
        notes.append(f"new head: {cfg.num_classes} -> {classes} classes")
    return model, notes


def source_model(source: str, data: Mapping[str, Any], architecture: Mapping[str, int],
                 seed: int = 0) -> tuple[ViT, str]:
    """The standard ViT the stage starts from, and a one-line description of it.

    ``source``: :data:`PIPELINE` builds a seeded, untrained :func:`pretrain_config` ViT from
    ``architecture`` (patch, dim, depth, heads, mlp_hidden), trained by the stage; anything
    else goes through :func:`attncert.certvit.load_model` and :func:`fit_to_dataset`.
    """
    if source == PIPELINE:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_vit(pretrain_config(data, **architecture))
        return model, "a standard ViT trained by this stage"
    loaded = load_model(source)
    revision = hub_revision(loaded)
    model, notes = fit_to_dataset(loaded, data, seed)
    where = f"loaded from {source}" + (f" (hub revision {revision})" if revision else "")
    return model, "; ".join([where, *notes])


def phase_fingerprint(model: ViT, config: TrainConfig, dataset: str, data_source: str,
                      note: str = "", precision: str | None = None) -> dict[str, Any]:
    """The fingerprint of one training phase
    (:func:`attncert.training.checkpoint.fingerprint`), taken before it trains: its checkpoint
    folder (:func:`attncert.training.train.train_resumable`) is resumed only if it was written
    for the same model config, training config, dataset, starting weights (their hash,
    :func:`state_sha`), ``note`` (what else decides the phase, e.g. the fine-tune scope) and
    resolved training ``precision`` (when given); otherwise the folder is cleared.
    """
    start = f"{data_source}; initial weights {state_sha(model)}" + (f"; {note}" if note else "")
    return fingerprint(model.config, config, dataset, start, precision)


def bound_parameters(model: ViT) -> list[str]:
    """Names of the parameters the features' Lipschitz bound depends on.

    The weight of every linear map but the head (patch embedding, attention, MLPs) and the
    gain of every norm slot (:func:`attncert.certvit.global_bound` reads nothing else that
    trains). Biases, the class token, the position embedding and the head leave it unchanged
    (the certificate's radius is invariant to the head's scale as well).
    """
    names = []
    for name, m in model.named_modules():
        counted = (isinstance(m, nn.Linear) and name != "head"
                   or isinstance(m, ProjectNorm | CenterNorm | nn.LayerNorm))
        if counted and m.weight is not None:
            names.append(f"{name}.weight")
    return names


@contextlib.contextmanager
def frozen(model: nn.Module, names: Sequence[str]) -> Iterator[nn.Module]:
    """Exclude the named parameters from training inside the ``with`` block (no gradient:
    :func:`attncert.training.train.train`'s AdamW then leaves them, weight decay included,
    unchanged)."""
    params = dict(model.named_parameters())
    unknown = sorted(set(names) - set(params))
    if unknown:
        raise ValueError(f"no parameter named {unknown}")
    before = {n: params[n].requires_grad for n in names}
    try:
        for n in names:
            params[n].requires_grad_(False)
        yield model
    finally:
        for n, flag in before.items():
            params[n].requires_grad_(flag)


def finetune_scope(model: ViT, scope: str, masks: Mapping[str, Tensor]):
    """The context manager of the fine-tune after constraining (``with`` it around training).

    ``masked`` (CertViT): every parameter trains, the weights Douglas-Rachford set to zero
    stay zero (:func:`attncert.certvit.freeze_zeros` with ``masks``); the bound may grow.
    ``bound_free``: only the parameters outside :func:`bound_parameters` train, so the
    features' bound stays the constrained model's exactly.
    """
    if scope == "masked":
        return freeze_zeros(model, masks)
    if scope == "bound_free":
        return frozen(model, bound_parameters(model))
    raise ValueError(f"scope {scope!r}: choose from {', '.join(FINETUNE_SCOPES)}")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: choose from {', '.join(MODES)}")


def adaptation(mode: str, norm: str) -> Adaptation:
    """The adaptation of each mode: ``paper`` keeps the pre-trained pooling and head;
    ``spectral`` pools by the mean of all tokens (constant 1/sqrt(n) instead of 1) and applies
    unit head rows (a fixed Lipschitz margin in the loss keeps its meaning)."""
    _check_mode(mode)
    if mode == "paper":
        return Adaptation(norm=norm)
    return Adaptation(norm=norm, pool="mean", head_norm=True)


def calibration_slots(mode: str, model: ViT) -> list[str] | None:
    """The ProjectNorms whose radius :func:`attncert.certvit.calibrate_radii` sets: every one
    in ``paper`` (None); in ``spectral`` only the norms before attention, whose radius
    confines the attention's inputs to a small ball (a tighter attention constant); the
    others keep R = sqrt(D), since with gains <= 1 their radius costs nothing in the bound
    and a large R keeps the tokens' scale."""
    _check_mode(mode)
    if mode == "paper":
        return None
    return [f"blocks.{i}.norm_attn" for i in range(len(model.blocks))]


def constrain_mode(mode: str, model: ViT, images: Tensor, config: DRConfig,
                   budgets: Budgets | None = None, progress: bool = False
                   ) -> tuple[ViT, DRResult]:
    """Constrain a copy of ``model`` (which is left unchanged): ``paper`` runs CertViT's l1
    Douglas-Rachford (Algorithms 1-3); ``spectral`` the same splitting with each map's
    spectral-norm ball as the prox, then projects the norm gains (``budgets`` required)."""
    _check_mode(mode)
    if mode == "paper":
        result = constrain(model, images, config, progress=progress)
        return result.apply(copy.deepcopy(model)), result
    if budgets is None:
        raise ValueError("the spectral mode needs budgets")
    result = constrain_spectral(model, images, budgets, config, progress=progress)
    out = result.apply(copy.deepcopy(model))
    return project_(out, map_sets(out, budgets)), result


def finetune_context(mode: str, model: ViT, scope: str, masks: Mapping[str, Tensor],
                     budgets: Budgets | None = None):
    """The ``with`` context of the fine-tune after constraining: ``paper`` is
    :func:`finetune_scope`; ``spectral`` projects every map into its set after each optimiser
    step (:func:`attncert.certvit.spectral.projected`)."""
    _check_mode(mode)
    if mode == "paper":
        return finetune_scope(model, scope, masks)
    if budgets is None:
        raise ValueError("the spectral mode needs budgets")
    return projected(model, map_sets(model, budgets))


def margin_offset(model: ViT, budgets: Budgets, eps: float) -> float:
    """The offset L eps of the fine-tune's "radius" loss (:mod:`attncert.training.train`: each
    rival's gap per unit of head-row distance, the pairwise certificate's own margin), L the
    features'
    bound every model in the sets satisfies (:func:`attncert.certvit.spectral.budget_bound`):
    a gap above it certifies eps."""
    return budget_bound(model, budgets) * eps
