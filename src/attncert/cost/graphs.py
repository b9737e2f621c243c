"""The CUDA-graph speed-up of training steps in the cost model (``base.compile``).

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
