"""The epoch loop every training run shares: AdamW or SGD with momentum (:func:`optimizer`), a
per-step schedule with warmup (cosine, or step decays at given epochs: :func:`lr_schedule`), the
forward pass and loss at the training precision, optional gradient clipping, an atomic
checkpoint and the metrics file after every epoch, and resume from that checkpoint.

What differs between runs is a :class:`Steps`: how an epoch's data is cut into batches, how a
batch becomes logits and a loss, what runs after each optimiser step and how the model is
evaluated (:class:`attncert.training.train.ImageSteps` for images, :class:`attncert.text.train_text.
TextSteps` for tokenised text). The loss and accuracy sums stay on the device and are read
once per epoch.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attncert.pipeline.io import write_json
from attncert.training import compiled
from attncert.training.checkpoint import load_checkpoint, save_checkpoint
from attncert.training.precision import autocast, training_matmuls

LOG_EVERY = 50  # steps between progress-bar loss read-outs (each one waits for the device)


class TrainingDiverged(RuntimeError):
    """The loss or the weights became non-finite: the checkpoint of the last finished epoch
    is kept; lower the learning rate or set ``grad_clip`` and run again."""


def _diverged(epoch: int, step: int, what: str) -> TrainingDiverged:
    return TrainingDiverged(
        f"training diverged in epoch {epoch} (step {step}): {what}. The last finished epoch's "
        "checkpoint is kept; lower the stage's lr or set its grad_clip and run again")


class Steps:
    """One run's batches and loss. Subclasses set ``n`` (training examples), ``params`` (what
    the optimiser updates and gradient clipping sees), ``states`` (extra checkpoint entries
    with ``state_dict``/``load_state_dict``) and implement :meth:`plan`, :meth:`batch`,
    :meth:`loss` and :meth:`evaluate`."""

    n: int
    params: list[nn.Parameter]
    states: Mapping[str, Any] = {}

    def plan(self, epoch: int) -> Sequence[Any]:
        """The batches of ``epoch`` (1-based) in training order, each as :meth:`batch` takes
        it (an index tensor, or what else the subclass draws per batch)."""
        raise NotImplementedError

    def batch(self, key: Any) -> tuple[tuple[Any, ...], Tensor]:
        """(model inputs, labels) of one batch of :meth:`plan`, on the device (outside
        autocast); the labels' count is the batch size."""
        raise NotImplementedError

    def loss(self, inputs: tuple[Any, ...], y: Tensor, step: int) -> tuple[Tensor, Tensor]:
        """(logits, loss) of one batch; ``step`` counts every step of the run from 0."""
        raise NotImplementedError

    def after_step(self) -> None:
        """Runs after each optimiser and scheduler step."""

    def evaluate(self, data: Any) -> dict[str, float]:
        """The end-of-epoch evaluation on ``data``; its keys become ``test_<key>`` columns."""
        raise NotImplementedError

    def row(self) -> dict[str, Any]:
        """Extra columns of the epoch's row (after ``lr``)."""
        return {}


