"""The CertViT stage: a pre-trained standard ViT adapted, constrained by Douglas-Rachford
splitting, fine-tuned and certified in every constraining mode side by side, beside a linear
classifier on pixels. Every training phase is a resumable checkpoint folder; a broken
certificate fails the unit. The methods (adaptation, the constraining modes and their budgets,
the certificate) live in :mod:`attncert.certvit`.

The stage is split into independent units (:func:`units`, one DVC stage each, so that several
GPUs share it): ``main`` (the section's own ViT, ``certvit_main``), ``table1-<dataset>`` (a
CertViT Table 1 ViT trained here, ``certvit_table1@<dataset>``) and ``imagenet`` (CertViT
Table 3's ImageNet-pretrained ViTs, ``certvit_imagenet``). :func:`run` with the unit as
``ctx.item`` writes one record per unit; with ``ctx.item`` None it gathers them into the
stage's metrics file.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from attncert import soundness
from attncert.certvit import plan
from attncert.certvit.params import Params
from attncert.certvit.steps import (
    Result,
)
from attncert.certvit.study import imagenet_route, run_steps
from attncert.certvit.tables import (
    at_paper_eps,
    broken_count,
    imagenet_rows,
    table1_entry,
    table1_eps,
)
from attncert.data import load_processed
from attncert.pipeline.context import Context
from attncert.pipeline.io import write_json
from attncert.pipeline.jobs import Job
from attncert.pipeline.params import (
    BaseParams,
    StudyParams,
)
from attncert.pipeline.records import SplitRun, gathered, read_record, unit_key
from attncert.report.headline import middle_eps, numbers, row
from attncert.report.paper import certvit_table1

#: this module's params.yaml section
SECTION = "certvit"


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.certvit.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return plan.jobs(params)


# ------------------------------------------------------------------ units and the gather
MAIN, IMAGENET, TABLE1 = "main", "imagenet", "table1-"


def units(p: Params) -> list[str]:
    """The stage's independent units, one DVC stage each: ``main`` (``certvit_main``), one per
    Table 1 dataset (``table1-<dataset>``: ``certvit_table1@<dataset>``) and ``imagenet``
    (``certvit_imagenet``). :func:`run` gathers them."""
    return [MAIN, *(TABLE1 + d for d in p.table1.datasets), IMAGENET]


def unit_file(p: Params, unit: str) -> Path:
    """Where :func:`_run_unit` writes the unit's record (JSON)."""
    return Path(p.results_dir) / "units" / f"{unit}.json"


def unit_stage(p: Params, unit: str) -> str:
    """The DVC stage that runs ``unit`` of :func:`units` (dvc.yaml)."""
    if unit.startswith(TABLE1):
        return f"certvit_table1@{unit.removeprefix(TABLE1)}"
    return f"certvit_{unit}"


def table1_params(p: Params, dataset: str, processed_dir: str) -> Params:
    """The section of the Table 1 run on ``dataset`` (its images' size from the data)."""
    size = int(load_processed(dataset, processed_dir)["train"]["x"].shape[-1])
    return p.table1_run(dataset, size)


def unit_params(p: Params, unit: str, processed_dir: str) -> Params:
    """The params a unit's run uses: the section (``main``, ``imagenet``) or its Table 1
    run's (:meth:`Params.table1_run`)."""
    if unit.startswith(TABLE1):
        return table1_params(p, unit.removeprefix(TABLE1), processed_dir)
    return p


def run(p: Params, ctx: Context) -> SplitRun[Result]:
    """``ctx.item``: one unit of :func:`units` (:func:`_run_unit`: its record, and its run's
    :class:`Result` for ``main`` and Table 1); ``None``: the gathering stage (:func:`_gather`:
    the metrics)."""
    if ctx.item is None:
        _gather(p, ctx)
        return gathered(p.metrics, None)
    return SplitRun(ctx.item, *_run_unit(p, ctx, ctx.item))


