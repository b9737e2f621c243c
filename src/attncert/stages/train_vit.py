"""The train_vit stage: one Lipschitz (or standard) ViT per ``vit_grid`` point (a DVC matrix item).

The model and training configs are built once from the validated ``train_vit`` section and the
grid point (:func:`model_config`; the ``train`` group taken whole, :meth:`Training.config`);
training resumes from the point's per-epoch checkpoint
(:func:`attncert.training.train.train_resumable`, keyed by
:func:`attncert.training.checkpoint.fingerprint`). The point's folder receives ``model.pt``,
``train.json`` (per-epoch rows) and ``metrics.json``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from attncert.data import load_processed
from attncert.grid import plan
from attncert.grid.params import TrainVitParams, model_config
from attncert.models import ViTConfig, build_vit, save_vit
from attncert.pipeline.context import Context
from attncert.pipeline.io import write_json
from attncert.pipeline.jobs import Job
from attncert.pipeline.params import StudyParams
from attncert.report.headline import numbers, row
from attncert.training.checkpoint import fingerprint
from attncert.training.train import TrainConfig, evaluate, train_resumable

#: this module's params.yaml section and its schema (:mod:`attncert.grid.params`)
SECTION = "train_vit"
Params = TrainVitParams
__all__ = ["SECTION", "Params", "Trained", "headline_numbers", "headline_rows", "jobs",
           "model_config", "run"]


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.grid.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return [j for j in plan.jobs(params) if j.stage == SECTION]


@dataclass(frozen=True)
class Trained:
    """What the notebook shows of one trained grid point."""

    name: str
    precision: str  # the resolved training precision
    dataset: str
    n_train: int
    n_test: int
    source: str  # the route that provided the data
    model_config: ViTConfig
    train_config: TrainConfig
    parameters: int
    curves: list[dict[str, Any]]  # one row per epoch (train.json)
    status: str  # the checkpoint: "fresh", "resume" or "cleared: ..."
    constraints: dict[str, float]  # the spectral-norm bounds of the constrained maps
    metrics: dict[str, Any]  # metrics.json


def run(p: Params, ctx: Context) -> Trained:
    """Train (or resume) the grid point ``ctx.point``'s ViT on ``ctx.device`` at
    ``ctx.precision``; write ``model.pt`` and ``metrics.json``."""
    point, device, precision = ctx.point, ctx.device, ctx.precision
    data = load_processed(point.dataset, ctx.processed_dir)
    model_cfg = model_config(p, point, data)
    train_cfg = p.train.config(ctx.seed)
    fp = fingerprint(model_cfg, train_cfg, point.dataset, data["source"], precision)
    torch.manual_seed(ctx.seed)
    model = build_vit(model_cfg)
    n_params = sum(t.numel() for t in model.parameters())
    curves, status = train_resumable(model, data["train"], data["test"], train_cfg,
                                     point.run_dir / "ckpt", device, fingerprint=fp,
                                     metrics_path=point.run_dir / "train.json",
                                     precision=precision)
    save_vit(model, point.run_dir / "model.pt")
    final = evaluate(model, data["test"], device, p.train.eval_batch_size)
    metrics = {"run": point.name, "dataset": point.dataset, "clean_acc": final["acc"],
               "test_loss": final["loss"], "epochs": len(curves),
               "train_seconds": sum(r["seconds"] for r in curves), "parameters": n_params}
    write_json(point.run_dir / "metrics.json", metrics)
    constraints = ({"gamma_qk": p.gamma_qk, "gamma_vo": point.gamma_vo}
                   if p.kind == "lipschitz" else {})
    return Trained(point.name, precision, point.dataset, len(data["train"]["y"]),
                   len(data["test"]["y"]), data["source"], model_cfg, train_cfg, n_params,
                   curves, status, constraints, metrics)


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Clean accuracy and training time of the trained model (and its size)."""
    return [row(k, label, m[k], unit, brief=brief) for k, label, unit, brief in (
        ("clean_acc", "clean accuracy (trained)", "fraction", True),
        ("test_loss", "test loss", "value", False),
        ("epochs", "epochs", "count", False),
        ("train_seconds", "training seconds", "seconds", True),
        ("parameters", "parameters", "count", False)) if k in m]


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: the trained model's clean accuracy."""
    return numbers(clean=m.get("clean_acc"))
