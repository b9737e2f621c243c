"""Typed schema of params.yaml, read once with YAML 1.2 semantics (as DVC reads it).

params.yaml is the single source of truth: every key is required, there are no hidden
defaults here. Each top-level section maps to a frozen dataclass whose fields carry their
type and an optional check. ``load_params`` validates the whole file and raises
``ParamsError`` with a one-line message naming the offending key.

One spelling per concept across sections: ``cert_eps`` lists the radii at which a bound or
certificate is evaluated, ``attack_eps`` radii that are only attacked, ``attack_steps`` and
``attack_restarts`` the PGD of an attack or soundness audit; ``adv_*`` is PGD adversarial
training.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

PARAMS_FILE = "params.yaml"

#: Image datasets the data stage can prepare, and the text datasets.
IMAGE_DATASETS = ("mnist", "fashion_mnist", "cifar10", "cifar100", "svhn")
TEXT_DATASETS = ("sst2", "yelp_polarity", "qqp")
DATASETS = IMAGE_DATASETS + TEXT_DATASETS
#: Small real evaluation sets shipped with the offline mirror.
SAMPLE_SETS = ("cifar10_sample", "imagenet_sample")
#: Training precisions (``attncert.precision``); certificates are always float64.
PRECISIONS = ("auto", "bf16", "tf32", "fp32")


class ParamsError(ValueError):
    """A params.yaml problem, phrased as one line that names the key."""


# ---------------------------------------------------------------------------- checks
Check = Callable[[str, Any], None]


def _fail(key: str, msg: str) -> typing.NoReturn:
    raise ParamsError(f"{key}: {msg}")


def nonneg(key: str, v: Any) -> None:
    values = v if isinstance(v, list) else [v]
    if any(x < 0 for x in values):
        _fail(key, f"must be >= 0, got {v!r}")


def positive(key: str, v: Any) -> None:
    values = v if isinstance(v, list) else [v]
    if any(x <= 0 for x in values):
        _fail(key, f"must be > 0, got {v!r}")


def one_of(*choices: str) -> Check:
    def check(key: str, v: Any) -> None:
        values = v if isinstance(v, list) else [v]
        bad = [x for x in values if x not in choices]
        if bad:
            _fail(key, f"unknown value {bad[0]!r}; choose from {', '.join(choices)}")

    return check


def one_of_numbers(*choices: float) -> Check:
    def check(key: str, v: Any) -> None:
        if v not in choices:
            _fail(key, f"must be one of {', '.join(map(str, choices))}, got {v!r}")

    return check


def unique(key: str, v: list) -> None:
    if len(set(v)) != len(v):
        _fail(key, f"has duplicate entries: {v!r}")


def device_spec(key: str, v: str) -> None:
    if v not in ("auto", "cpu", "cuda", "mps") and not (
        v.startswith("cuda:") and v[5:].isdigit()
    ):
        _fail(key, f"unknown device {v!r}; use auto, cpu, cuda, cuda:N or mps")


def dataclass_from_mapping(cls: type, d: Mapping[str, Any]) -> Any:
    """``cls(**d)`` for a dataclass, naming unknown keys instead of a TypeError."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; known: {sorted(names)}")
    return cls(**d)


def param(*checks: Check, doc: str = "") -> Any:
    """A required field with checks applied after type validation."""
    return field(metadata={"checks": checks, "doc": doc})


# ---------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class BaseParams:
    scale: str = param(one_of("paper", "cpu", "smoke"), doc="label of the scale profile")
    seed: int = param(nonneg)
    device: str = param(device_spec)
    precision: str = param(one_of(*PRECISIONS),
                           doc="training forward/loss: auto (bf16 on CUDA, fp32 elsewhere) | "
                               "bf16 | tf32 | fp32; certificates are always float64")