def _run_unit(p: Params, ctx: Context, unit: str) -> tuple[dict[str, Any], Result | None]:
    """Run one unit of :func:`units` on ``ctx.device``; write its record to :func:`unit_file`
    and return it with the run's :class:`Result` (``None`` for ``imagenet``). A broken
    certificate raises before the record is written."""
    base, device = ctx.require_base(), ctx.device
    if unit not in units(p):
        raise ValueError(f"certvit unit {unit!r}: not one of {units(p)}")
    r = None
    if unit == IMAGENET:
        body = imagenet_route(p, base, device, ctx.processed_dir)
    elif unit == MAIN:
        r = run_steps(p, base, device, ctx.processed_dir)
        body = r.metrics
    else:
        r = run_steps(unit_params(p, unit, ctx.processed_dir), base, device, ctx.processed_dir)
        body = table1_entry(r.metrics)
    record = {"unit": unit, "key": unit_key("certvit", p, base), "device": str(device), **body}
    write_json(unit_file(p, unit), record)
    return record, r


def read_unit(p: Params, base: BaseParams, unit: str) -> dict[str, Any]:
    """The record :func:`_run_unit` wrote for ``unit``; ValueError when it is missing or was
    computed from other params (run the unit's DVC stage first)."""
    return read_record(unit_file(p, unit), unit_key("certvit", p, base),
                       f"the certvit unit {unit!r}", unit_stage(p, unit))


