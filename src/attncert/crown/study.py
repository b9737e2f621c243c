"""The crown stage's study (:mod:`attncert.stages.crown`): its Lipschitz ViTs trained, LoFAST's
and CROWN's rows, one per point (LoFAST) or per (point, eps) (CROWN), and their checks.

Functions that need the stage's params take its ``Params`` as an argument.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch
from torch import Tensor

from attncert import certify
from attncert.crown.bridge import CrownCertifier, bound_row, certify_batch
from attncert.models import ViTConfig, build_vit
from attncert.models.config import dataset_vit_config
from attncert.pipeline.batching import BatchSize
from attncert.pipeline.device import resolve_device, resolve_precision
from attncert.pipeline.io import atomic_path
from attncert.training.checkpoint import fingerprint
from attncert.training.train import evaluate, train_resumable

if TYPE_CHECKING:
    from attncert.crown.params import Params


# ------------------------------------------------------------------ models
def vit_config(data: Mapping[str, Any], p: Params, depth: int) -> ViTConfig:
    """The study's Lipschitz ViT of one depth for a processed dataset (stream blocks)."""
    return dataset_vit_config(
        data, p.normalize, **p.vit.arch(depth=depth), kind="lipschitz", block="stream", pool=p.pool,
        radius_attn=p.radius_attn, gamma_qk=p.gamma_qk, gamma_vo=p.gamma_vo)


def train_model(data: Mapping[str, Any], p: Params, depth: int, seed: int,
                ckpt_dir: str | Path, device: str | torch.device, precision: str = "auto"):
    """Train one ViT (resumable in ``ckpt_dir``, at ``precision``:
    :mod:`attncert.training.precision`) on the first ``max_train`` training images on
    ``device`` (the stage's ``base.device``); returns (model in eval mode, on ``device``,
    clean test accuracy, training seconds: the sum over epochs, so a resumed or already
    finished run reports the time its training took)."""
    torch.manual_seed(seed)
    model = build_vit(vit_config(data, p, depth))
    cfg = p.train.config(seed)
    n = p.max_train or len(data["train"]["y"])
    tr = {"x": data["train"]["x"][:n], "y": data["train"]["y"][:n]}
    # a checkpoint of another model, config or training subset is cleared, never resumed
    precision = resolve_precision(precision, resolve_device(device))
    fp = fingerprint(model.config, cfg, data.get("name", ""),
                          f"{data.get('source', '')}; first {n} training images", precision)
    curves, _ = train_resumable(model, tr, data["test"], cfg, ckpt_dir, device, fingerprint=fp,
                                precision=precision)
    seconds = sum(r["seconds"] for r in curves)
    return model.eval(), evaluate(model, data["test"], device)["acc"], seconds


# ------------------------------------------------------------------ one row per point
def lofast_frame(model, x: Tensor, y: Tensor, variant: str, eps_grid: Sequence[float],
                 max_radius: float = 10.0, batch_size: int = 100) -> pd.DataFrame:
    """One row per point: correct, radius, seconds (per sample) and ``certified_<eps>``."""
    table = certify.certify_table(model, x, y, [variant], ["pairwise"], 1.0, max_radius,
                                  batch_size)
    out = pd.DataFrame({"index": table["index"], "correct": table["correct"].astype(bool),
                        "radius": table[f"radius_{variant}_pairwise"],
                        "seconds": table[f"seconds_{variant}_pairwise"]})
    for e in eps_grid:
        out[f"certified_{e}"] = out["correct"] & (out["radius"] >= e)
    return out


#: the status of an alpha-CROWN (point, eps) row that CROWN certified first
#: (``crown.alpha_after_crown``): not bounded again, certified by CROWN's bound
PROVEN = "crown"

#: statuses of a (point, eps) row whose bound did not run ("misclassified": the point's
#: prediction is wrong, so no bound can certify its label; :data:`PROVEN`: an earlier
#: method's bound certified it)
NOT_RUN = ("skipped", "lofast", "budget", "misclassified", PROVEN)


#: statuses of a bound that ran and gave a result (a time limit is a result, not an error)
RESULTS = ("ok", "time_limit")


class Budget:
    """Seconds of CROWN bounds left to a stage (``seconds`` 0: no budget)."""

    def __init__(self, seconds: float) -> None:
        self.limited = seconds > 0
        self.left = seconds

    def spent(self) -> bool:
        return self.limited and self.left <= 0

    def charge(self, seconds: float) -> None:
        self.left -= seconds