#: Lipschitz-ViT / standard-ViT settings shared by the grid (names of ``attncert.models``).
VIT_KINDS = ("lipschitz", "standard")
VIT_BLOCKS = ("stream", "prenorm")
VIT_POOLS = ("cls", "mean")
NORMALIZE = ("mean", "std", "none")
MARGINS = ("none", "lmt", "olsa")
AUGMENTS = ("none", "crop", "crop_flip")
CERT_VARIANTS = ("lofast_M", "lofast_xi", "naive", "specformer", "global")
CERT_TESTS = ("pairwise", "logit")
ADVERSARIAL = ("none", "pgd_linf")


@dataclass(frozen=True)
class VitGridParams:
    """The ViT grid (a DVC matrix: every combination is one train_vit and one certify_vit
    stage). A stage gets ONE value of each list through ``nbrun --item``."""

    runs_dir: str = param(doc="one folder per grid point: checkpoints, model, metrics")
    dataset: list[str] = param(one_of(*IMAGE_DATASETS), unique)
    depth: list[int] = param(positive, unique)
    heads: list[int] = param(positive, unique)
    gamma_vo: list[float] = param(positive, unique)


@dataclass(frozen=True)
class TrainVitParams:
    kind: str = param(one_of(*VIT_KINDS))
    patch: int = param(positive)
    dim: int = param(positive)
    mlp_hidden: int = param(positive)
    block: str = param(one_of(*VIT_BLOCKS))
    pool: str = param(one_of(*VIT_POOLS))
    radius_attn: float = param(positive)
    radius_stream: float | None = param(doc="null = sqrt(dim)")
    gamma_qk: float = param(positive)
    head_norm: bool = param(doc="head rows scaled to unit norm (margins are feature margins)")
    normalize: str = param(one_of(*NORMALIZE), doc="inside the model; eps stays in pixel space")
    epochs: int = param(positive)
    batch_size: int = param(positive)
    lr: float = param(positive)
    weight_decay: float = param(nonneg)
    warmup_steps: int = param(nonneg)
    margin: str = param(one_of(*MARGINS))
    lmt_offset: float = param(nonneg)
    olsa_gamma: float = param(nonneg)
    logit_scale: float = param(positive)
    augment: str = param(one_of(*AUGMENTS))
    grad_clip: float = param(nonneg)
    eval_batch_size: int = param(positive)
    msvp_lambda: list[float] = param(nonneg, doc="SpecFormer's MSVP (lam_q, lam_k, lam_v); 0 = off")
    adversarial: str = param(one_of(*ADVERSARIAL))
    adv_eps: float = param(positive, doc="l_inf radius of adversarial training (pixel space)")
    adv_steps: int = param(positive)

    def __post_init__(self) -> None:
        if self.radius_stream is not None and self.radius_stream <= 0:
            _fail("train_vit.radius_stream", f"must be > 0 or null, got {self.radius_stream!r}")
        if len(self.msvp_lambda) != 3:
            _fail("train_vit.msvp_lambda", f"needs 3 values, got {self.msvp_lambda!r}")


@dataclass(frozen=True)
class CertifyVitParams:
    n_test: int = param(positive, doc="first n test images (the same points for every variant)")
    cert_batch_size: int = param(positive)
    variants: list[str] = param(one_of(*CERT_VARIANTS), unique)
    tests: list[str] = param(one_of(*CERT_TESTS), unique)
    cert_softmax_lipschitz: float = param(one_of_numbers(0.5, 1.0))
    max_radius: float = param(positive)
    cert_eps: list[float] = param(positive, unique)
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    results_dir: str = param()


#: The training methods of the SpecFormer study (attncert.specformer.METHODS).
SPECFORMER_METHODS = ("vanilla", "specformer", "l2former", "lnformer", "lipsformer")
#: The methods a pre-trained source runs: the baselines swap attention or norms, so the
#: checkpoint's weights do not fit them. The source ``scratch`` is the ViT trained from scratch.
SPECFORMER_PRETRAINED_METHODS = ("vanilla", "specformer")
SPECFORMER_SCRATCH = "scratch"


def nonempty(key: str, v: list) -> None:
    if not v:
        _fail(key, "needs at least one entry")


