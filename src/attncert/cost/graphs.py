"""The cost model's measured corrections: the CUDA-graph speed-up of training steps
(``base.compile``) and the pilot's calibration per unit kind.

:data:`COMPILE_BENCH` is the committed measurement: per training step kind, the step time
eager and replayed as CUDA graphs (``python -m attncert.cost bench --device cuda --modes eager
graphs`` on a GPU; docs/gpus.md). When the params train under CUDA graphs (``base.compile``
``auto`` or ``graphs``: graphs on a GPU), :func:`with_graphs` gives the cost model's GPU
each measured kind's ratio, and a training work item's kernels (:class:`attncert.cost.work.
Work`, its ``graphs`` key from :func:`graphs_key`) take that much less time. Its FLOPs are
unchanged; a kind without a measurement (PGD adversarial training is a kind of its own,
:func:`graphs_key`) and certificates count eager. The PGD audits of the image models, whose
attack copy compiles in the same mode, take their kind's measured audit step the same way.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from attncert.cost.counting import GPU

#: the committed eager / CUDA-graph step times per training step kind
COMPILE_BENCH = "docs/compile_bench.json"
#: the bench's model kinds (:func:`attncert.cost.kinds.bench_models`)
LIPSCHITZ_VIT = "lipschitz ViT (train_vit)"
STANDARD_VIT = "standard ViT (specformer vanilla)"
MSVP_VIT = "SpecFormer (MSVP)"
OLSA_TEXT = "OLSA text"
LOFAST_TEXT = "LoFAST text"
STANDARD_TEXT = "standard text"
FROZEN_HEAD = "OLSA frozen-encoder head"
#: the bench's text model kinds (the frozen head trains on the encoder's cached states)
TEXT_KINDS = (OLSA_TEXT, LOFAST_TEXT, STANDARD_TEXT, FROZEN_HEAD)
#: the step kind's suffix for PGD adversarial training (:func:`graphs_key`)
ADVERSARIAL = "PGD training"
#: the step kind's suffix for a PGD audit's attack step (:func:`graphs_key`)
AUDIT = "PGD audit"


def graphs_key(kind: str, margin: str = "none", msvp: bool = False,
               adversarial: bool = False, audit: bool = False) -> str:
    """The step kind of a training run: the bench's model ``kind`` (a Lipschitz ViT with its
    training ``margin``; an MSVP penalty on a Lipschitz ViT is a kind of its own; PGD
    adversarial training, its attack's passes and the training pass, another), or with
    ``audit`` the step of a PGD audit of a model of ``kind`` (its compiled attack copy)."""
    if audit:
        return f"{kind}, {AUDIT}"
    key = kind
    if margin != "none":
        key += f", margin {margin}"
    if msvp and kind != MSVP_VIT:
        key += ", MSVP"
    if adversarial:
        key += f", {ADVERSARIAL}"
    return key


def _positive(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v) and v > 0


def with_graphs(gpu: GPU, params, path: str | Path = COMPILE_BENCH) -> GPU:
    """``gpu`` with the measured CUDA-graph speed-ups when ``params`` train under graphs on a
    GPU (``base.compile`` ``auto`` or ``graphs``), unchanged otherwise (``off``, ``compile``:
    not measured). A missing record: unchanged (nothing counted)."""
    if params["base"].compile not in ("auto", "graphs") or not Path(path).is_file():
        return gpu
    record = json.loads(Path(path).read_text())
    used = [r for r in record["steps"] if _positive(r.get("graphs_ms"))
            and _positive(r.get("eager_ms"))]
    ratios = tuple((r["key"], r["eager_ms"] / r["graphs_ms"]) for r in used)
    where = sorted({r.get("device", record["device"]) for r in used}) or [record["device"]]
    when = sorted({r.get("date", record["date"]) for r in used}) or [record["date"]]
    return dataclasses.replace(gpu, graphs_speedup=ratios,
                               graphs_source=f"{', '.join(where)}, "
                                             f"{' to '.join(dict.fromkeys([when[0], when[-1]]))}"
                                             f", batch {record['batch']}")


def estimated_speedups(gpu: GPU, keys) -> tuple[tuple[str, float], ...]:
    """An estimate of the CUDA-graph speed-up of each step kind in ``keys`` that has no
    measurement, from the measured ones of ``gpu`` (:func:`with_graphs`); the kinds it cannot
    estimate are left out (they stay eager).

    A kind that extends a measured one (PGD adversarial training or a PGD audit of a measured
    model kind, a training margin compiled with its loss (``lofast``), an MSVP penalty added to
    a measured margin: its key's longest measured prefix,
    :func:`graphs_key`) takes that kind's ratio: its passes are the same model's forward and
    backward, replayed the same way, and the attack's few elementwise kernels between passes
    run eager. Where the key adds the MSVP penalty, no more than the MSVP model's ratio (its
    penalty ran eager there). A text model kind of no measured prefix (OLSA's, the frozen
    head's) takes the smallest ratio measured on a text kind. Estimates only: the cost table
    shows them beside the total, never in it."""
    measured = dict(gpu.graphs_speedup)
    text = [measured[k] for k in TEXT_KINDS if k in measured]
    out = []
    for key in dict.fromkeys(k for k in keys if k and k not in measured):
        parts = key.split(", ")
        prefix = next((", ".join(parts[:n]) for n in range(len(parts) - 1, 0, -1)
                       if ", ".join(parts[:n]) in measured), None)
        if prefix is not None:
            ratio = measured[prefix]
            if "MSVP" in parts[1:] and MSVP_VIT in measured:
                ratio = min(ratio, measured[MSVP_VIT])
        elif parts[0] in TEXT_KINDS and text:
            ratio = min(text)
        else:
            continue
        out.append((key, ratio))
    return tuple(out)


def compile_rows(training: dict[str, list[dict]], margins: dict[str, list[dict]]
                 ) -> list[dict]:
    """The record's rows from :func:`attncert.cost.bench.bench_training` and
    :func:`~attncert.cost.bench.bench_margins` rows per mode (``eager`` and ``graphs``): per
    step kind (:func:`graphs_key`) its eager and CUDA-graph ms a step, ``graphs_ms`` None with
    the failure as the note where the graphs did not run."""
    out = []
    pairs = [(r["model"], r) for r in training.get("eager", [])]
    pairs += [(graphs_key(LIPSCHITZ_VIT, r["margin"]), r) for r in margins.get("eager", [])
              if r["margin"] != "none"]
    graphs = {r["model"]: r for r in training.get("graphs", [])}
    graphs |= {graphs_key(LIPSCHITZ_VIT, r["margin"]): r for r in margins.get("graphs", [])
               if r["margin"] != "none"}
    for key, eager in pairs:
        if eager["status"] != "ok" or not math.isfinite(eager["ms_per_step"]):
            continue  # no eager time: nothing to compare with (the bench printed why)
        g = graphs.get(key)
        ok = g is not None and g["status"] == "ok" and math.isfinite(g["ms_per_step"])
        out.append({"key": key, "eager_ms": round(eager["ms_per_step"], 2),
                    "graphs_ms": round(g["ms_per_step"], 2) if ok else None,
                    "note": "" if ok else (g["status"] if g else "graphs not run")})
    return out


def merge_compile_bench(path: str | Path, rows: list[dict], device: str, date: str,
                        torch_version: str, batch: int, precision: str) -> dict:
    """Merge :func:`compile_rows` into the record at ``path`` (each replacing the row of its
    key; the record's device, date and batch become this measurement's, each row keeps its
    own), written atomically."""
    from attncert.pipeline.io import merge_rows

    here = {"date": date, "device": device, "torch": torch_version, "batch": batch,
            "precision": precision}

    def update(record: dict) -> None:
        for r in record["steps"]:  # rows measured before keep where, when and how
            for k in here:
                r.setdefault(k, record.get(k))
        record |= here | {"measured_by": "python -m attncert.cost bench --device cuda --modes "
                                         "eager graphs --write-compile (attncert.cost.bench."
                                         "bench_training, bench_margins)"}

    return merge_rows(path, [r | here for r in rows], lambda r: r["key"], "steps", update)


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
