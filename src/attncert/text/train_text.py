"""Training, evaluation and per-sample certification of the SST-2 text models.

The loop follows :func:`attncert.train.train` (AdamW, per-step cosine schedule with warmup,
seeded data order from :func:`attncert.train.epoch_generator`, an atomic checkpoint every
epoch and resume from it) on tokenised data {"ids", "mask", "y"}, with two additions:

* loss = CE(s f, y) - gamma_t mean(relu(M / (sqrt(2) ||W_head||))): OLSA's certificate
  regulariser (MATH.md section 7) on the certified radius of a model whose layers are
  1-Lipschitz, gamma_t ramped linearly from 0 to ``gamma`` (:func:`.olsa.gamma_ramp`);
* after every step the orthogonal maps are re-projected (:func:`reproject_orthogonal_`), so
  the few Newton-Schulz steps of the forward pass stay converged.

Batches are drawn from length-sorted buckets (``bucket`` batches each, order shuffled): the
OLSA models drop the columns past the longest sentence of a batch, and attention costs n^2.
As in :func:`attncert.train.train`, the tokenised training set moves to the device once, the
forward pass and loss run at ``precision`` (:mod:`attncert.precision`) and the loss and
accuracy sums are read once per epoch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.io import torch_save, write_json
from attncert.params import dataclass_from_mapping
from attncert.precision import (
    autocast,
    require_full_precision,
    resolve_precision,
    training_matmuls,
)
from attncert.train import (
    LOG_EVERY,
    cosine_schedule,
    epoch_generator,
    lipschitz_diagnostics,
    load_checkpoint,
    resolve_device,
)

from .olsa import certificate_regulariser, certified_radius, gamma_ramp, reproject_orthogonal_
from .tokenize import encode

CHECKPOINT = "last.pt"
METRICS = "metrics.json"


_MAY_BE_ZERO = ("warmup_steps", "seed", "weight_decay", "gamma", "gamma_ramp", "grad_clip")


@dataclass(frozen=True)
class TextTrainConfig:
    """Optimisation settings; every field is validated (a ValueError names the field).

    ``logit_scale``: CE temperature s (as in :class:`attncert.train.TrainConfig`: logits of a
    1-Lipschitz model are small, so CE(f) learns slowly; s changes the loss only);
    ``gamma``: weight of the certificate regulariser after its ramp (OLSA: 2.0; 0 over a frozen
    encoder); ``gamma_ramp``: fraction of all steps over which it grows linearly from 0;
    ``bucket``: batches per length-sorted bucket (1 = plain shuffling).
    """

    epochs: int = 3
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 0
    logit_scale: float = 1.0
    gamma: float = 0.0
    gamma_ramp: float = 1.0
    grad_clip: float = 0.0
    bucket: int = 50
    eval_batch_size: int = 256
    seed: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            is_int = f.type == "int"
            low = 0 if f.name in _MAY_BE_ZERO else (1 if is_int else None)  # None: > 0
            kinds = int if is_int else int | float
            if (isinstance(v, bool) or not isinstance(v, kinds)
                    or (v < low if low is not None else not v > 0)):
                what = ("an int" if is_int else "a number") + (
                    f" >= {low}" if low is not None else " > 0")
                raise ValueError(f"TextTrainConfig.{f.name} must be {what}, got {v!r}")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TextTrainConfig:
        return dataclass_from_mapping(cls, d)


# -- data ------------------------------------------------------------------------------------


def encode_split(split: Mapping[str, Any], tokenizer, max_len: int = 32) -> dict[str, Tensor]:
    """A processed SST-2 split {"text": [str], "y": (N,)} -> {"ids", "mask", "y"}."""
    ids, mask = encode(split["text"], tokenizer, max_len)
    return {"ids": ids, "mask": mask, "y": torch.as_tensor(split["y"], dtype=torch.long)}


def bucketed_batches(lengths: Tensor, batch_size: int, bucket: int, g: torch.Generator
                     ) -> list[Tensor]:
    """Index batches covering a random permutation once: each run of ``bucket`` batches is
    sorted by length before it is cut, and the batch order is shuffled."""
    order = torch.randperm(len(lengths), generator=g)
    chunk = batch_size * bucket
    batches = []
    for start in range(0, len(order), chunk):
        part = order[start:start + chunk]
        part = part[lengths[part].argsort(stable=True)]
        batches += list(part.split(batch_size))
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


# -- loss and evaluation ---------------------------------------------------------------------


def text_loss(model: nn.Module, logits: Tensor, y: Tensor, gamma: float,
              logit_scale: float = 1.0) -> Tensor:
    """CE(s f, y) - gamma mean(relu(M / (sqrt(2) ||W_head||))) (module docstring)."""
    loss = F.cross_entropy(logit_scale * logits, y)
    if gamma > 0:
        loss = loss + certificate_regulariser(logits, y, model.head_lipschitz(), gamma)
    return loss


@torch.no_grad()
def evaluate_text(model: nn.Module, data: Mapping[str, Tensor], device: torch.device | str = "cpu",
                  batch_size: int = 256) -> dict[str, float]:
    """Mean CE and accuracy; for models with a global Lipschitz constant also the average
    certified radius (0 for misclassified points) and the mean Lipschitz constant."""
    was_training = model.training
    model.eval()
    loss_sum, correct, radius_sum, lip_sum = 0.0, 0, 0.0, 0.0
    n = len(data["y"])
    for i in range(0, n, batch_size):
        ids, mask, y = (data[k][i:i + batch_size].to(device) for k in ("ids", "mask", "y"))
        logits = model(ids, mask)
        loss_sum += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
        if hasattr(model, "lipschitz"):
            lip = model.lipschitz(mask).to(logits.device)
            radius_sum += float(certified_radius(logits, y, lip).sum())
            lip_sum += float(lip.sum())
    model.train(was_training)
    out = {"loss": loss_sum / max(n, 1), "acc": correct / max(n, 1)}
    if hasattr(model, "lipschitz"):
        out |= {"avg_radius": radius_sum / max(n, 1), "lipschitz": lip_sum / max(n, 1)}
    return out


@torch.no_grad()
def certify_rows(model: nn.Module, data: Mapping[str, Tensor], device: torch.device | str = "cpu",
                 batch_size: int = 256):
    """One row per example (index, label, prediction, correct, margin, radius, seconds per
    sample) from ``model.certified_radius``; a pandas DataFrame."""
    import pandas as pd

    require_full_precision("a certificate (attncert.text)")
    model.eval()
    frames = []
    for i in range(0, len(data["y"]), batch_size):
        ids, mask, y = (data[k][i:i + batch_size].to(device) for k in ("ids", "mask", "y"))
        t0 = time.perf_counter()
        logits = model(ids, mask).double()
        radius = model.certified_radius(ids, mask, y)
        seconds = (time.perf_counter() - t0) / len(y)
        pred = logits.argmax(1)
        top2 = logits.topk(2, dim=1).values
        frames.append(pd.DataFrame({
            "index": range(i, i + len(y)), "label": y.cpu().numpy(),
            "prediction": pred.cpu().numpy(), "correct": (pred == y).cpu().numpy(),
            "margin": (top2[:, 0] - top2[:, 1]).cpu().numpy(),
            "radius": radius.cpu().numpy(), "seconds": seconds}))
    return pd.concat(frames, ignore_index=True)


# -- the loop --------------------------------------------------------------------------------


def train_text(model: nn.Module, train_data: Mapping[str, Tensor],
               eval_data: Mapping[str, Tensor], config: TextTrainConfig,
               checkpoint_dir: str | Path, device: str | torch.device = "auto",
               progress: bool = True, metrics_path: str | Path | None = None,
               callback: Callable[[int, dict[str, Any]], None] | None = None,
               precision: str = "auto") -> list[dict[str, Any]]:
    """Train ``model`` in place on {"ids", "mask", "y"}; return the per-epoch metrics rows.

    ``precision``: of the forward pass and loss (:mod:`attncert.precision`).

    After every epoch the full state goes atomically to ``checkpoint_dir/last.pt`` and the
    metrics list to ``metrics_path`` (default ``checkpoint_dir/metrics.json``); a later call
    with the same config resumes from it (a different config is an error).
    ``callback(epoch, row)`` runs after each checkpoint (e.g. to stop early by raising).
    """
    from tqdm.auto import tqdm

    if config.gamma > 0 and not hasattr(model, "head_lipschitz"):
        raise ValueError(f"gamma > 0 needs a model with a global Lipschitz constant "
                         f"(head_lipschitz); {type(model).__name__} has none")
    ckpt_path = Path(checkpoint_dir) / CHECKPOINT
    metrics_path = Path(metrics_path) if metrics_path else Path(checkpoint_dir) / METRICS
    dev = resolve_device(device)
    precision = resolve_precision(precision, dev)
    model.to(dev)
    lengths = train_data["mask"].sum(1).cpu()  # the CPU plans the batches
    on_dev = {k: train_data[k].to(dev) for k in ("ids", "mask", "y")}  # once
    n = len(lengths)
    steps_per_epoch = math.ceil(n / config.batch_size)
    total_steps = config.epochs * steps_per_epoch
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, cosine_schedule(total_steps, config.warmup_steps))
    cfg_dict = dataclasses.asdict(config)
    metrics, start, _ = load_checkpoint(ckpt_path, cfg_dict,
                                        {"model": model, "optimizer": opt, "scheduler": sched})

    for epoch in range(start + 1, config.epochs + 1):
        t0 = time.perf_counter()
        model.train()
        batches = bucketed_batches(lengths, config.batch_size, config.bucket,
                                   epoch_generator(config.seed, epoch))
        loss_sum = torch.zeros((), dtype=torch.float32 if dev.type == "mps" else torch.float64,
                               device=dev)
        correct = torch.zeros((), dtype=torch.long, device=dev)
        bar = tqdm(batches, desc=f"epoch {epoch}/{config.epochs}", disable=not progress,
                   leave=False)
        with training_matmuls(precision, dev):
            for i, idx in enumerate(bar):
                idx = idx.to(dev, non_blocking=True)
                ids, mask, y = (on_dev[k][idx] for k in ("ids", "mask", "y"))
                gamma = gamma_ramp((epoch - 1) * steps_per_epoch + i, total_steps,
                                   config.gamma, config.gamma_ramp)
                with autocast(precision, dev):
                    logits = model(ids, mask)
                    loss = text_loss(model, logits, y, gamma, config.logit_scale)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                if config.grad_clip > 0:
                    nn.utils.clip_grad_norm_(params, config.grad_clip)
                opt.step()
                sched.step()
                reproject_orthogonal_(model)
                loss_sum += loss.detach().to(loss_sum.dtype) * len(idx)
                correct += (logits.detach().argmax(1) == y).sum()
                if progress and i % LOG_EVERY == 0:  # the only host sync of a step
                    bar.set_postfix(loss=f"{loss.item():.4f}")
        loss_sum, correct = float(loss_sum), int(correct)
        train_seconds = time.perf_counter() - t0
        ev = evaluate_text(model, eval_data, dev, config.eval_batch_size)
        row = {"epoch": epoch, "train_loss": loss_sum / n, "train_acc": correct / n,
               **{f"test_{k}": v for k, v in ev.items()}, "lr": sched.get_last_lr()[0],
               "gamma": gamma, "seconds": train_seconds, **lipschitz_diagnostics(model)}
        metrics.append(row)
        torch_save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "epoch": epoch, "metrics": metrics,
                    "config": cfg_dict}, ckpt_path)
        write_json(metrics_path, metrics)
        if progress:
            tqdm.write(f"epoch {epoch}: loss {row['train_loss']:.4f} train acc "
                       f"{row['train_acc']:.4f} test acc {row['test_acc']:.4f} "
                       f"({train_seconds:.1f} s)")
        if callback is not None:
            callback(epoch, row)
    return metrics