@dataclass(frozen=True)
class SpecformerParams:
    """SpecFormer and the Lipschitz-attention baselines, attacked and compared (stage
    ``specformer``). l_inf radii are in units of 1/255 (pixel space), l2 radii in pixels."""

    datasets: list[str] = param(one_of(*IMAGE_DATASETS), unique)
    sources: list[str] = param(nonempty, unique,
                               doc="'scratch' (a ViT of patch/dim/depth/heads trained here) or "
                                   "a pre-trained ViTForImageClassification: HF hub id or "
                                   "save_pretrained folder, fine-tuned with the finetune_* recipe")
    image_size: int = param(positive, doc="input size of the pre-trained sources; images are "
                                          "upsampled to it inside the model (integer factor)")
    methods: list[str] = param(one_of(*SPECFORMER_METHODS), unique, doc="standard training")
    adv_methods: list[str] = param(one_of(*SPECFORMER_METHODS), unique,
                                   doc="PGD adversarial training ([] = none)")
    patch: int = param(positive)
    dim: int = param(positive)
    depth: int = param(positive)
    heads: int = param(positive)
    mlp_hidden: int = param(positive)
    block: str = param(one_of(*VIT_BLOCKS))
    max_train: int = param(nonneg, doc="seeded subset of every training split (0 = all)")
    lipsformer_alpha: float = param(positive, doc="LipsFormer's residual scale x + alpha f(x)")
    msvp_lambda: list[float] = param(nonneg, doc="(lam_q, lam_k, lam_v) of the specformer method")
    epochs: int = param(positive)
    adv_epochs: int = param(positive)
    batch_size: int = param(positive)
    lr: float = param(positive)
    weight_decay: float = param(nonneg)
    warmup_steps: int = param(nonneg)
    augment: str = param(one_of(*AUGMENTS))
    adv_eps_255: float = param(positive, doc="adversarial training radius (l_inf, x 1/255)")
    adv_steps: int = param(positive)
    finetune_epochs: int = param(positive, doc="pre-trained sources: standard fine-tune")
    finetune_adv_epochs: int = param(positive, doc="pre-trained sources: PGD fine-tune")
    finetune_batch_size: int = param(positive)
    finetune_lr: float = param(positive)
    finetune_weight_decay: float = param(nonneg)
    finetune_warmup_steps: int = param(nonneg)
    finetune_grad_clip: float = param(nonneg, doc="max global gradient norm (0 = off)")
    n_eval: int = param(positive, doc="first n test images attacked")
    eval_batch_size: int = param(positive)
    std_eps_255: float = param(positive, doc="FGSM and PGD-2 radius (l_inf, x 1/255)")
    adv_eval_eps_255: float = param(positive, doc="CW and PGD radius (l_inf, x 1/255)")
    attack_steps: int = param(positive, doc="CW-n, PGD-n and L2 PGD steps")
    attack_eps: list[float] = param(positive, unique, doc="L2 PGD radii (pixels; attacked, "
                                                           "not certified)")
    timing_steps: int = param(positive)
    timing_rounds: int = param(positive)
    timing_warmup: int = param(nonneg)
    cert_patch: int = param(positive)
    cert_dim: int = param(positive)
    cert_depth: int = param(positive)
    cert_heads: int = param(positive)
    cert_gamma_qk: float = param(positive)
    cert_gamma_vo: float = param(positive)
    cert_radius_attn: float = param(positive)
    cert_epochs: int = param(positive)
    cert_lr: float = param(positive)
    cert_lmt_offset: float = param(nonneg)
    cert_logit_scale: float = param(positive)
    cert_msvp_lambda: list[float] = param(nonneg)
    cert_n_test: int = param(positive)
    cert_eps: list[float] = param(positive, unique)
    results_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        for key in ("msvp_lambda", "cert_msvp_lambda"):
            if len(getattr(self, key)) != 3:
                _fail(f"specformer.{key}", f"needs 3 values, got {getattr(self, key)!r}")
        for key, dim, heads in (("heads", self.dim, self.heads),
                                ("cert_heads", self.cert_dim, self.cert_heads)):
            if dim % heads:
                _fail(f"specformer.{key}", f"{dim} is not divisible by {heads} heads")
        if "vanilla" not in self.methods:
            _fail("specformer.methods", "needs vanilla (the reference of the step-time ratios)")
        pretrained = [s for s in self.sources if s != SPECFORMER_SCRATCH]
        for key in ("methods", "adv_methods"):
            bad = [m for m in getattr(self, key) if m not in SPECFORMER_PRETRAINED_METHODS]
            if pretrained and bad:
                _fail(f"specformer.{key}", f"the pre-trained weights of {pretrained[0]!r} do not "
                      f"fit {', '.join(bad)} (the baselines change the ViT's attention or "
                      f"norms); with a pre-trained source use "
                      f"{', '.join(SPECFORMER_PRETRAINED_METHODS)}, the baselines with "
                      f"sources: [{SPECFORMER_SCRATCH}]")