def cosine_schedule(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """LR factor per step: linear warmup, then cosine decay to 0 at ``total_steps``."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    return factor


def step_schedule(steps_per_epoch: int, warmup_steps: int, decay_epochs: Sequence[int],
                  decay: float) -> Callable[[int], float]:
    """LR factor per step: linear warmup, then ``decay`` ** (the number of ``decay_epochs``
    already reached): the step ``e * steps_per_epoch`` starts epoch ``e + 1``, so a decay at
    epoch 40 applies from the first step of epoch 41 on ("decays by 0.1 at the 40th epoch")."""
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        done = step // steps_per_epoch  # whole epochs completed before this step
        return decay ** sum(done >= e for e in decay_epochs)
    return factor


def lr_schedule(config: Any, steps_per_epoch: int) -> Callable[[int], float]:
    """The LR factor per step of a run: :func:`step_schedule` when the config lists
    ``lr_decay_epochs`` (decayed by ``lr_decay`` at each), else :func:`cosine_schedule` over
    all its steps."""
    decay_epochs = tuple(getattr(config, "lr_decay_epochs", ()) or ())
    if decay_epochs:
        return step_schedule(steps_per_epoch, config.warmup_steps, decay_epochs,
                             config.lr_decay)
    return cosine_schedule(config.epochs * steps_per_epoch, config.warmup_steps)


OPTIMIZERS = ("adamw", "sgd")


def fused_on_cuda(params: list[torch.Tensor]) -> dict[str, bool]:
    """``{"fused": True}`` when every parameter is a floating-point CUDA tensor: one fused
    kernel then steps them all, where torch's default there (multi-tensor) launches a dozen
    and reads each parameter's step count on the host; else ``{}`` (torch's default: on a CPU
    a loop over the parameters). The update is the same up to float rounding."""
    params = list(params)
    if params and all(p.is_cuda and p.is_floating_point() for p in params):
        return {"fused": True}
    return {}


def optimizer(params: list[nn.Parameter], config: Any) -> torch.optim.Optimizer:
    """``config.optimizer``: "adamw" (decoupled weight decay) or "sgd" (heavy-ball
    ``config.momentum``, weight decay as L2 on the gradient, as torch.optim.SGD); a config
    without an ``optimizer`` field (the text models') trains with AdamW. Fused on CUDA
    (:func:`fused_on_cuda`)."""
    kind = getattr(config, "optimizer", "adamw")
    params = list(params)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                                 **fused_on_cuda(params))
    if kind == "sgd":
        return torch.optim.SGD(params, lr=config.lr, momentum=config.momentum,
                               weight_decay=config.weight_decay, **fused_on_cuda(params))
    raise ValueError(f"optimizer {kind!r}: choose from {', '.join(OPTIMIZERS)}")


def sum_dtype(device: torch.device) -> torch.dtype:
    """float64 running sums, except on MPS (no float64 there)."""
    return torch.float32 if device.type == "mps" else torch.float64


@torch.no_grad()
def lipschitz_diagnostics(model: nn.Module) -> dict[str, float]:
    """Spectral norm (exact SVD) of every constrained or plain linear map, "sigma/<module>"."""
    out = {}
    for name, m in model.named_modules():
        if hasattr(m, "weight_effective"):
            w = m.weight_effective()
        elif isinstance(m, nn.Linear):
            w = m.weight
        else:
            continue
        out[f"sigma/{name}"] = float(torch.linalg.svdvals(w.detach().double().cpu()).max())
    return out


def run_epochs(model: nn.Module, steps: Steps, eval_data: Any, config: Any, ckpt_path: Path,
               metrics_path: Path, dev: torch.device, precision: str, progress: bool = True,
               callback: Callable[[int, dict[str, Any]], None] | None = None,
               eval_name: str = "test") -> list[dict[str, Any]]:
    """Train ``model`` (already on ``dev``) for ``config.epochs`` epochs, resuming from
    ``ckpt_path``; ``config``: a dataclass with epochs, batch_size, lr, weight_decay,
    warmup_steps and grad_clip (and optionally optimizer and momentum, :func:`optimizer`).
    ``eval_name``: what the epoch line calls ``eval_data`` (its rows keep the ``test_`` keys).
    The forward passes run compiled in the process's ``base.compile`` mode
    (:mod:`attncert.training.compiled`); the model is eager again on return.
    Returns the per-epoch metrics rows."""
    from attncert.pipeline import progress as console

    steps_per_epoch = math.ceil(steps.n / config.batch_size)
    opt = optimizer(steps.params, config)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(config, steps_per_epoch))
    cfg_dict = dataclasses.asdict(config)
    states = {"model": model, "optimizer": opt, "scheduler": sched, **steps.states}
    metrics, start, _ = load_checkpoint(ckpt_path, cfg_dict, states)
    mode = compiled.resolve(dev, model=model)
    with compiled.compiled_forward(model, mode):
        for epoch in range(start + 1, config.epochs + 1):
            t0 = time.perf_counter()
            model.train()
            batches = steps.plan(epoch)
            loss_sum = torch.zeros((), dtype=sum_dtype(dev), device=dev)
            correct = torch.zeros((), dtype=torch.long, device=dev)
            bar = console.bar(batches, desc=f"epoch {epoch}/{config.epochs}", enabled=progress,
                              leave=False)
            with training_matmuls(precision, dev):
                for i, key in enumerate(bar):
                    inputs, yb = steps.batch(key)
                    compiled.step_begin(mode, dev)
                    try:
                        with autocast(precision, dev):
                            logits, loss = steps.loss(inputs, yb, (epoch - 1) * steps_per_epoch + i)
                    except torch.linalg.LinAlgError as exc:  # an exact norm of the weights failed
                        raise _diverged(epoch, i, str(exc)) from exc
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    if config.grad_clip > 0:
                        nn.utils.clip_grad_norm_(steps.params, config.grad_clip)
                    opt.step()
                    sched.step()
                    steps.after_step()
                    loss_sum += loss.detach().to(loss_sum.dtype) * len(yb)
                    correct += (logits.detach().argmax(1) == yb).sum()
                    if progress and i % LOG_EVERY == 0:  # the only host sync of a step
                        value = loss.item()
                        if not math.isfinite(value):
                            raise _diverged(epoch, i, f"the loss is {value}")
                        bar.set_postfix(loss=f"{value:.4f}", refresh=False)
            loss_sum, correct = float(loss_sum), int(correct)
            if not math.isfinite(loss_sum):
                raise _diverged(epoch, steps_per_epoch, f"the epoch's summed loss is {loss_sum}")
            train_seconds = time.perf_counter() - t0
            ev = steps.evaluate(eval_data)
            row = {"epoch": epoch, "train_loss": loss_sum / steps.n, "train_acc": correct / steps.n,
                   **{f"test_{k}": v for k, v in ev.items()}, "lr": sched.get_last_lr()[0],
                   **steps.row(), "seconds": train_seconds, **lipschitz_diagnostics(model)}
            metrics.append(row)
            save_checkpoint(ckpt_path, cfg_dict, states, epoch, metrics)
            write_json(metrics_path, metrics)
            if progress:
                console.write(f"epoch {epoch}/{config.epochs}: loss {row['train_loss']:.4f} train "
                              f"acc {row['train_acc']:.4f} {eval_name} acc {row['test_acc']:.4f} "
                              f"({train_seconds:.1f} s)")
            if callback is not None:
                callback(epoch, row)
    if metrics:  # a run stopped between the checkpoint and the metrics file resumes to both
        write_json(metrics_path, metrics)
    return metrics