class Journal:
    """A unit's CROWN rows of one method, appended to a JSON-lines file as each point finishes,
    so that a crash, a preemption or a failed check loses at most the batch in progress; a
    rerun with the same ``key`` reads the finished points back, a file with another key is
    started afresh. Line 1 is ``{"key": key}``; every other line is one point's rows."""

    def __init__(self, path: str | Path, key: Mapping[str, Any]) -> None:
        self.path, self.key = Path(path), json.loads(json.dumps(key))
        self.done: dict[int, list[dict[str, Any]]] = {}
        lines = self.path.read_text().splitlines() if self.path.is_file() else []
        if lines and _loads(lines[0]) == {"key": self.key}:
            for line in lines[1:]:
                rows = _loads(line)
                if isinstance(rows, list) and rows:  # a torn last line is dropped
                    self.done[int(rows[0]["index"])] = rows
            text = "".join(f"{line}\n" for line in lines[:1 + len(self.done)])
        else:
            text = json.dumps({"key": self.key}) + "\n"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.path) as tmp:  # a crash here leaves the old file whole
            tmp.write_text(text)

    def append(self, rows: list[dict[str, Any]]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(rows) + "\n")
            f.flush()
            os.fsync(f.fileno())


def _loads(line: str) -> Any:
    try:
        return json.loads(line)
    except json.JSONDecodeError:
        return None