#: CertViT's LayerNorm replacements (names of ``attncert.certvit.NORMS``) and fine-tune losses.
CERTVIT_NORMS = ("project", "center", "identity")
CERTVIT_MARGINS = ("none", "lmt")
CERTVIT_FINETUNE_SCOPES = ("masked", "bound_free")
#: CertViT's constraining modes (``attncert.certvit.stage.MODES``): the paper's l1
#: Douglas-Rachford, and spectral-norm balls per map (the certifiable mode).
CERTVIT_MODES = ("paper", "spectral")
#: CertViT's MNIST eps (Table 1): the report compares certified accuracy at it.
CERTVIT_EPS = 1.58


def unit_interval(key: str, v: float) -> None:
    if not 0 <= v < 1:
        _fail(key, f"must be in [0, 1), got {v!r}")


@dataclass(frozen=True)
class CertvitParams:
    """CertViT: a pre-trained standard ViT, adapted (L2 attention, Lipschitz norms),
    constrained by Douglas-Rachford splitting, fine-tuned with the sparsity mask, certified."""

    source: str = param(doc="'pipeline' (train a standard ViT here), an HF hub id, an HF "
                            "folder or a save_vit checkpoint file")
    dataset: str = param(one_of(*IMAGE_DATASETS))
    processed_dir: str = param(doc="the data stage's processed_dir")
    patch: int = param(positive, doc="the pipeline's standard ViT (source 'pipeline' only)")
    dim: int = param(positive)
    depth: int = param(positive)
    heads: int = param(positive)
    mlp_hidden: int = param(positive)
    pretrain_epochs: int = param(nonneg, doc="pipeline: training from scratch; loaded: "
                                             "fine-tuning on the dataset (0 = as loaded)")
    batch_size: int = param(positive)
    lr: float = param(positive, doc="pre-training and adaptation fine-tune")
    weight_decay: float = param(nonneg)
    warmup_steps: int = param(nonneg)
    norm: str = param(one_of(*CERTVIT_NORMS), doc="LayerNorm replacement")
    radius_quantile: float = param(unit_interval, doc="ProjectNorm radius: this quantile of "
                                                      "the pre-trained token norms")
    adapt_epochs: int = param(nonneg)
    dr_threshold: float = param(positive, doc="soft threshold / RMS of the layer's weights")
    dr_eta: float = param(positive, doc="output tolerance / RMS of the layer's outputs")
    dr_relaxation: float = param(positive)
    dr_iterations: int = param(positive)
    dr_projection_steps: int = param(positive)
    dr_batch_size: int = param(positive, doc="recorded pairs per constraint set")
    dr_max_pairs: int = param(positive, doc="recorded pairs per layer")
    dr_images: int = param(positive, doc="training images whose tokens are recorded")
    finetune_epochs: int = param(nonneg, doc="the fine-tune after constraining")
    finetune_scope: str = param(one_of(*CERTVIT_FINETUNE_SCOPES),
                                doc="masked: every weight, pruned ones kept at zero; "
                                    "bound_free: only what the bound does not depend on")
    finetune_lr: float = param(positive)
    finetune_margin: str = param(one_of(*CERTVIT_MARGINS))
    lmt_offset: float = param(nonneg)
    constrain: list[str] = param(one_of(*CERTVIT_MODES), unique,
                                 doc="modes run side by side: paper (l1 Douglas-Rachford, "
                                     "the steps above) | spectral (spectral-norm balls)")
    budget_embed: float = param(positive, doc="spectral: ||E|| / min(std) of the patch "
                                              "embedding with the input normalisation")
    budget_q: float = param(positive, doc="spectral: ||W^Q|| of every head")
    budget_v: float = param(positive, doc="spectral: ||W^V|| of every head")
    budget_o: float = param(positive, doc="spectral: ||W^O||")
    budget_fc1: float = param(positive, doc="spectral: ||W_1|| of every MLP")
    budget_fc2: float = param(positive, doc="spectral: ||W_2|| of every MLP")
    budget_gain: float = param(positive, doc="spectral: max|gamma| of every norm")
    spectral_epochs: int = param(nonneg, doc="spectral: projected fine-tune after constraining")
    spectral_lr: float = param(positive)
    margin_eps: float = param(nonneg, doc="spectral: the radius loss's eps (offset L eps, "
                                          "L the sets' bound)")
    logit_scale: float = param(positive, doc="spectral: CE temperature (loss only)")
    n_test: int = param(positive)
    eval_batch_size: int = param(positive)
    cert_eps: list[float] = param(positive, unique)
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    imagenet_smoke: bool = param(doc="a tiny HF ViT through the same loader on the ImageNet "
                                     "sample")
    work_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            _fail("certvit.heads", f"dim = {self.dim} is not divisible by heads = {self.heads}")
        if not 0 < self.dr_relaxation < 2:
            _fail("certvit.dr_relaxation", f"must be in (0, 2), got {self.dr_relaxation!r}")
        if not self.constrain:
            _fail("certvit.constrain", "needs at least one mode (paper, spectral)")
        if CERTVIT_EPS not in self.cert_eps:
            _fail("certvit.cert_eps", f"must include {CERTVIT_EPS} (CertViT's MNIST eps, "
                                      "compared in the report)")


