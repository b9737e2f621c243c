"""The SpecFormer study: five training methods on one ViT skeleton, attacked and timed.

Methods (standard ViTs that differ only where named; :mod:`attncert.models.vit`):

  vanilla     dot-product attention, LayerNorm, plain residuals
  specformer  vanilla + SpecFormer's MSVP (eq. 12-14, docs/math.md section 7)
  l2former    L2 attention with W^K = W^Q (Kim et al. 2021)
  lnformer    dot-product attention with LipschitzNorm (Dasoulas et al. 2021)
  lipsformer  CenterNorm + scaled cosine attention + x + alpha f(x) + spectral init (Qi et al. 2023)

Robustness is measured with the project's own attacks (:mod:`attncert.attacks`, pixel space,
untargeted, a success kept once found): FGSM and PGD-2 at l_inf 2/255 (SpecFormer Table 1),
CW-20 and PGD-20 at l_inf 8/255 (its Table 2) and L2 PGD. Robust accuracy = the fraction of
points the attack does not break (a clean error counts as broken).

:func:`step_times` measures the cost of one training step of each method side by side
(SpecFormer Table 3: MSVP costs 1.5x a vanilla step).

Two routes per method: ``scratch`` builds and trains the ViT of :func:`base_model_config`
(:func:`train_run`); a pre-trained source (a Hugging Face ``ViTForImageClassification`` hub id
or ``save_pretrained`` folder, e.g. ImageNet ViT-S/16 or DeiT-Ti as in SpecFormer's tables) is
read by :func:`attncert.certvit.load_model` into the same standard ViT, given a head for the
dataset's classes and the dataset's images upsampled inside the model
(:func:`attncert.certvit.methods.fit_to_dataset`, so eps stays in the dataset's pixel space), and
fine-tuned (:func:`finetune_run`). Only vanilla and SpecFormer fit pre-trained weights
(:data:`PRETRAINED_METHODS`); MSVP then penalises the checkpoint's own per-head W^Q, W^K, W^V.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor, nn

from attncert import attacks
from attncert.certvit.load import hub_revision, load_model
from attncert.certvit.methods import fit_to_dataset, phase_fingerprint
from attncert.data import as_float, subset_indices
from attncert.models import ViT, ViTConfig, build_vit
from attncert.models.config import dataset_vit_config
from attncert.msvp import MSVP, exact_head_sigma, sigma_rows
from attncert.pipeline import rng
from attncert.pipeline.batching import BatchSize, in_batches
from attncert.pipeline.device import resolve_device, resolve_precision
from attncert.training.checkpoint import fingerprint
from attncert.training.loop import optimizer
from attncert.training.train import TrainConfig, step_loss, train_resumable

METHODS = ("vanilla", "specformer", "l2former", "lnformer", "lipsformer")
#: Methods that keep the standard ViT, so a pre-trained checkpoint's weights fit them.
PRETRAINED_METHODS = ("vanilla", "specformer")
#: The source of a ViT built and trained from scratch (:func:`train_run`).
SCRATCH = "scratch"
ATTACKS = ("clean", "fgsm", "pgd_linf", "cw_linf", "pgd_l2")
_NAMES = {"clean": "clean", "fgsm": "FGSM", "pgd_linf": "PGD", "cw_linf": "CW",
          "pgd_l2": "L2-PGD"}


def data_config(data: Mapping[str, Any], normalize: str = "std", **kw: Any) -> ViTConfig:
    """A ViTConfig for a processed dataset (:func:`attncert.models.config.dataset_vit_config`, its
    ``normalize`` convention): "std" puts (x - mean) / std inside the model, "mean" only
    x - mean (1-Lipschitz, for certified models); ``kw``: the rest."""
    return dataset_vit_config(data, normalize, **kw)


def subset_train(data: Mapping[str, Any], max_train: int, seed: int) -> dict[str, Any]:
    """``data`` with a seeded subset of ``max_train`` training images (0 or more: all), the
    subset named in ``source`` (so checkpoints of another subset are not resumed); the
    normalisation statistics stay those of the full split."""
    n = len(data["train"]["y"])
    if max_train == 0 or max_train >= n:
        return dict(data)
    idx = subset_indices(n, max_train, seed)
    return {**data, "train": {k: v[idx] for k, v in data["train"].items()},
            "source": f"{data['source']}, {max_train} of {n} training images (seed {seed})"}


def train_run(model_cfg: ViTConfig, train_cfg: TrainConfig, data: Mapping[str, Any],
              dataset: str, ckpt_dir: str | Path, device: str | torch.device = "cpu",
              precision: str = "auto") -> tuple[ViT, list[dict[str, Any]], str]:
    """Build (seeded with ``train_cfg.seed``) and train one model at ``precision``
    (:mod:`attncert.training.precision`): (model, per-epoch rows, checkpoint status). A checkpoint
    in ``ckpt_dir`` written for the same run resumes; one written for another run is cleared
    (:func:`attncert.training.train.train_resumable`)."""
    precision = resolve_precision(precision, resolve_device(device))
    fp = fingerprint(model_cfg, train_cfg, dataset, data["source"], precision)
    torch.manual_seed(train_cfg.seed)
    model = build_vit(model_cfg)
    curves, status = train_resumable(model, data["train"], data["test"], train_cfg, ckpt_dir,
                                     device, fingerprint=fp, precision=precision)
    return model.eval(), curves, status


def run_label(dataset: str, source: str) -> str:
    """The name of a dataset's runs from ``source``: the dataset for :data:`SCRATCH`, else
    ``<dataset>@<last part of the source>`` (``cifar10@vit-small-patch16-224``)."""
    if source == SCRATCH:
        return dataset
    name = Path(str(source).rstrip("/")).name
    if not name:
        raise ValueError(f"source {source!r} names no model")
    return f"{dataset}@{name}"


def pretrained_model(source: str | Path, data: Mapping[str, Any], image_size: int,
                     seed: int = 0) -> tuple[ViT, list[str]]:
    """The standard ViT of a pre-trained ``source`` (hub id or ``save_pretrained`` folder, via
    :func:`attncert.certvit.load_model`) fitted to ``data``: a seeded head for its classes and
    its images upsampled inside the model to ``image_size`` (integer factor;
    :func:`attncert.certvit.methods.fit_to_dataset`). Returns the model (CPU, eval mode) and one
    note per change, the hub revision loaded first (part of the fine-tune's checkpoint
    fingerprint). Raises ValueError when the checkpoint's input size is not ``image_size``.
    """
    model = load_model(source)
    if model.config.image_size != image_size:
        raise ValueError(f"{source}: the checkpoint takes {model.config.image_size}-pixel "
                         f"images, specformer.image_size is {image_size}")
    revision = hub_revision(model)
    model, notes = fit_to_dataset(model, data, seed)
    return model, ([f"hub revision {revision}"] if revision else []) + notes


def finetune_run(source: str | Path, train_cfg: TrainConfig, data: Mapping[str, Any],
                 dataset: str, image_size: int, ckpt_dir: str | Path,
                 device: str | torch.device = "cpu", precision: str = "auto"
                 ) -> tuple[ViT, list[dict[str, Any]], str]:
    """Fine-tune the pre-trained ``source`` (:func:`pretrained_model`, head seeded with
    ``train_cfg.seed``) on ``data`` at ``precision``: (model, per-epoch rows, checkpoint
    status). The checkpoint in ``ckpt_dir`` resumes only for the same starting weights, model
    and training config, data and precision (:func:`attncert.certvit.methods.phase_fingerprint`).
    """
    precision = resolve_precision(precision, resolve_device(device))
    model, notes = pretrained_model(source, data, image_size, train_cfg.seed)
    fp = phase_fingerprint(model, train_cfg, dataset, data["source"],
                           f"{source}; " + "; ".join(notes), precision)
    curves, status = train_resumable(model, data["train"], data["test"], train_cfg, ckpt_dir,
                                     device, fingerprint=fp, precision=precision)
    return model.eval(), curves, status


def base_model_config(data: Mapping[str, Any], patch: int, dim: int, depth: int, heads: int,
                      mlp_hidden: int, block: str) -> ViTConfig:
    """The standard ViT every method starts from (:func:`method_model_config`): a class token,
    biased attention projections, (x - mean) / std inside the model, sized by ``data``."""
    return data_config(data, patch=patch, dim=dim, depth=depth, heads=heads,
                       mlp_hidden=mlp_hidden, kind="standard", block=block, pool="cls",
                       attn_bias=True)


def run_plan(methods: Sequence[str], adv_methods: Sequence[str], standard: TrainConfig,
             adversarial: TrainConfig) -> list[tuple[str, str, TrainConfig]]:
    """(training, method, train config before :func:`method_train_config`) of every run on
    one dataset: "standard" for each of ``methods``, then "adversarial" for ``adv_methods``."""
    return [("standard", m, standard) for m in methods] + [
        ("adversarial", m, adversarial) for m in adv_methods]


def method_model_config(method: str, base: ViTConfig, lipsformer_alpha: float) -> ViTConfig:
    """The ViT of ``method``: ``base`` (a standard ViT) with the method's attention and norms."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    options = {
        "l2former": {"attention": "l2"},
        "lnformer": {"attention": "lnformer"},
        "lipsformer": {"attention": "cosine", "norm": "center",
                       "residual_scale": lipsformer_alpha, "spectral_init": True},
    }.get(method, {})
    return dataclasses.replace(base, kind="standard", **options)


