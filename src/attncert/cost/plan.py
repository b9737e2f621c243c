"""The multi-GPU schedule: the paper scale's units of work, longest first on N GPUs.

A unit is what ``scripts/repro-gpus`` hands one GPU: a grid point (its ``train_vit`` and
``certify_vit`` stages) or a unit stage of a split stage (``specformer_runs@<dataset>``,
``text_unit@<unit>``, ``crown_unit@<dataset>-<depth>``, ``certvit_table1@<dataset>``...:
``Work.unit``); ``tightness``, the gathering stages and ``figures`` run after every unit.
Each unit's hours come from the same per-work estimate as the cost table (CROWN's bounds at
their worst: the time limit of every bound, capped by the unit's time budget).
Longest-processing-time-first list scheduling gives the makespan on N GPUs (within 4/3 of the
optimum); the speed-up over one GPU cannot exceed total / longest unit, so a stage that is one
unit bounds it.

With K units per GPU (``scripts/repro-gpus --per-gpu K``) the makespan is that of N x K slots,
each unit's time under sharing (:meth:`attncert.cost.work.Work.seconds`): its FLOPs at 1 / K of
the GPU (the worst case) and its kernels at the measured per-kernel slowdown of K concurrent
processes (:data:`CONCURRENCY`); a K without a measurement at or above it is refused.
"""

from __future__ import annotations

import heapq
from collections import defaultdict

from attncert.cost.counting import GPU, UTILISATION
from attncert.cost.table import stage_work

#: stages that run after every unit (they read the grid's models and every stage's metrics)
AFTER = ("tightness", "figures")
#: K concurrent units on one GPU -> the time of a step of each against one alone, measured
#: (docs/gpus.md, 2026-11-28, one H200: K processes training the grid's Lipschitz ViT, batch
#: 128, eager: 38.4 ms a step alone, 41.1 ms each with K = 4). A K between two measured ones
#: takes the larger K's slowdown (the slowdown grows with K).
CONCURRENCY: dict[int, float] = {1: 1.0, 4: 41.1 / 38.4}


def slowdown(per_gpu: int) -> float:
    """The per-kernel slowdown of ``per_gpu`` concurrent units (:data:`CONCURRENCY`)."""
    if per_gpu < 1:
        raise ValueError(f"units per GPU must be >= 1, got {per_gpu}")
    measured = [k for k in sorted(CONCURRENCY) if k >= per_gpu]
    if not measured:
        raise ValueError(f"{per_gpu} units per GPU: concurrency is measured up to "
                         f"{max(CONCURRENCY)} (attncert.cost.plan.CONCURRENCY); measure more "
                         "with python -m attncert.cost bench --concurrent K on the GPU")
    return CONCURRENCY[measured[0]]


def unit_hours(params, gpu: GPU, utilisation: float = UTILISATION, per_gpu: int = 1
               ) -> dict[str, float]:
    """Estimated hours of every unit (a grid point, a unit stage, or a stage), alone on a GPU
    or one of ``per_gpu`` sharing it."""
    slow = slowdown(per_gpu)
    work, _ = stage_work(params)
    hours: dict[str, float] = defaultdict(float)
    for w in work:
        if w.stage in ("train_vit", "certify_vit"):
            unit = "grid " + w.what.split(":")[0]
        elif w.stage in ("data", *AFTER):
            continue
        else:
            unit = w.unit or w.stage
        hours[unit] += w.seconds(gpu, utilisation, per_gpu, slow) / 3600
    return dict(hours)


def makespan(hours: list[float], gpus: int) -> float:
    """Longest-processing-time-first list scheduling of ``hours`` on ``gpus`` machines."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    loads = [0.0] * gpus
    heapq.heapify(loads)
    for h in sorted(hours, reverse=True):
        heapq.heappush(loads, heapq.heappop(loads) + h)
    return max(loads)


def plan_table(params, gpu: GPU, gpus: list[int], utilisation: float = UTILISATION,
               per_gpu: int = 1) -> str:
    """Per N: the makespan and its speed-up over one GPU running one unit at a time, then the
    longest units (``per_gpu`` units sharing each GPU: N x ``per_gpu`` slots)."""
    alone = unit_hours(params, gpu, utilisation)
    hours = alone if per_gpu == 1 else unit_hours(params, gpu, utilisation, per_gpu)
    total = sum(alone.values())
    longest = sorted(hours.items(), key=lambda kv: -kv[1])
    shared = ("" if per_gpu == 1 else
              f"; {per_gpu} units per GPU, each kernel {slowdown(per_gpu):.2f}x as long and "
              f"the FLOPs shared (units' hours {sum(hours.values()):.3g} in all)")
    lines = [f"{len(hours)} units, {total:.3g} GPU-hours in all (one {gpu.name} at "
             f"{utilisation:.0%}; CROWN's bounds at their worst: see the cost table){shared}; "
             f"longest unit {longest[0][0]} {longest[0][1]:.3g} h bounds the speed-up at "
             f"{total / longest[0][1]:.2g}x",
             "", "| GPUs | units per GPU | makespan (h) | speed-up over 1 GPU, 1 unit |",
             "|---|---|---|---|"]
    for n in gpus:
        span = makespan(list(hours.values()), n * per_gpu)
        lines.append(f"| {n} | {per_gpu} | {span:.3g} | {total / span:.2f}x |")
    lines += ["", "| longest units | hours |", "|---|---|"]
    lines += [f"| {name} | {h:.3g} |" for name, h in longest[:6]]
    return "\n".join(lines)


def dvc_unit_hours(unit: str, hours: dict[str, float]) -> float:
    """The hours of a ``scripts/repro-gpus`` unit (its dvc stage names, space-separated): a
    grid point's ``train_vit@<dataset>-<depth>-<heads>-<gamma_vo>`` or a stage's name; 0 for
    a unit the estimate does not know."""
    from attncert.pipeline.runs import run_name

    first = unit.split()[0]
    if first.startswith("train_vit@"):
        dataset, depth, heads, vo = first.split("@", 1)[1].rsplit("-", 3)
        return hours.get("grid " + run_name(dataset, int(depth), int(heads), float(vo)), 0.0)
    return hours.get(first, 0.0)


def order(units: list[str], params, gpu: GPU, utilisation: float = UTILISATION) -> list[str]:
    """``units`` longest first by their estimated hours (ties keep their order)."""
    hours = unit_hours(params, gpu, utilisation)
    return sorted(units, key=lambda u: -dvc_unit_hours(u, hours))