#: Bound variants of attncert.certify usable on LoFAST's text transformer (pairwise test).
TEXT_LOFAST_VARIANTS = ("lofast_M", "lofast_xi", "naive", "global")
#: OLSA layer residuals (attncert.text.olsa.RESIDUALS; not imported: params stays torch-free).
TEXT_OLSA_RESIDUALS = ("averaged", "gated")


@dataclass(frozen=True)
class TextParams:
    """SST-2 sentiment transformers (stage ``text``): OLSA by depth and gamma, Kim et al.'s L2
    attention, a standard transformer of the same size, LoFAST's small-BERT grid and OLSA over
    a frozen pre-trained encoder; eps is l2 in each model's embedding space."""

    tokenizer: str = param(doc="'minilm-package' (offline), a hub id or a save_pretrained folder")
    max_len: int = param(positive)
    max_train: int = param(nonneg, doc="seeded subset of the training split (0 = all)")
    max_eval: int = param(nonneg, doc="seeded subset of the dev and test splits (0 = all)")
    olsa_depths: list[int] = param(positive, unique)
    heads: int = param(positive, doc="OLSA, Kim-L2, the standard transformer, the frozen head")
    hidden: int = param(positive)
    gamma: float = param(nonneg, doc="certificate regulariser after its ramp (OLSA: 2.0)")
    gamma_ramp: float = param(nonneg, doc="fraction of all steps gamma grows over (<= 1)")
    gamma_ablation: list[float] = param(nonneg, unique, doc="gammas of the deepest OLSA")
    epochs: int = param(positive)
    batch_size: int = param(positive)
    lr: float = param(positive, doc="OLSA-family models (OLSA, Kim-L2, the frozen head)")
    vanilla_lr: float = param(positive, doc="the standard transformer")
    warmup_steps: int = param(nonneg)
    logit_scale: float = param(positive, doc="CE temperature (loss only; never the certificate)")
    olsa_alpha1: float = param(positive, doc="initial alpha1 of every OLSA attention (OLSA: 4)")
    olsa_residual: str = param(one_of(*TEXT_OLSA_RESIDUALS),
                               doc="averaged: OLSA's 0.5 x + 0.5 f(x); gated: trainable "
                                   "(1 - b) x + b f(x), one b = sigmoid(theta) per sublayer")
    olsa_residual_init: float = param(doc="initial b of the gated residual, in (0, 1)")
    lofast_layers: list[int] = param(positive, unique)
    lofast_heads: list[int] = param(positive, unique)
    lofast_gamma_vo: list[float] = param(positive, unique)
    lofast_dim: int = param(positive)
    lofast_mlp_hidden: int = param(positive)
    lofast_gamma_qk: float = param(positive)
    lofast_radius_attn: float = param(positive)
    lofast_variants: list[str] = param(one_of(*TEXT_LOFAST_VARIANTS), unique)
    lofast_epochs: int = param(positive)
    lofast_lr: float = param(positive)
    lofast_logit_scale: float = param(positive, doc="CE temperature of the LoFAST grid (its "
                                                    "head is free, unlike OLSA's)")
    frozen_source: str = param(doc="the frozen encoder: 'minilm-package', a hub id or a folder")
    frozen_epochs: int = param(positive)
    frozen_max_train: int = param(nonneg, doc="seeded subset of the whole training split "
                                              "for the frozen-encoder head, independent of "
                                              "max_train (0 = all of it)")
    attention_alpha1: list[float] = param(positive, unique, doc="the attention sweep: the "
                                          "deepest OLSA, averaged residual, alpha1 fixed at "
                                          "each value (empty: no sweep)")
    n_test: int = param(nonneg, doc="first n test sentences certified (0 = the whole split)")
    n_attack: int = param(positive, doc="first n certified sentences attacked (PGD audit)")
    cert_batch_size: int = param(positive)
    cert_eps: list[float] = param(positive, unique)
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    results_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            _fail("text.heads", f"hidden = {self.hidden} is not divisible by {self.heads}")
        for h in self.lofast_heads:
            if self.lofast_dim % h:
                _fail("text.lofast_heads", f"lofast_dim = {self.lofast_dim} is not divisible "
                                           f"by {h}")
        if not self.lofast_variants:
            _fail("text.lofast_variants", "needs at least one variant")
        if self.gamma_ramp > 1:
            _fail("text.gamma_ramp", f"must be in [0, 1], got {self.gamma_ramp!r}")
        if not 0 < self.olsa_residual_init < 1:
            _fail("text.olsa_residual_init", f"must be in (0, 1) (b = sigmoid(theta)), got "
                                             f"{self.olsa_residual_init!r}")