def crown_frame(model, x: Tensor, y: Tensor, eps_grid: Sequence[float], method: str,
                time_limit_s: float, alpha_iterations: int, dtype: torch.dtype = torch.float64,
                progress: bool = False, lofast: Tensor | None = None,
                budget: Budget | None = None, correct: Tensor | None = None,
                journal: Journal | None = None, batch_size: int = 1,
                proven: Tensor | None = None) -> tuple[pd.DataFrame, float]:
    """One row per (point, eps), smallest eps first, skipping the larger eps of a point that
    was not certified; returns (rows, seconds to build the bounded graph). ``lofast`` (n,
    len(eps)) bool, eps ascending: pairs LoFAST certified, not run (status "lofast");
    ``proven`` (the same shape): pairs an earlier method certified (CROWN's, before
    alpha-CROWN), not run (status :data:`PROVEN`, certified, 0 s);
    ``budget``: once spent, no bound runs (status "budget"); ``correct`` (n,) bool: a point
    the model misclassifies is not bounded (status "misclassified": no bound certifies a
    label the model does not predict); ``journal``: each point's rows appended as it finishes,
    and the points it holds already taken from it (their seconds charged to ``budget``).

    The points are bounded ``batch_size`` at a time (:func:`attncert.crown.bridge.certify_batch`:
    a batch's bounds are its points' bounds alone, its seconds shared among them): the next
    points with a bound to run, radius by radius; on a CUDA device the batch grows to
    ``base.batch_memory`` of its memory and halves on an out-of-memory error
    (:class:`attncert.pipeline.batching.BatchSize`). The budget is checked before each batch,
    so once it is spent the points of the batches in progress get "budget" at their larger
    eps (one point at a time: the later points at every eps).

    CROWN runs where the points are (``x.device``: the model is moved there, in place) in
    ``dtype``: float64 for a certificate; float32 halves time and memory, with rounding in
    the bound's last digits (the stage's PGD audit checks every certified point)."""
    if y.device != x.device:
        raise ValueError(f"x on {x.device} but y on {y.device}")
    eps_sorted = sorted(eps_grid)
    if lofast is not None and tuple(lofast.shape) != (len(y), len(eps_sorted)):
        raise ValueError(f"lofast: expected shape {(len(y), len(eps_sorted))}, got "
                         f"{tuple(lofast.shape)}")
    if proven is not None and tuple(proven.shape) != (len(y), len(eps_sorted)):
        raise ValueError(f"proven: expected shape {(len(y), len(eps_sorted))}, got "
                         f"{tuple(proven.shape)}")
    if correct is not None and tuple(correct.shape) != (len(y),):
        raise ValueError(f"correct: expected shape {(len(y),)}, got {tuple(correct.shape)}")
    size = BatchSize(batch_size, f"{method} bounds", x.device)
    model = model.to(device=x.device, dtype=dtype)
    lofast = lofast.tolist() if lofast is not None else None  # host lists: read per point
    correct = correct.tolist() if correct is not None else None
    proven = proven.tolist() if proven is not None else None
    done = journal.done if journal is not None else {}
    cert: list[CrownCertifier] = []  # built once, and only when a bound runs

    def bounds(idx: list[int], e: float) -> list[dict[str, Any]]:
        """Rows of the points ``idx`` at ``e``, in batches; each batch first checks the budget
        (the points left when it is spent: "budget") and charges every second it ran, a
        batch that ran out of memory included."""
        if not cert:
            cert.append(CrownCertifier.from_vit(model, x.shape[1:], dtype))
        out, s = [], 0
        while s < len(idx):
            if budget is not None and budget.spent():
                out += [bound_row(i, e, method, "budget", batch=0) for i in idx[s:]]
                break
            part = idx[s:s + size.size]
            size.begin()
            t0 = time.perf_counter()
            try:
                rows_ = certify_batch(cert[0], x[part].to(dtype), y[part], e, method,
                                      time_limit_s, alpha_iterations)
            except torch.OutOfMemoryError:
                if budget is not None:
                    budget.charge(time.perf_counter() - t0)
                if not size.halve(len(part)):
                    raise
                continue
            if all(r["status"] in ("ok", "overflow") and r["batch"] == len(part)
                   for r in rows_):  # a whole batch ran: its peak is a batch's
                size.ran(len(part))
            if budget is not None:
                budget.charge(sum(r["seconds"] for r in rows_))
            out += [dict(r, index=i) for r, i in zip(rows_, part, strict=True)]
            s += len(part)
        return out

    rows, i, n = [], 0, len(y)
    while i < n:
        if i in done:
            if budget is not None:
                budget.charge(sum(r["seconds"] for r in done[i]))
            rows += done[i]
            i += 1
            continue
        # the next points, from one with a bound to run up to a batch of them (a point with
        # none before it is a chunk of its own: its rows are journaled at once)
        chunk, runs = [], 0
        while i < n and i not in done and runs < size.size:
            chunk.append(i)
            runs += _has_bound(i, correct, lofast, proven, len(eps_sorted))
            i += 1
            if not runs:
                break
        point = {k: [] for k in chunk}
        alive = dict.fromkeys(chunk, True)
        for j, e in enumerate(eps_sorted):
            run = []
            for k in chunk:
                status = ("misclassified" if correct is not None and not correct[k] else
                          "skipped" if not alive[k] else
                          "lofast" if lofast is not None and lofast[k][j] else
                          PROVEN if proven is not None and proven[k][j] else
                          "budget" if budget is not None and budget.spent() else None)
                if status is None:
                    run.append(k)
                else:
                    point[k].append(dict(bound_row(k, e, method, status, batch=0),
                                         certified=status == PROVEN))
            for row in bounds(run, e) if run else []:
                if row["status"] not in NOT_RUN:  # "budget": its larger eps are "budget" too
                    alive[row["index"]] = bool(row["certified"])
                point[row["index"]].append(row)
        for k in chunk:
            if journal is not None:
                journal.append(point[k])
            rows += point[k]
        if progress:
            print(f"{method}: point {i}/{n}", flush=True)
    return pd.DataFrame(rows), (cert[0].build_seconds if cert else 0.0)


def _has_bound(i: int, correct: list | None, lofast: list | None, proven: list | None,
               n_eps: int) -> bool:
    """Whether point ``i`` has a bound to run at some radius (before any budget)."""
    if correct is not None and not correct[i]:
        return False
    return not all((lofast is not None and lofast[i][j]) or (proven is not None and proven[i][j])
                   for j in range(n_eps))


def require_few_errors(crown: pd.DataFrame, max_share: float, where: str) -> None:
    """Raise RuntimeError when more than ``max_share`` of the bounds that ran ended in an
    error (out of memory, an unsupported operator, overflow...): the stage's CROWN numbers
    would describe the failures, not CROWN."""
    ran = crown[~crown["status"].isin(NOT_RUN)]
    errors = ran[~ran["status"].isin(RESULTS)]
    if len(ran) and len(errors) > max_share * len(ran):
        counts = ", ".join(f"{k} {v}" for k, v in errors["status"].value_counts().items())
        raise RuntimeError(f"{where}: {len(errors)} of {len(ran)} CROWN bounds failed ({counts}"
                           f"), more than crown.max_error_share = {max_share:g}; see the "
                           "'error' column")


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