def method_train_config(method: str, base: TrainConfig,
                        msvp_lambda: Sequence[float]) -> TrainConfig:
    """``base`` with MSVP switched on for "specformer" only (and off for every other method)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    lam = tuple(msvp_lambda) if method == "specformer" else (0.0, 0.0, 0.0)
    return dataclasses.replace(base, msvp_lambda=lam)


# -- robustness ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class AttackSpec:
    """One attack: ``attack`` in :data:`ATTACKS`, radius ``eps`` (pixel space; l_inf for
    fgsm / pgd_linf / cw_linf, l2 for pgd_l2) and ``steps`` (1 for FGSM, 0 for clean)."""

    attack: str
    eps: float = 0.0
    steps: int = 0

    def __post_init__(self) -> None:
        if self.attack not in ATTACKS:
            raise ValueError(f"unknown attack {self.attack!r}; choose from {', '.join(ATTACKS)}")
        if self.attack != "clean" and not (self.eps > 0 and self.steps > 0):
            raise ValueError(f"{self.attack}: needs eps > 0 and steps > 0")

    @property
    def label(self) -> str:
        """SpecFormer's names with the radius: "clean", "FGSM 2/255", "PGD-2 2/255",
        "CW-20 8/255", "L2-PGD-20 0.5" (l_inf radii in units of 1/255 when whole)."""
        if self.attack == "clean":
            return "clean"
        name = _NAMES[self.attack] + ("" if self.attack == "fgsm" else f"-{self.steps}")
        if self.attack == "pgd_l2":
            return f"{name} {self.eps:g}"
        k = self.eps * 255
        return f"{name} {round(k)}/255" if abs(k - round(k)) < 1e-3 else f"{name} {self.eps:g}"

    def run(self, model: nn.Module, x: Tensor, y: Tensor,
            generator: torch.Generator | None = None) -> Tensor:
        """(B,) bool: the points this attack breaks (a clean error included)."""
        if self.attack == "clean":
            with torch.no_grad():
                return model(x).argmax(1) != y
        if self.attack == "fgsm":
            return attacks.fgsm_linf(model, x, y, self.eps)[1]
        fn = {"pgd_linf": attacks.pgd_linf, "cw_linf": attacks.cw_linf,
              "pgd_l2": attacks.pgd_l2}[self.attack]
        kwargs = {"restarts": 1} if self.attack == "pgd_l2" else {}
        return fn(model, x, y, self.eps, self.steps, generator=generator, **kwargs)[1]


def attack_specs(std_eps_255: float, adv_eval_eps_255: float, attack_steps: int,
                 attack_eps: Sequence[float]) -> list[AttackSpec]:
    """Every model's attacks: clean; FGSM and PGD-2 at l_inf ``std_eps_255`` / 255 (SpecFormer
    Table 1); CW-n and PGD-n (n = ``attack_steps``) at l_inf ``adv_eval_eps_255`` / 255 (its
    Table 2); L2 PGD-n at each radius of ``attack_eps`` (pixels)."""
    std_eps, adv_eval_eps = std_eps_255 / 255, adv_eval_eps_255 / 255
    return [AttackSpec("clean"), AttackSpec("fgsm", std_eps, 1),
            AttackSpec("pgd_linf", std_eps, 2),
            AttackSpec("cw_linf", adv_eval_eps, attack_steps),
            AttackSpec("pgd_linf", adv_eval_eps, attack_steps),
            *[AttackSpec("pgd_l2", e, attack_steps) for e in attack_eps]]


def eval_split(data: Mapping[str, Any], n_eval: int) -> tuple[Tensor, Tensor]:
    """The first ``n_eval`` test images (all of them if fewer) as floats in [0, 1], and their
    labels: the points every attack of :func:`robust_accuracy` is run on."""
    n = min(n_eval, len(data["test"]["y"]))
    return as_float(data["test"]["x"][:n]), data["test"]["y"][:n]


def robust_accuracy(model: nn.Module, x: Tensor, y: Tensor, specs: Sequence[AttackSpec],
                    batch_size: int = 500, seed: int = 0) -> list[dict[str, Any]]:
    """One row per attack: label, attack, eps, steps, accuracy (fraction NOT broken).

    ``x``: float images in [0, 1] on the model's device; the model runs in eval mode. Random
    starts come from a generator seeded with ``seed`` per attack (reproducible rows). On a
    CUDA out-of-memory error the batch halves and the same images are attacked again
    (:func:`attncert.pipeline.batching.in_batches`).
    """
    was_training = model.training
    model.eval()
    rows = []
    size = BatchSize(batch_size, "attack", x.device)  # grown once, for every attack
    for spec in specs:
        g = rng.generator(seed, x.device)
        def attack(a: int, b: int, spec: AttackSpec = spec, g: torch.Generator = g) -> Tensor:
            return spec.run(model, x[a:b], y[a:b], g).cpu()

        broken = torch.cat(in_batches(len(y), size, attack))
        rows.append({"attack": spec.label, "kind": spec.attack, "eps": spec.eps,
                     "steps": spec.steps, "accuracy": 1.0 - float(broken.double().mean())})
    model.train(was_training)
    return rows


def comparison_table(rows: Sequence[Mapping[str, Any]],
                     paper_rows: Sequence[Mapping[str, Any]] = ()) -> pd.DataFrame:
    """SpecFormer's Table 1/2 layout: (training, method) x (dataset, attack, source), in %.

    ``rows``: :func:`robust_accuracy` rows with ``training``, ``method`` and ``dataset``
    added. ``paper_rows``: the paper's cells (training, method, dataset, attack, accuracy in
    %), drawn as source "paper" beside ours (:func:`attncert.report.paper.specformer_rows`).
    """
    df = pd.DataFrame(rows).assign(source="ours")
    df["accuracy"] = 100 * df["accuracy"]
    if paper_rows:
        df = pd.concat([df, pd.DataFrame(paper_rows).assign(source="paper")],
                       ignore_index=True)
    order = list(dict.fromkeys(df["attack"]))
    table = df.pivot_table(index=["training", "method"], columns=["dataset", "attack", "source"],
                           values="accuracy", aggfunc="first")
    rows_order = sorted(table.index, key=lambda r: (r[0] != "standard", _method_rank(r[1])))
    return table.reindex(index=rows_order, columns=sorted(
        table.columns, key=lambda c: (c[0], order.index(c[1]), c[2] != "ours")))


def _method_rank(method: str) -> int:
    return METHODS.index(method) if method in METHODS else len(METHODS)


# -- spectral norms (Figure 2a) ---------------------------------------------------------------


def max_sigma_frame(models: Mapping[str, nn.Module]) -> pd.DataFrame:
    """(method, layer, depth, map, sigma): the largest exact singular value over the heads of
    W^Q, W^K, W^V at every attention layer (SpecFormer Figure 2a; :func:`exact_head_sigma`)."""
    df = pd.concat([pd.DataFrame(sigma_rows(exact_head_sigma(m))).assign(method=name)
                    for name, m in models.items()], ignore_index=True)
    return df.groupby(["method", "layer", "depth", "map"], as_index=False, sort=False)[
        "sigma"].max()


# -- cost of a training step (Table 3) -------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(models: Mapping[str, tuple[nn.Module, TrainConfig]], x: Tensor, y: Tensor,
               steps: int = 10, rounds: int = 5, warmup: int = 2) -> pd.DataFrame:
    """Seconds per training step of every method, measured side by side (interleaved).

    Each method trains a deep copy of its model (the originals are untouched) with its own
    optimiser (:func:`attncert.training.loop.optimizer`) and, when its config enables it, its own
    MSVP. One step = :func:`step_loss` (adversarial examples and MSVP included; batches are
    never mixed here), backward, optimiser step, on the same batch
    ``x, y`` (on the models' device) for every method. After ``warmup`` steps each, ``rounds``
    rounds time ``steps`` steps of every method in turn (the starting method rotates per round),
    so a change of machine load hits every method alike. Returns (method, round,
    seconds_per_step).
    """
    if steps <= 0 or rounds <= 0 or warmup < 0:
        raise ValueError("steps and rounds must be > 0, warmup >= 0")
    state = {}
    for name, (model, cfg) in models.items():
        m = copy.deepcopy(model).train()
        msvp = MSVP(m, *cfg.msvp_lambda, generator=rng.generator(cfg.seed, x.device)
                    ) if cfg.msvp_enabled else None
        opt = optimizer(list(m.parameters()), cfg)
        state[name] = (m, cfg, msvp, opt, rng.generator(cfg.seed, x.device))
    device = x.device

    def run(name: str, n: int) -> None:
        m, cfg, msvp, opt, g = state[name]
        for _ in range(n):
            _, loss = step_loss(m, x, y, cfg, msvp, g)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    names = list(state)
    for name in names:
        run(name, warmup)
    rows = []
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            _sync(device)
            t0 = time.perf_counter()
            run(name, steps)
            _sync(device)
            rows.append({"method": name, "round": r,
                         "seconds_per_step": (time.perf_counter() - t0) / steps})
    return pd.DataFrame(rows)


def step_time_ratios(times: pd.DataFrame, reference: str = "vanilla") -> pd.DataFrame:
    """Per method: median seconds per step and the median over rounds of the per-round ratio
    to ``reference`` (the ratio within a round cancels slow drifts of the machine's load)."""
    wide = times.pivot(index="round", columns="method", values="seconds_per_step")
    if reference not in wide:
        raise ValueError(f"no timing of the reference method {reference!r}")
    ratio = wide.div(wide[reference], axis=0)
    return pd.DataFrame({"seconds_per_step": wide.median(), "ratio": ratio.median(),
                         "ratio_min": ratio.min(), "ratio_max": ratio.max()}
                        ).reindex(list(dict.fromkeys(times["method"])))