#: LoFAST's certificate variants and the auto_LiRPA methods compared in stage ``crown``.
CROWN_LOFAST = ("lofast_M", "lofast_xi")
CROWN_METHODS = ("crown", "alpha_crown")


@dataclass(frozen=True)
class CrownParams:
    """LoFAST vs CROWN / alpha-CROWN (auto_LiRPA) and their combination (LoFAST Tables 1-2):
    Lipschitz ViTs of each depth trained in the stage, l2 balls in pixel space."""

    dataset: str = param(one_of(*IMAGE_DATASETS))
    depths: list[int] = param(positive, unique, doc="one ViT per depth (LoFAST: 3, 4, 5)")
    patch: int = param(positive)
    dim: int = param(positive)
    heads: int = param(positive)
    mlp_hidden: int = param(positive)
    pool: str = param(one_of(*VIT_POOLS))
    radius_attn: float = param(positive)
    gamma_qk: float = param(positive)
    gamma_vo: float = param(positive)
    normalize: str = param(one_of(*NORMALIZE))
    max_train: int = param(nonneg, doc="first n training images (0 = all)")
    epochs: int = param(positive)
    batch_size: int = param(positive)
    lr: float = param(positive)
    warmup_steps: int = param(nonneg)
    lmt_offset: float = param(nonneg)
    logit_scale: float = param(positive)
    n_test: int = param(positive, doc="first n test images, the same for every method")
    cert_eps: list[float] = param(positive, unique)
    lofast_variant: str = param(one_of(*CROWN_LOFAST))
    methods: list[str] = param(one_of(*CROWN_METHODS), unique)
    bound_dtype: str = param(one_of("float64", "float32"),
                             doc="CROWN's arithmetic: float64 for a certificate")
    alpha_iterations: int = param(positive)
    time_limit: float = param(nonneg, doc="seconds per (point, eps) bound; 0 = none")
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    work_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            _fail("crown.heads", f"dim = {self.dim} is not divisible by heads = {self.heads}")
        if not self.methods:
            _fail("crown.methods", "needs at least one method")