def _gather(p: Params, ctx: Context) -> dict[str, Any]:
    """Gather every unit's record into the stage's metrics file: the ``main`` run's numbers
    at the top level, ``imagenet`` (CertViT Table 3's route) and ``table1`` (per dataset).
    Reads records only (no device); a broken certificate in any record fails the stage."""
    base = ctx.require_base()
    t0 = time.perf_counter()
    main = read_unit(p, base, MAIN)
    table1 = {d: read_unit(p, base, TABLE1 + d) for d in p.table1.datasets}
    net = read_unit(p, base, IMAGENET)
    broken = {u: broken_count(e) for u, e in [(MAIN, main), *((TABLE1 + d, e)
                                                          for d, e in table1.items())]}
    if isinstance(net["imagenet"], dict):  # Table 3's route: every model's modes
        broken[IMAGENET] = sum(int(mm.get("broken", 0)) for e in net["imagenet"]["models"]
                               .values() for mm in e["modes"].values())
    if any(broken.values()):
        raise soundness.UnsoundCertificateError(
            f"broken certificates in the certvit units {broken} (see {unit_file(p, MAIN).parent})")
    drop = ("unit", "key", "device")
    out = {k: v for k, v in main.items() if k not in drop}
    out["imagenet"] = net["imagenet"]  # the models' lines: the unit's record and report
    out["table1"] = {d: {k: v for k, v in e.items() if k not in drop}
                     for d, e in table1.items()}
    out["total_seconds"] = (main["total_seconds"] + net["seconds"]
                            + sum(e["total_seconds"] for e in table1.values())
                            + time.perf_counter() - t0)
    write_json(p.metrics, out)
    return out


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """The headline mode's accuracies and bound, the other modes' and the linear baseline's,
    then the Table 1 runs beside CertViT's Table 1 (at the pixel radius its eps covers). The
    section's own run (a pre-trained ViT-B/16, or the cpu scale's 1-layer ViT) is not Table
    1's setting: no paper number stands beside it."""
    dataset = m.get("dataset")
    ref, src = {}, None

    def paper_value(key: str, scale: float = 1.0) -> float | None:
        return ref[key] / scale if key in ref else None

    rows = [row("test_clean_acc", "clean accuracy (certified model)", m.get("test_clean_acc"),
                "fraction", paper_value("clean", 100), src, brief=True)]
    attacked = (f" (first {m['n_attacked']} test images)"
                if m.get("n_attacked", m.get("n_test")) != m.get("n_test") else "")
    for what, label, key in (("pgd_acc", f"L2 PGD accuracy{attacked}", "pgd"),
                             ("certified_acc", "certified accuracy", "certified")):
        for eps, acc in m.get(what, {}).items():
            at_paper = at_paper_eps(dataset, eps)
            rows.append(row(f"{what}/{eps}", f"{label} at eps {eps}", acc, "fraction",
                            paper_value(key, 100) if at_paper else None, src,
                            brief=at_paper))
    # the certificate's constant (features x pairwise head rows) when recorded, else pixels ->
    # logits (metrics written before the pairwise constant existed)
    key = "lipschitz_pairwise" if "lipschitz_pairwise" in m else "lipschitz"
    final = m.get(key, {}).get("final")
    if final is not None:
        rows.append(row(f"{key}/final", "Lipschitz bound of the final model", final, "value",
                        paper_value("lipschitz"), src, brief=True))
    if m.get("attention"):
        rows.append(row("attention/uniform_gap", "points lost with uniform attention "
                        "(certified model)", m["attention"]["uniform_gap"], "value", brief=True))
    for mode, mm in m.get("modes", {}).items():
        if mode == m.get("headline_mode"):
            continue
        rows.append(row(f"modes/{mode}/test_clean_acc", f"{mode} mode: clean accuracy",
                        mm.get("test_clean_acc"), "fraction", brief=True))
        for eps, acc in mm.get("certified_acc", {}).items():
            rows.append(row(f"modes/{mode}/certified_acc/{eps}",
                            f"{mode} mode: certified accuracy at eps {eps}", acc, "fraction",
                            brief=at_paper_eps(dataset, eps)))
        bound = mm.get("lipschitz_pairwise", {}).get("final")
        if bound is not None:
            rows.append(row(f"modes/{mode}/lipschitz_pairwise/final",
                            f"{mode} mode: Lipschitz bound of the final model", bound, "value",
                            brief=True))
    base = m.get("linear_baseline")
    if base:  # the trivial baseline beside the ViTs: a linear classifier on pixels
        rows.append(row("linear_baseline/clean_acc", "linear baseline (pixels): clean accuracy",
                        base.get("clean_acc"), "fraction", brief=True))
        for eps, acc in base.get("certified_acc", {}).items():
            rows.append(row(f"linear_baseline/certified_acc/{eps}",
                            f"linear baseline (pixels): certified accuracy at eps {eps}", acc,
                            "fraction", brief=at_paper_eps(dataset, eps)))
        rows.append(row("linear_baseline/broken", "linear baseline (pixels): broken "
                        "certificates", base.get("broken"), "count"))
    for d, t in m.get("table1", {}).items():  # CertViT Table 1: a small ViT trained here
        ref, name = certvit_table1(d) or ({}, None)
        e = str(table1_eps(d))
        for mode, mm in t["modes"].items():
            where = f"Table 1 {d}, {mode} mode"
            rows.append(row(f"table1/{d}/modes/{mode}/test_clean_acc", f"{where}: clean accuracy",
                            mm.get("test_clean_acc"), "fraction",
                            ref["clean"] / 100 if ref else None, name, brief=True))
            firsts = (f" (first {mm['n_attacked']} test images)"
                      if mm.get("n_attacked", t.get("n_test")) != t.get("n_test") else "")
            for what, label, key in (("certified_acc", "certified accuracy", "certified"),
                                     ("pgd_acc", f"L2 PGD accuracy{firsts}", "pgd")):
                if e in mm.get(what, {}):
                    rows.append(row(f"table1/{d}/modes/{mode}/{what}/{e}",
                                    f"{where}: {label} at eps {e}", mm[what][e], "fraction",
                                    ref[key] / 100 if ref else None, name, brief=True))
            rows.append(row(f"table1/{d}/modes/{mode}/lipschitz_pairwise",
                            f"{where}: Lipschitz bound of the final model",
                            mm["lipschitz_pairwise"], "value",
                            ref.get("lipschitz") if ref else None, name, brief=True))
    net = m.get("imagenet")
    if isinstance(net, dict):
        rows += imagenet_rows(net)
    units = {"broken": "count", "n_test": "count", "n_attacked": "count",
             "median_radius": "value",
             "total_seconds": "seconds"}
    for key, unit in units.items():
        if isinstance(m.get(key), int | float):
            rows.append(row(key, key.replace("_", " "), m[key], unit))
    return rows


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: the headline mode's final clean accuracy, its certified and PGD
    accuracy at the middle eps, broken certificates, the points it loses with uniform
    attention."""
    pgd = m.get("pgd_acc", {})
    eps = middle_eps(pgd)
    clean = m.get("test_clean_acc")
    return numbers(clean=clean if isinstance(clean, int | float) else None,
                   cert=m.get("certified_acc", {}).get(eps), pgd=pgd.get(eps),
                   eps=None if eps is None else float(eps), broken=m.get("broken"),
                   attn_uniform_gap=(m.get("attention") or {}).get("uniform_gap"))
