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
the GPU (the worst case) and its kernels at the per-kernel slowdown of K concurrent processes
measured for its model kind (:data:`CONCURRENCY_BENCH`, :func:`slowdowns`), or, for a kind or
work item (certificates, audits) without one, the largest slowdown measured at that K (an
estimate, said in the plan); a K without a measurement at or above it is refused.
"""

from __future__ import annotations

import heapq
import json
from collections import defaultdict
from collections.abc import Mapping
from pathlib import Path

from attncert.cost.counting import GPU, UTILISATION
from attncert.cost.table import stage_work

#: stages that run after every unit (they read the grid's models and every stage's metrics)
AFTER = ("tightness", "figures")
#: the measured step times of K processes training one model kind on one GPU at once
#: (``python -m attncert.cost bench --concurrent K --write-concurrency``; docs/gpus.md)
CONCURRENCY_BENCH = "docs/concurrency_bench.json"


def concurrency(path: str | Path = CONCURRENCY_BENCH) -> dict[str, dict[int, float]]:
    """Per model kind (the bench's names, :func:`attncert.cost.bench.bench_models`): K -> the
    time of a step of each of K processes over one alone, the larger over the compile modes
    measured (the slowdown K units per GPU cost each), each K > 1 against the K = 1 run of its
    kind and mode on the same device at the same batch (a row without one counts nothing).
    K = 1 is 1."""
    record = json.loads(Path(path).read_text()) if Path(path).is_file() else {"rows": []}

    def same(r):
        return r["kind"], r["mode"], r.get("device"), r.get("batch")

    alone = {same(r): r["ms_per_step"] for r in record["rows"] if r["k"] == 1}
    out: dict[str, dict[int, float]] = defaultdict(lambda: {1: 1.0})
    for r in record["rows"]:
        base = alone.get(same(r))
        if base and r["k"] > 1:
            out[r["kind"]][r["k"]] = max(out[r["kind"]].get(r["k"], 0.0), r["ms_per_step"] / base)
    return dict(out)


def slowdowns(per_gpu: int, table: Mapping[str, Mapping[int, float]] | None = None
              ) -> tuple[dict[str, float], float]:
    """The per-kernel slowdown of ``per_gpu`` concurrent units for every kind measured at
    ``per_gpu`` or a larger K (the smallest such K: the slowdown grows with K), and the
    largest of them, which every other kind and work item takes (an estimate). Raises when no
    kind is measured at or above ``per_gpu``."""
    if per_gpu < 1:
        raise ValueError(f"units per GPU must be >= 1, got {per_gpu}")
    table = concurrency() if table is None else table
    if per_gpu == 1:
        return {}, 1.0
    per_kind = {}
    for kind, by_k in table.items():
        ks = [k for k in sorted(by_k) if k >= per_gpu]
        if ks:
            per_kind[kind] = by_k[ks[0]]
    if not per_kind:
        most = max((k for by_k in table.values() for k in by_k), default=1)
        raise ValueError(f"{per_gpu} units per GPU: concurrency is measured up to {most} "
                         f"({CONCURRENCY_BENCH}); measure more with python -m attncert.cost "
                         "bench --concurrent K --write-concurrency on the GPU")
    return per_kind, max(per_kind.values())


def slowdown(per_gpu: int, kind: str | None = None,
             table: Mapping[str, Mapping[int, float]] | None = None) -> float:
    """The per-kernel slowdown of ``per_gpu`` concurrent units of ``kind`` (:func:`slowdowns`:
    its measurement, else the largest measured)."""
    per_kind, worst = slowdowns(per_gpu, table)
    return per_kind.get(kind, worst) if kind is not None else worst


def _kind(graphs_key: str) -> str | None:
    """The bench kind of a training work item's step kind (:func:`attncert.cost.graphs.
    graphs_key`: the kind, then its margin or MSVP); None for other work."""
    return graphs_key.split(", ")[0] if graphs_key else None


def unit_hours(params, gpu: GPU, utilisation: float = UTILISATION, per_gpu: int = 1
               ) -> dict[str, float]:
    """Estimated hours of every unit (a grid point, a unit stage, or a stage), alone on a GPU
    or one of ``per_gpu`` sharing it."""
    per_kind, worst = slowdowns(per_gpu)
    work, _ = stage_work(params)
    hours: dict[str, float] = defaultdict(float)
    for w in work:
        if w.stage in ("data", *AFTER):
            continue
        unit = w.unit or w.stage  # a grid point's two stages: one unit, "grid <point>"
        slow = per_kind.get(_kind(w.graphs), worst)
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
    per_kind, worst = slowdowns(per_gpu)
    measured = ", ".join(f"{k} {v:.2f}x" for k, v in sorted(per_kind.items()))
    shared = ("" if per_gpu == 1 else
              f"; {per_gpu} units per GPU, each kernel as long as measured for its model kind "
              f"({measured}; every other kind and the certificates and audits at the largest, "
              f"{worst:.2f}x: an estimate) and the FLOPs shared (units' hours "
              f"{sum(hours.values()):.3g} in all)")
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
