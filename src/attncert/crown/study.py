"""The CROWN study (stage ``crown``): LoFAST vs CROWN on the same points (LoFAST Table 1) and
LoFAST first with CROWN on what LoFAST left (Table 2), as read-outs of one row per point.

Both methods certify the TRUE label (a misclassified point is never certified). CROWN runs once
per (point, eps), smallest eps first; a point it does not certify at an eps is not run at the
larger ones (recorded "skipped", 0 s: it cannot be counted as certified there). Seconds per
sample: LoFAST's certificate with its radius (valid for every eps at once), CROWN's mean time of
one (point, eps) bound over the pairs it ran.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from torch import Tensor

from attncert import certify, runs
from attncert.crown.bridge import CrownCertifier, certify_points
from attncert.models import ViTConfig, build_vit
from attncert.precision import resolve_precision
from attncert.train import TrainConfig, evaluate, resolve_device, train_resumable


def vit_config(data: Mapping[str, Any], p: Mapping[str, Any], depth: int) -> ViTConfig:
    """The study's Lipschitz ViT of one depth for a processed dataset (stream blocks)."""
    return runs.dataset_vit_config(
        data, p["normalize"], patch=p["patch"], dim=p["dim"], depth=depth, heads=p["heads"],
        mlp_hidden=p["mlp_hidden"], kind="lipschitz", block="stream", pool=p["pool"],
        radius_attn=p["radius_attn"], gamma_qk=p["gamma_qk"], gamma_vo=p["gamma_vo"])


def train_model(data: Mapping[str, Any], p: Mapping[str, Any], depth: int, seed: int,
                ckpt_dir: str | Path, device: str | torch.device, precision: str = "auto"):
    """Train one ViT (resumable in ``ckpt_dir``, at ``precision``: :mod:`attncert.precision`)
    on the first ``max_train`` training images on ``device`` (the stage's ``base.device``);
    returns (model in eval mode, on ``device``, clean test accuracy, training seconds: the sum
    over epochs, so a resumed or already finished run reports the time its training took)."""
    torch.manual_seed(seed)
    model = build_vit(vit_config(data, p, depth))
    cfg = TrainConfig(epochs=p["epochs"], batch_size=p["batch_size"], lr=p["lr"],
                      warmup_steps=p["warmup_steps"], margin="lmt", lmt_offset=p["lmt_offset"],
                      logit_scale=p["logit_scale"], seed=seed)
    n = p["max_train"] or len(data["train"]["y"])
    tr = {"x": data["train"]["x"][:n], "y": data["train"]["y"][:n]}
    # a checkpoint of another model, config or training subset is cleared, never resumed
    precision = resolve_precision(precision, resolve_device(device))
    fp = runs.fingerprint(model.config, cfg, data.get("name", ""),
                          f"{data.get('source', '')}; first {n} training images", precision)
    curves, _ = train_resumable(model, tr, data["test"], cfg, ckpt_dir, device, fingerprint=fp,
                                precision=precision, progress=False)
    seconds = sum(row["seconds"] for row in curves)
    return model.eval(), evaluate(model, data["test"], device)["acc"], seconds


def lofast_frame(model, x: Tensor, y: Tensor, variant: str, eps_grid: Sequence[float],
                 max_radius: float = 10.0, batch_size: int = 100) -> pd.DataFrame:
    """One row per point: correct, radius, seconds (per sample) and ``certified_<eps>``."""
    table = certify.certify_table(model, x, y, [variant], ["pairwise"], 1.0, max_radius,
                                  batch_size, progress=False)
    out = pd.DataFrame({"index": table["index"], "correct": table["correct"].astype(bool),
                        "radius": table[f"radius_{variant}_pairwise"],
                        "seconds": table[f"seconds_{variant}_pairwise"]})
    for e in eps_grid:
        out[f"certified_{e}"] = out["correct"] & (out["radius"] >= e)
    return out


