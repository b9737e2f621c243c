"""The cost model's measured corrections: the CUDA-graph speed-up of training steps
(``base.compile``) and the pilot's calibration per unit kind.

:data:`COMPILE_BENCH` is the committed measurement: per training step kind, the step time
eager and replayed as CUDA graphs (``python -m attncert.cost bench --device cuda --modes eager
graphs`` on a GPU; docs/gpus.md). When the params train under CUDA graphs (``base.compile``
``auto`` or ``graphs``: graphs on a GPU), :func:`with_graphs` gives the cost model's GPU
each measured kind's ratio, and a training work item's kernels (:class:`attncert.cost.work.
Work`, its ``graphs`` key from :func:`graphs_key`) take that much less time. Its FLOPs are
unchanged; a kind without a measurement, an adversarial run (eager,
:func:`attncert.training.compiled.graphs_blocker`), certificates and audits count eager.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from attncert.cost.counting import GPU

#: the committed eager / CUDA-graph step times per training step kind
COMPILE_BENCH = "docs/compile_bench.json"
#: the bench's model kinds (:func:`attncert.cost.bench.bench_models`)
LIPSCHITZ_VIT = "lipschitz ViT (train_vit)"
STANDARD_VIT = "standard ViT (specformer vanilla)"
MSVP_VIT = "SpecFormer (MSVP)"


def graphs_key(kind: str, margin: str = "none", msvp: bool = False) -> str:
    """The step kind of a training run: the bench's model ``kind`` (a Lipschitz ViT with its
    training ``margin``; an MSVP penalty on a Lipschitz ViT is a kind of its own)."""
    key = kind
    if margin != "none":
        key += f", margin {margin}"
    if msvp and kind != MSVP_VIT:
        key += ", MSVP"
    return key


def with_graphs(gpu: GPU, params, path: str | Path = COMPILE_BENCH) -> GPU:
    """``gpu`` with the measured CUDA-graph speed-ups when ``params`` train under graphs on a
    GPU (``base.compile`` ``auto`` or ``graphs``), unchanged otherwise (``off``, ``compile``:
    not measured). A missing record: unchanged (nothing counted)."""
    if params["base"].compile not in ("auto", "graphs") or not Path(path).is_file():
        return gpu
    record = json.loads(Path(path).read_text())
    ratios = tuple((r["key"], r["eager_ms"] / r["graphs_ms"]) for r in record["steps"]
                   if r.get("graphs_ms"))
    return dataclasses.replace(gpu, graphs_speedup=ratios,
                               graphs_source=f"{record['device']}, {record['date']}, batch "
                                             f"{record['batch']}")


#: the pilot's record (:mod:`attncert.pipeline.pilot`, ``make pilot`` on the GPU box)
PILOT_RECORD = "reports/pilot.json"
#: the stages whose work each pilot unit kind calibrates
PILOT_STAGES = {"grid point": ("train_vit", "certify_vit"), "frontier": ("frontier",),
                "specformer": ("specformer",), "text": ("text",), "crown": ("crown",),
                "certvit": ("certvit",)}


def with_pilot(gpu: GPU, path: str | Path = PILOT_RECORD) -> GPU:
    """``gpu`` with the pilot's calibration (a unit kind's measured / estimated hours) on the
    work of the stages it stands for (:data:`PILOT_STAGES`), applied to the counted work
    (FLOPs or kernels), not to CROWN's bounds, which are their time budget (the crown unit's
    factor still mixes the two: its pilot runs the bounds at the pilot's budget); unchanged
    without a record or for a kind the pilot did not finish."""
    if not Path(path).is_file():
        return gpu
    record = json.loads(Path(path).read_text())
    per = []
    for kind, entry in record.get("units", {}).items():
        factor = entry.get("calibration")
        if entry.get("status") == "ok" and isinstance(factor, (int, float)) and \
                math.isfinite(factor) and factor > 0:
            per += [(stage, float(factor)) for stage in PILOT_STAGES.get(kind, ())]
    if not per:
        return gpu
    return dataclasses.replace(gpu, pilot_by_stage=tuple(per),
                               pilot_source=f"the pilot of {record.get('date', '?')} "
                                            f"({path})")