#: Every section of params.yaml, in file order: its dataclass, or ``"module:Class"`` for a
#: section owned by a stage module (``attncert.stages``), imported when params are validated
#: (a stage module imports this one for its checks, so it is not imported here at load time).
SECTIONS: dict[str, type | str] = {
    "base": BaseParams,
    "data": "attncert.stages.data:Params",
    "tightness": "attncert.stages.tightness:Params",
    "vit_grid": VitGridParams,
    "train_vit": TrainVitParams,
    "certify_vit": CertifyVitParams,
    "specformer": SpecformerParams,
    "certvit": CertvitParams,
    "crown": CrownParams,
    "text": TextParams,
    "figures": "attncert.stages.figures:Params",
}


# ---------------------------------------------------------------------------- typing
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` (ints widened to float where a float is declared) or raise."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp,) = typing.get_args(tp)[:1]
        if not isinstance(value, list):
            _fail(key, f"expected a list of {_type_name(item_tp)}, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _check_type(key, value, alt)
            except ParamsError:
                continue
        _fail(key, f"expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is not None:
            _fail(key, f"expected null, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            _fail(key, f"expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            _fail(key, f"expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            _fail(key, f"expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            _fail(key, f"expected string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported schema type {tp!r} for {key}")  # a bug in this module


def parse_section(name: str, raw: Any, cls: type) -> Any:
    """Validate one section's mapping against its dataclass; return the instance."""
    if not isinstance(raw, Mapping):
        _fail(name, f"expected a mapping of parameters, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        close = _closest(unknown[0], fields)
        hint = f" (did you mean {close!r}?)" if close else ""
        _fail(f"{name}.{unknown[0]}", f"unknown parameter{hint}")
    missing = [k for k in fields if k not in raw]
    if missing:
        _fail(f"{name}.{missing[0]}", "missing (params.yaml must set every parameter)")
    values = {}
    for key, f in fields.items():
        full = f"{name}.{key}"
        v = _check_type(full, raw[key], hints[key])
        for check in f.metadata.get("checks", ()):
            check(full, v)
        values[key] = v
    return cls(**values)


def _closest(word: str, options) -> str | None:
    import difflib

    hit = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return hit[0] if hit else None


# ---------------------------------------------------------------------------- loading
def yaml_12(typ: str = "safe") -> YAML:
    y = YAML(typ=typ, pure=True)
    y.version = (1, 2)
    return y


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: file not found")
    try:
        return yaml_12().load(path.read_text())
    except Exception as exc:  # ruamel's errors are multi-line; keep the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ParamsError(f"{path}: invalid YAML: {first}") from exc


@dataclass(frozen=True)
class Params:
    """All sections of params.yaml, validated."""

    sections: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.sections[name]

    def notebook_parameters(self, names: list[str], declared: Sequence[str],
                            items: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The values passed to a stage's notebook for the ``--section`` entries ``names``.

        A whole section whose name the notebook declares is passed as one dict (the stage
        module parses it back into its dataclass); any other entry passes its fields one by
        one, as :meth:`flat`. ``items`` picks the grid point as in :meth:`flat`.
        """
        flat = self.flat(names, items)
        whole = [n for n in names if "." not in n and n in declared]
        out = {k: v for k, v in flat.items()
               if not any(k in self.field_names(n) for n in whole)}
        for name in whole:
            out[name] = {k: flat[k] for k in self.field_names(name)}
        return out

    def field_names(self, name: str) -> list[str]:
        return [f.name for f in dataclasses.fields(self.sections[name])]

    def flat(self, names: list[str], items: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The fields of the given sections as one flat dict (notebook parameters).

        A name ``section.key`` passes that one parameter (as DVC lists granular params).

        ``items`` picks one grid point (a DVC matrix item): ``{key: text}`` replaces the list
        field ``key`` of a given section by the single value ``text`` (parsed as YAML 1.2),
        which must be one of the list's values. A section with any item needs one for each of
        its list fields.
        """
        items = dict(items or {})
        out: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for entry in names:
            name, _, only = entry.partition(".")
            if name not in self.sections:
                raise ParamsError(f"{name}: unknown section; known: {', '.join(self.sections)}")
            fields = dataclasses.asdict(self.sections[name])
            if only and only not in fields:
                raise ParamsError(f"{entry}: unknown parameter")
            for key, value in fields.items():
                if only and key != only:
                    continue
                if key in out:
                    raise ParamsError(f"{name}.{key}: name also used by another section")
                out[key], owner[key] = value, name
        for key, text in items.items():
            if key not in out or not isinstance(out[key], list):
                lists = sorted(k for k, v in out.items() if isinstance(v, list))
                raise ParamsError(f"--item {key}: not a list parameter of the sections "
                                  f"{', '.join(names)} (lists: {', '.join(lists)})")
            full = f"{owner[key]}.{key}"
            hints = typing.get_type_hints(type(self.sections[owner[key]]))
            (item_tp,) = typing.get_args(hints[key])
            value = _check_type(f"--item {key}", _parse_scalar(full, text), item_tp)
            if value not in out[key]:
                raise ParamsError(f"--item {key}={text}: not in {full} = {out[key]}")
            out[key] = value
        for name in {owner[k] for k in items}:
            for key, value in dataclasses.asdict(self.sections[name]).items():
                if isinstance(value, list) and key not in items:
                    raise ParamsError(f"{name}.{key}: a grid point needs --item {key}=VALUE")
        return out


def validate(raw: Any, source: str = PARAMS_FILE) -> Params:
    if not isinstance(raw, Mapping):
        raise ParamsError(f"{source}: expected a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        close = _closest(unknown[0], SECTIONS)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ParamsError(f"{unknown[0]}: unknown section{hint}")
    missing = [s for s in SECTIONS if s not in raw]
    if missing:
        raise ParamsError(f"{missing[0]}: section missing from {source}")
    return Params({name: parse_section(name, raw[name], section_class(name))
                   for name in SECTIONS})


def _parse_scalar(key: str, text: str) -> Any:
    try:
        return yaml_12().load(text)
    except Exception as exc:
        raise ParamsError(f"--item {key}: cannot parse {text!r}") from exc


def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and validate params.yaml (YAML 1.2: ``1e-3`` is a float, ``yes`` a string)."""
    return validate(read_yaml(path), str(path))


def section_class(name: str) -> type:
    """The dataclass of section ``name`` (importing its stage module if a stage owns it)."""
    if name not in SECTIONS:
        raise ParamsError(f"{name}: unknown section; known: {', '.join(SECTIONS)}")
    entry = SECTIONS[name]
    if isinstance(entry, str):
        module, _, attr = entry.partition(":")
        entry = getattr(importlib.import_module(module), attr)
    return entry


def section_fields(name: str) -> list[str]:
    return [f.name for f in dataclasses.fields(section_class(name))]


def dump_yaml(data: Any) -> str:
    buf = io.StringIO()
    yaml_12("rt").dump(data, buf)
    return buf.getvalue()
