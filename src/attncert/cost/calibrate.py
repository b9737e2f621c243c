"""The per-kernel constant of the cost model, measured on a GPU (``make gpu-check``).

:func:`measure` times a training step of every model kind (:func:`attncert.cost.bench.
bench_training`) on a CUDA device and divides each by the kernels the same step launches
(counted as the cost model counts them, :func:`attncert.cost.counting.count`): each quotient
is an upper bound of that kind's seconds per kernel (it still contains its FLOP time). The work
on a model of a measured kind is costed with that kind's constant
(:attr:`attncert.cost.work.Work.model`), other work of a stage with the constant of the model
kind the stage trains (:data:`STAGE_MODELS`; text: the largest of its three kinds), and work
of no stage kind with the largest constant measured. The result goes to
:data:`CALIBRATION_FILE`, which ``python -m attncert.cost`` reads when it exists, else the
committed measurement :data:`COMMITTED_CALIBRATION` (:func:`calibrated`): the cost table
says where and when its constant was measured. A record holds the version of the kernel count
it divided by (:data:`attncert.cost.counting.COUNTING`); one of another version is refused
until :func:`recount` (``python -m attncert.cost recount``) divides its measured step times by
the current count.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import math
from pathlib import Path
from typing import Any

from attncert.cost.counting import COUNTING, GPU
from attncert.cost.graphs import (
    LIPSCHITZ_VIT,
    LOFAST_TEXT,
    MSVP_VIT,
    OLSA_TEXT,
    STANDARD_TEXT,
    STANDARD_VIT,
)
from attncert.pipeline.io import write_json

#: the bench model kind whose measured constant costs each stage's work (text: its three models
#: trained from scratch, the largest; the frozen-encoder head, a one-layer OLSA model, takes
#: the stage's constant until its own is measured)
STAGE_MODELS = {
    "tightness": (LIPSCHITZ_VIT,), "train_vit": (LIPSCHITZ_VIT,),
    "certify_vit": (LIPSCHITZ_VIT,), "frontier": (LIPSCHITZ_VIT,),
    "crown": (LIPSCHITZ_VIT,), "specformer": (MSVP_VIT,),
    "certvit": (STANDARD_VIT,),
    "text": (OLSA_TEXT, LOFAST_TEXT, STANDARD_TEXT),
}
#: written by ``python -m attncert.pipeline.doctor --calibrate`` (``make gpu-check``)
CALIBRATION_FILE = "reports/gpu_check.json"
#: the project's last GPU measurement, committed: the cost table's constant where no
#: ``make gpu-check`` of this machine's own exists
COMMITTED_CALIBRATION = "docs/gpu_check.json"


#: how far (relative) a step may count from what its record divided by and still be recounted
#: (a few kernels: a mark or a cast moved, not the code's step)
RECOUNT_TOLERANCE = 0.01


def step_kernels(rows: list[dict[str, Any]], params, batch: int, version: int = COUNTING
                 ) -> dict[str, int]:
    """The kernels of one training step of every model kind in ``rows`` (as
    :func:`attncert.cost.bench.bench_training` times it, at ``params``' shapes and ``batch``),
    counted the way of kernel count ``version``."""
    from attncert.cost.counting import count, train_step
    from attncert.cost.kinds import bench_models, step_terms
    from attncert.msvp import MSVP

    models = bench_models(params)
    out = {}
    for r in rows:
        model, make_batch, _ = models[r["model"]]
        msvp = MSVP(model, *params["specformer"].msvp_lambda) if "MSVP" in r["model"] else None
        loss_fn, after = step_terms(params, r["model"], model)  # the step the bench timed
        step = train_step(model, make_batch, loss_fn, msvp, after, version=version)(batch)
        out[r["model"]] = count(step, version)[1]
    return out


def _per_kernel(rows: list[dict[str, Any]], kernels: dict[str, int]) -> dict[str, float]:
    return {r["model"]: r["ms_per_step"] / 1e3 / max(kernels[r["model"]], 1) for r in rows}


def kernel_seconds(rows: list[dict[str, Any]], params, batch: int) -> dict[str, float]:
    """Seconds per kernel of every measured model kind: its measured step time (``rows`` of
    :func:`attncert.cost.bench.bench_training` at ``batch``) over the kernels of one step."""
    return _per_kernel(rows, step_kernels(rows, params, batch))


def _largest(per: dict[str, float]) -> dict[str, Any]:
    """The record's fallback constant: the largest measured (work of no measured kind)."""
    best = max(per, key=per.get)
    return {"kernel_seconds": per[best], "from": best}


def measure(params, device: str = "cuda", batch: int = 8, steps: int = 5,
            path: str | Path = CALIBRATION_FILE) -> dict[str, Any]:
    """Time every model kind's training step on the CUDA ``device``, derive the per-kernel
    constant and write it with the measurements (and each step's kernels) to ``path``; return
    the record; a kind whose step failed keeps its status and no constant. ValueError on a
    device that is not a GPU (a CPU's step times say nothing about kernel launches) or when no
    step ran."""
    import torch

    from attncert.cost.bench import bench_training
    from attncert.pipeline.device import resolve_device

    dev = resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"the calibration measures a GPU; {device!r} is {dev}")
    rows = bench_training(params, batch=batch, steps=steps, device=str(dev))
    ran = [r for r in rows if r["status"] == "ok" and math.isfinite(r["ms_per_step"])]
    if not ran:
        raise ValueError("no model kind's training step ran: "
                         + "; ".join(f"{r['model']}: {r['status']}" for r in rows))
    kernels = step_kernels(ran, params, batch)
    per = _per_kernel(ran, kernels)
    record = {"date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(dev),
              "torch": torch.__version__, "cuda": torch.version.cuda, "batch": batch,
              "counting": COUNTING,
              "steps": [dict(r, kernels=kernels[r["model"]], seconds_per_kernel=per[r["model"]])
                        if r["model"] in per else r for r in rows]} | _largest(per)
    write_json(path, record)
    return record