def crown_frame(model, x: Tensor, y: Tensor, eps_grid: Sequence[float], method: str,
                time_limit_s: float, alpha_iterations: int, dtype: torch.dtype = torch.float64,
                progress: bool = False) -> tuple[pd.DataFrame, float]:
    """One row per (point, eps), smallest eps first, skipping the larger eps of a point that
    was not certified; returns (rows, seconds to build the bounded graph).

    CROWN runs where the points are (``x.device``: the model is moved there, in place) in
    ``dtype``: float64 for a certificate; float32 halves time and memory, with rounding in
    the bound's last digits (the stage's PGD audit checks every certified point)."""
    if y.device != x.device:
        raise ValueError(f"x on {x.device} but y on {y.device}")
    model = model.to(device=x.device, dtype=dtype)
    cert = CrownCertifier.from_vit(model, x.shape[1:], dtype)
    eps_sorted = sorted(eps_grid)
    rows = []
    for i in range(len(y)):
        alive = True
        skip = torch.zeros(1, len(eps_sorted), dtype=torch.bool)
        for j, e in enumerate(eps_sorted):
            skip[0, j] = not alive
            (row,) = certify_points(cert, x[i:i + 1].to(dtype), y[i:i + 1], [e], method,
                                    time_limit_s, alpha_iterations, skip[:, j:j + 1])
            row["index"] = i
            alive = alive and row["certified"]
            rows.append(row)
        if progress:
            print(f"{method}: point {i + 1}/{len(y)}", flush=True)
    return pd.DataFrame(rows), cert.build_seconds


def crown_certified(rows: pd.DataFrame, n: int, eps: float) -> Tensor:
    """(n,) bool: certified by CROWN at eps."""
    out = torch.zeros(n, dtype=torch.bool)
    hit = rows[(rows["eps"] == eps) & rows["certified"]]["index"].to_numpy()
    out[torch.tensor(hit, dtype=torch.long)] = True
    return out


def grid_radius(certified: Mapping[float, Tensor]) -> Tensor:
    """(n,) the largest eps of the grid certified with every smaller one (0: none)."""
    eps = sorted(certified)
    n = len(next(iter(certified.values())))
    r, alive = torch.zeros(n, dtype=torch.float64), torch.ones(n, dtype=torch.bool)
    for e in eps:
        alive &= certified[e]
        r[alive] = e
    return r


def tables(lofast: pd.DataFrame, crown: pd.DataFrame, eps_grid: Sequence[float],
           depth: int, method: str) -> tuple[list[dict], list[dict]]:
    """Rows of Table 1 (LoFAST vs CROWN) and Table 2 (CROWN alone vs LoFAST + CROWN) for one
    model. Accuracies in %; a CROWN entry whose pairs all failed is None (the paper's "-")."""
    n = len(lofast)
    lo_s = float(lofast["seconds"].mean())
    ran = crown[crown["status"] != "skipped"]
    t1 = [{"depth": depth, "method": "LoFAST", "seconds_per_sample": lo_s,
           **{f"acc_{e}": 100 * float(lofast[f"certified_{e}"].mean()) for e in eps_grid}},
          {"depth": depth, "method": method, "seconds_per_sample": float(ran["seconds"].mean())
           if len(ran) else float("nan"), **{
               f"acc_{e}": (100 * float(crown_certified(crown, n, e).double().mean())
                            if (ran["eps"] == e).any() and (ran[ran["eps"] == e]["status"]
                                                            == "ok").any() else None)
               for e in eps_grid}}]
    t2 = []
    for e in eps_grid:
        lo = torch.tensor(lofast[f"certified_{e}"].to_numpy())
        cr = crown_certified(crown, n, e)
        at = crown[crown["eps"] == e].sort_values("index")
        sec = torch.tensor(at["seconds"].to_numpy(), dtype=torch.float64)
        t2.append({"depth": depth, "eps": e, "method": method,
                   "crown_acc": 100 * float(cr.double().mean()),
                   "crown_seconds": float(sec.mean()),
                   "combined_acc": 100 * float((lo | cr).double().mean()),
                   "combined_seconds": lo_s + float(sec[~lo].sum()) / n,
                   "lofast_acc": 100 * float(lo.double().mean())})
    return t1, t2


def status_counts(crown: pd.DataFrame) -> dict[str, int]:
    """How many (point, eps) pairs ended in each status."""
    return {str(k): int(v) for k, v in crown["status"].value_counts().items()}
