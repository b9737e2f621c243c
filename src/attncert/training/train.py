"""Training loop: cross-entropy (+ an optional margin term), AdamW or SGD, per-step cosine
schedule, seeded data order, an atomic checkpoint every epoch and resume from it.

The loss: :func:`attncert.training.losses.training_loss` (CE at ``logit_scale`` plus the ``margin``
term). Optional terms, off by default:
  msvp_lambda = (lam_q, lam_k, lam_v), any > 0: + SpecFormer's MSVP (eq. 12-14, docs/math.md sec. 7;
          :class:`attncert.msvp.MSVP`, its power-iteration vectors checkpointed: exact resume);
  adversarial = "pgd_linf": PGD adversarial training (Madry et al. 2018, SpecFormer's
          Table 2): every batch is replaced by CE-PGD examples, ||x' - x||_inf <= adv_eps,
          adv_steps steps of 2.5 adv_eps / adv_steps from a random start drawn from the
          epoch's generator (resume stays exact); train_acc is then the adversarial accuracy.
          The attack differentiates the input only (the parameters' gradients are off while
          it runs), and under CUDA graphs each of its passes is a graph step of its own
          (:func:`attncert.training.compiled.each_call_a_step`).
  attn_entropy > 0: + attn_entropy x the attention rows' mean entropy / log n
          (:func:`attncert.training.certified_training.attention_entropy`).
Mixup / CutMix (:mod:`attncert.training.mix`, off by default): with probability mix_prob a batch is
mixed with itself reversed, and the loss is lam CE(s f, y) + (1 - lam) CE(s f, y_rev); only
with margin "none" and without adversarial training. train_acc counts the batch's own labels.

Speed: the training set moves to the device once (uint8 images stay uint8 there); each batch is
indexed, converted and augmented on the device with the epoch's generator, which lives there.
The forward pass and loss run at ``precision`` (:mod:`attncert.training.precision`: bf16 autocast
on CUDA by default, float32 on CPU); evaluation and all after training run outside autocast.

The epoch loop (optimiser, schedule, checkpoint, metrics file, resume; shared with the text
models) is :mod:`attncert.training.loop`; :func:`train_resumable` adds the fingerprint check
(:mod:`attncert.training.checkpoint`): a run whose settings changed starts over.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.attacks import pgd_linf
from attncert.data import as_float
from attncert.msvp import MSVP, penalty
from attncert.pipeline import rng
from attncert.pipeline.device import resolve_device, resolve_precision
from attncert.pipeline.params import dataclass_from_mapping
from attncert.training import certified_training, compiled
from attncert.training import mix as mixing
from attncert.training.checkpoint import CHECKPOINT, FINGERPRINT, METRICS, prepare_checkpoint_dir
from attncert.training.loop import OPTIMIZERS, Steps, run_epochs, sum_dtype
from attncert.training.losses import MARGINS, training_loss

AUGMENTS = ("none", "crop", "crop_flip")
ADVERSARIAL = ("none", "pgd_linf")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; every field is validated (a ValueError names the field)."""

    epochs: int = 10
    batch_size: int = 128
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    margin: str = "none"
    lmt_offset: float = 0.0
    olsa_gamma: float = 0.0
    logit_scale: float = 1.0  # CE temperature (see the module docstring)
    augment: str = "none"  # random 4-pixel-padded crops (+ horizontal flips)
    grad_clip: float = 0.0  # max global grad norm; 0 = off
    eval_batch_size: int = 1000
    msvp_lambda: tuple[float, float, float] = (0.0, 0.0, 0.0)  # (lam_q, lam_k, lam_v); 0 = off
    adversarial: str = "none"  # "pgd_linf": PGD adversarial training (module docstring)
    adv_eps: float = 8 / 255  # l_inf radius in pixel space
    adv_steps: int = 10
    optimizer: str = "adamw"  # adamw | sgd (attncert.training.loop.optimizer)
    momentum: float = 0.9  # sgd only
    mixup_alpha: float = 0.0  # Mixup / CutMix (attncert.training.mix); mix_prob 0 = off
    cutmix_alpha: float = 0.0
    mix_prob: float = 0.0
    mix_switch_prob: float = 0.5
    lofast_eps: float = 0.0  # margin "lofast": the training radius (pixel l2)
    lofast_ramp: float = 0.0  # share of all steps over which it grows from 0
    lofast_start: float = 0.0  # share of all steps trained with the plain CE before it starts
    lofast_mix: float = 1.0  # weight of the margin's CE against the plain CE
    attn_entropy: float = 0.0  # + this x the attention rows' mean entropy / log n; 0 = off
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "batch_size", "eval_batch_size", "adv_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TrainConfig.{name} must be a positive int, got {v!r}")
        for name in ("warmup_steps", "seed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be an int >= 0, got {v!r}")
        for name in ("lr", "logit_scale"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"TrainConfig.{name} must be a number > 0, got {v!r}")
        for name in ("weight_decay", "lmt_offset", "olsa_gamma", "grad_clip", "lofast_eps",
                     "lofast_ramp", "attn_entropy"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                raise ValueError(f"TrainConfig.{name} must be a number >= 0, got {v!r}")
        lam = self.msvp_lambda
        lam = (lam,) * 3 if isinstance(lam, int | float) and not isinstance(lam, bool) else lam
        if (not isinstance(lam, list | tuple) or len(lam) != 3 or any(
                isinstance(v, bool) or not isinstance(v, int | float) or v < 0 for v in lam)):
            raise ValueError("TrainConfig.msvp_lambda must be one number or three (lam_q, "
                             f"lam_k, lam_v), each >= 0, got {self.msvp_lambda!r}")
        object.__setattr__(self, "msvp_lambda", tuple(float(v) for v in lam))
        if isinstance(self.adv_eps, bool) or not isinstance(self.adv_eps, int | float) or not (
                self.adv_eps > 0):
            raise ValueError(f"TrainConfig.adv_eps must be a number > 0, got {self.adv_eps!r}")
        for name in ("momentum", "lofast_start"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not 0 <= v < 1:
                raise ValueError(f"TrainConfig.{name} must be a number in [0, 1), got {v!r}")
        if isinstance(self.lofast_mix, bool) or not isinstance(self.lofast_mix, int | float) or (
                not 0 <= self.lofast_mix <= 1) or self.lofast_ramp > 1:
            raise ValueError(f"TrainConfig.lofast_mix and lofast_ramp must be in [0, 1], got "
                             f"{self.lofast_mix!r}, {self.lofast_ramp!r}")
        if self.margin == "lofast" and not self.lofast_eps > 0:
            raise ValueError("TrainConfig: margin 'lofast' needs a training radius lofast_eps > 0")
        try:
            spec = self.mix_spec
        except ValueError as e:
            raise ValueError(f"TrainConfig: {e}") from None
        if spec.enabled and (self.margin != "none" or self.adversarial != "none"):
            raise ValueError("TrainConfig: Mixup / CutMix (mix_prob > 0) needs margin 'none' "
                             f"and adversarial 'none', got margin {self.margin!r}, "
                             f"adversarial {self.adversarial!r}")
        for name, choices in (("margin", MARGINS), ("augment", AUGMENTS),
                              ("adversarial", ADVERSARIAL), ("optimizer", OPTIMIZERS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"TrainConfig.{name} = {getattr(self, name)!r}: choose from "
                                 f"{', '.join(choices)}")

    @property
    def mix_spec(self) -> mixing.MixSpec:
        return mixing.MixSpec(mixup_alpha=self.mixup_alpha, cutmix_alpha=self.cutmix_alpha,
                              mix_prob=self.mix_prob, mix_switch_prob=self.mix_switch_prob)

    @property
    def msvp_enabled(self) -> bool:
        return any(v > 0 for v in self.msvp_lambda)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        return dataclass_from_mapping(cls, d)

    def steps(self, model: nn.Module, train_data: Any, device: torch.device) -> ImageSteps:
        """The batches and loss of a run with this config (:class:`ImageSteps`)."""
        return ImageSteps(model, train_data, self, device)


# -- data ------------------------------------------------------------------------------------


def _xy(data: Any) -> tuple[Tensor, Tensor]:
    """(x, y) from a (x, y) pair or a {"x", "y"} split of a processed dataset."""
    if isinstance(data, Mapping):
        return data["x"], data["y"]
    x, y = data
    return x, y


def _to_float(x: Tensor) -> Tensor:
    return as_float(x) if x.dtype == torch.uint8 else x.float()


def epoch_generator(seed: int, epoch: int, device: torch.device | str = "cpu"
                    ) -> torch.Generator:
    """The generator of one epoch's order and augmentation, on ``device`` (where the batches
    are drawn): resuming needs no saved state. On a CPU the draws are those of every earlier
    version; on another device they are that device's stream for the same seed."""
    return rng.generator(seed * 1_000_003 + epoch, device)


def augment_batch(x: Tensor, mode: str, g: torch.Generator, pad: int = 4) -> Tensor:
    """Random crops of the zero-padded images (and horizontal flips for "crop_flip"), batched
    on x's device with ``g`` (a generator on that device); no host synchronisation."""
    if mode == "none":
        return x
    b, c, h, w = x.shape
    dev = x.device
    padded = F.pad(x, (pad, pad, pad, pad))
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=dev)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=g, device=dev)
    rows = (dy[:, None] + torch.arange(h, device=dev))[:, None, :, None]
    out = padded.gather(2, rows.expand(b, c, h, w + 2 * pad))
    cols = (dx[:, None] + torch.arange(w, device=dev))[:, None, None, :]
    out = out.gather(3, cols.expand(b, c, h, w))
    if mode == "crop_flip":
        flip = torch.rand(b, generator=g, device=dev) < 0.5
        out = torch.where(flip[:, None, None, None], out.flip(-1), out)
    return out


# -- loss and evaluation ---------------------------------------------------------------------


def step_loss(model: nn.Module, xb: Tensor, yb: Tensor, cfg: TrainConfig,
              msvp: MSVP | None = None, generator: torch.Generator | None = None,
              partner: tuple[Tensor, float] | None = None,
              progress: tuple[int, int] = (0, 0)) -> tuple[Tensor, Tensor]:
    """(logits, loss) of one training step: on PGD examples when ``cfg.adversarial`` is
    "pgd_linf" (random starts from ``generator``), plus ``msvp()`` when given (compiled as the
    forward pass is: :func:`attncert.msvp.penalty`). ``partner``: (y_rev, lam) of a mixed batch
    (:mod:`attncert.training.mix`); ``progress``: (step, total steps), the radius ramp's."""
    if cfg.adversarial == "pgd_linf":
        with compiled.input_gradients_only(model):
            xb, _ = pgd_linf(compiled.each_call_a_step(model), xb, yb, cfg.adv_eps,
                             cfg.adv_steps, generator=generator)
        compiled.new_step(model)  # the training pass reads none of the attack's outputs
    logits, loss = _margin_loss(model, xb, yb, cfg, partner, progress)
    if msvp is not None:
        loss = loss + compiled.compiled_loss(model, penalty)(model, msvp)
    return logits, loss


def _margin_loss(model: nn.Module, xb: Tensor, yb: Tensor, cfg: TrainConfig,
                 partner: tuple[Tensor, float] | None, progress: tuple[int, int]
                 ) -> tuple[Tensor, Tensor]:
    """:func:`step_loss`'s loss on the batch it trains on, without MSVP's penalty."""
    if cfg.margin == "lofast":
        eps = certified_training.margin_eps(cfg.lofast_eps, cfg.lofast_ramp, *progress,
                                            start=cfg.lofast_start)
        return certified_training.lofast_loss(model, xb, yb, eps, cfg.logit_scale,
                                              cfg.lofast_mix, entropy=cfg.attn_entropy)
    logits, entropy = (compiled.compiled_loss(model, certified_training.entropy_forward)(
        model, xb, model.components(exact=False)) if cfg.attn_entropy > 0 else (model(xb), None))
    head = None
    if cfg.margin == "radius":
        if not callable(getattr(model, "head_weight", None)):
            raise ValueError("margin 'radius' needs a model with head_weight() (its head's "
                             f"rows); {type(model).__name__} has none")
        head = model.head_weight()
    loss = training_loss(logits, yb, cfg, head)
    if partner is not None:
        y_rev, lam = partner
        loss = lam * loss + (1.0 - lam) * training_loss(logits, y_rev, cfg, head)
    if entropy is not None:
        loss = loss + cfg.attn_entropy * entropy
    return logits, loss


@torch.no_grad()
def evaluate(model: nn.Module, data: Any, device: torch.device | str = "cpu",
             batch_size: int = 1000) -> dict[str, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    x, y = _xy(data)
    was_training = model.training
    model.eval()
    dev = torch.device(device)
    loss_sum = torch.zeros((), dtype=sum_dtype(dev), device=dev)
    correct = torch.zeros((), dtype=torch.long, device=dev)
    for i in range(0, len(y), batch_size):
        xb = _to_float(x[i:i + batch_size].to(dev, non_blocking=True))
        yb = y[i:i + batch_size].to(dev, non_blocking=True)
        logits = model(xb)
        loss_sum += F.cross_entropy(logits, yb, reduction="sum").to(loss_sum.dtype)
        correct += (logits.argmax(1) == yb).sum()
    model.train(was_training)
    n = max(len(y), 1)
    return {"loss": float(loss_sum) / n, "acc": int(correct) / n}


# -- the run ---------------------------------------------------------------------------------


class ImageSteps(Steps):
    """Images: the training set on the device once; per epoch a seeded permutation, batches
    converted and augmented there with the epoch's generator, then mixed as planned on the
    host (:func:`attncert.training.mix.plan_epoch`); the loss of :func:`step_loss` (PGD examples and
    MSVP when configured, MSVP's vectors checkpointed)."""

    def __init__(self, model: nn.Module, train_data: Any, config: TrainConfig,
                 device: torch.device):
        x, y = _xy(train_data)
        self.x, self.y = x.to(device), y.to(device)  # once
        self.model, self.config, self.device = model, config, device
        self.n = len(self.y)
        self.params = list(model.parameters())
        self.msvp = None
        if config.msvp_enabled:  # after model.to(device): the vectors live beside the weights
            self.msvp = MSVP(model, *config.msvp_lambda,
                             generator=rng.generator(config.seed, device))
        self.states = {"msvp": self.msvp} if self.msvp is not None else {}
        self.g: torch.Generator | None = None

    def plan(self, epoch: int) -> Sequence[tuple[Tensor, mixing.Mix | None]]:
        self.g = epoch_generator(self.config.seed, epoch, self.device)
        order = torch.randperm(self.n, generator=self.g, device=self.device)
        bs = self.config.batch_size
        n_batches = math.ceil(self.n / bs)
        mixes = mixing.plan_epoch(self.config.mix_spec, n_batches, *self.x.shape[-2:],
                                  self.config.seed, epoch)
        return [(order[s * bs:(s + 1) * bs], mixes[s]) for s in range(n_batches)]

    def batch(self, key: tuple[Tensor, mixing.Mix | None]
              ) -> tuple[tuple[Tensor, tuple[Tensor, float] | None], Tensor]:
        idx, mix = key
        x, y = augment_batch(_to_float(self.x[idx]), self.config.augment, self.g), self.y[idx]
        if mix is None:
            return (x, None), y
        x, y_rev = mixing.apply(x, y, mix)
        return (x, (y_rev, mix.lam)), y

    def loss(self, inputs: tuple[Tensor, tuple[Tensor, float] | None], y: Tensor, step: int
             ) -> tuple[Tensor, Tensor]:
        x, partner = inputs
        total = self.config.epochs * math.ceil(self.n / self.config.batch_size)
        return step_loss(self.model, x, y, self.config, self.msvp, self.g, partner,
                         (step, total))

    def evaluate(self, data: Any) -> dict[str, float]:
        return evaluate(self.model, data, self.device, self.config.eval_batch_size)


def train(model: nn.Module, train_data: Any, eval_data: Any, config: Any,
          checkpoint_dir: str | Path, device: str | torch.device = "auto",
          progress: bool = True, metrics_path: str | Path | None = None,
          callback: Callable[[int, dict[str, Any]], None] | None = None,
          precision: str = "auto", eval_name: str = "test") -> list[dict[str, Any]]:
    """Train ``model`` in place; return the per-epoch metrics rows.

    ``config``: a :class:`TrainConfig` (``train_data``/``eval_data``: (x, y) or {"x", "y"}
    with uint8 or float [0, 1] images) or another config whose ``steps(model, train_data,
    device)`` gives the run's :class:`attncert.training.loop.Steps` (the text models'
    :class:`attncert.text.train_text.TextTrainConfig`). ``precision``: of the training forward
    pass and loss (:mod:`attncert.training.precision`; the params' ``base.precision``).
    After every epoch the full state goes atomically to ``checkpoint_dir/last.pt`` and the
    metrics list to ``metrics_path`` (default ``checkpoint_dir/metrics.json``); a later call
    with the same config resumes from that checkpoint (a different config is an error: use
    :func:`train_resumable` to start over instead). ``callback(epoch, row)`` runs after each
    checkpoint (e.g. to stop early by raising).
    """
    if not callable(getattr(config, "steps", None)):
        raise TypeError(f"config must be a TrainConfig or TextTrainConfig (a config with "
                        f"steps()), got {type(config).__name__}")
    ckpt_path = Path(checkpoint_dir) / CHECKPOINT
    metrics_path = Path(metrics_path) if metrics_path else Path(checkpoint_dir) / METRICS
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    model.to(dev)
    steps = config.steps(model, train_data, dev)
    return run_epochs(model, steps, eval_data, config, ckpt_path, metrics_path, dev, precision,
                      progress, callback, eval_name)


class Trained(NamedTuple):
    """What :func:`train_resumable` returns: the per-epoch rows of the whole run (resumed
    epochs included) and what happened to the checkpoint folder."""

    curves: list[dict[str, Any]]
    status: str  # "fresh", "resume" or "cleared: <keys> changed"


def train_resumable(model: nn.Module, train_data: Any, test_data: Any, config: Any,
                    ckpt_dir: str | Path, device: str | torch.device = "auto", *,
                    fingerprint: Mapping[str, Any], marker: str = FINGERPRINT,
                    metrics_path: str | Path | None = None, precision: str = "auto",
                    progress: bool = True,
                    callback: Callable[[int, dict[str, Any]], None] | None = None,
                    eval_name: str = "test") -> Trained:
    """:func:`train` in ``ckpt_dir``, resumed only when the folder was written for the same run.

    ``fingerprint``: a JSON-able record of everything that decides the run (e.g.
    :func:`attncert.training.checkpoint.fingerprint`; it should name the resolved
    ``precision``), stored as ``ckpt_dir/marker``. A folder with another fingerprint is cleared
    and the run starts over (printed, and named in the returned status); the same fingerprint
    resumes from the last finished epoch, and a finished run only reads its rows back. The
    per-epoch rows go to ``metrics_path`` (default ``ckpt_dir/metrics.json``) after every
    epoch.
    """
    status = prepare_checkpoint_dir(ckpt_dir, fingerprint, marker)
    if status.startswith("cleared"):
        print(f"{ckpt_dir}: checkpoint {status}; training starts over", flush=True)
    curves = train(model, train_data, test_data, config, ckpt_dir, device, progress,
                   metrics_path, callback, precision, eval_name)
    return Trained(curves, status)