def recount(params, path: str | Path = CALIBRATION_FILE) -> dict[str, Any]:
    """Divide the measured step times of the calibration at ``path`` by the kernels the
    current count gives their steps (at ``params``, the params file the steps were measured
    at, and the record's batch), write it back with the count's version and return it.

    Valid only for a step whose code is the code measured: each step is first counted the
    record's way and held to the kernels the record divided by (its ``kernels``, else its
    step time over its constant), within :data:`RECOUNT_TOLERANCE`. A step that counts
    otherwise (its code or ``--params`` changed since) keeps its times but loses its constant,
    and ``recount_refused`` names it; its stage then takes the largest constant until ``make
    gpu-check`` measures it again.
    ValueError on a record without step times or batch (a constant alone cannot be recounted)
    or without a step left to recount."""
    path = Path(path)
    record = json.loads(path.read_text())
    steps = [r for r in record.get("steps", []) if r.get("status", "ok") == "ok"
             and "seconds_per_kernel" in r]
    if not steps or not all("ms_per_step" in r for r in steps) or "batch" not in record:
        raise ValueError(f"{path}: no measured step times and batch to recount; measure "
                         f"again (make gpu-check)")
    batch, version = int(record["batch"]), int(record.get("counting", 1))
    then = step_kernels(steps, params, batch, version)
    divided = {r["model"]: r.get("kernels") or round(r["ms_per_step"] / 1e3
                                                      / r["seconds_per_kernel"])
               for r in steps}
    refused = {m: f"counts {then[m]} kernels the record's way, the record divided by {k}"
               for m, k in divided.items() if abs(then[m] - k) > RECOUNT_TOLERANCE * k}
    same = [r for r in steps if r["model"] not in refused]
    if not same:
        raise ValueError(f"{path}: no step counts as it was measured ({refused}); measure "
                         f"again (make gpu-check)")
    now = step_kernels(same, params, batch)
    per = _per_kernel(same, now)
    record["steps"] = [
        dict(r, kernels=now[r["model"]], seconds_per_kernel=per[r["model"]])
        if r["model"] in per else
        {k: v for k, v in r.items() if k not in ("kernels", "seconds_per_kernel")}
        for r in record["steps"]]
    record |= {"counting": COUNTING, "recounted": datetime.date.today().isoformat(),
               "recount_refused": refused} | _largest(per)
    write_json(path, record)
    return record


def calibration_path(path: str | Path | None = None) -> Path:
    """``path``, or this machine's ``make gpu-check`` (:data:`CALIBRATION_FILE`) when it
    exists, else the committed one (:data:`COMMITTED_CALIBRATION`)."""
    if path is None:
        path = next((p for p in (CALIBRATION_FILE, COMMITTED_CALIBRATION) if Path(p).is_file()),
                    CALIBRATION_FILE)
    return Path(path)


def calibrated(gpu: GPU, path: str | Path | None = None) -> GPU:
    """``gpu`` with the per-kernel constant of the calibration at ``path``
    (:func:`calibration_path`; unchanged when there is none). ValueError on a record counted
    with another kernel count than this code's (:data:`~attncert.cost.counting.COUNTING`)."""
    path = calibration_path(path)
    if not path.is_file():
        return gpu
    record = json.loads(path.read_text())
    if record.get("counting", 1) != COUNTING:
        raise ValueError(f"{path}: its constants divide by kernel count version "
                         f"{record.get('counting', 1)}, this code counts version {COUNTING}: "
                         f"measure again (make gpu-check), or recount the steps whose code is "
                         f"unchanged: python -m attncert.cost recount --calibration {path}")
    per = {r["model"]: float(r["seconds_per_kernel"]) for r in record.get("steps", [])
           if "seconds_per_kernel" in r}
    if not per:  # a record of one constant only
        return dataclasses.replace(gpu, kernel_seconds=float(record["kernel_seconds"]),
                                   calibration=f"{record['device']}, {record['date']}, "
                                               f"{record['from']}")
    by_stage = tuple((stage, max(per[m] for m in models))
                     for stage, models in STAGE_MODELS.items() if all(m in per for m in models))
    return dataclasses.replace(gpu, kernel_seconds=max(per.values()),
                               kernel_seconds_by_stage=by_stage,
                               kernel_seconds_by_kind=tuple(sorted(per.items())),
                               calibration=f"{record['device']}, {record['date']}, "
                                           f"{len(per)} model kinds")
