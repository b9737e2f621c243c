"""The frontier stage: certified against clean accuracy of one grid shape under each training
margin, measured on a held-out validation split, with the linear baseline and PGD beside.

Every setting of ``settings`` trains the ``train_vit`` ViT of one grid shape (``depth``,
``heads``, ``gamma_vo``) with ``train_vit``'s whole recipe but the margin: ``lmt-<offset>``
(a fixed logit offset), ``lofast-<radius>`` (certified training with the local bound at that
pixel-l2 radius, :mod:`attncert.training.certified_training`) or ``linear-<offset>`` (the trivial
baseline, :class:`attncert.certvit.baseline.PixelLinear`, trained for its exact radius at that
offset). Each trains on the training split minus its last ``holdout`` images and is measured on
the first ``n_val`` of those: clean accuracy, certified accuracy at every ``cert_eps``
(LoFAST(M), pairwise test, float64; the linear model's exact radius) and L2 PGD accuracy on the
first ``audit.n`` (the soundness audit: a broken certificate fails the unit). The test split
is never read.

:func:`select` picks the setting a scale should train its grid with, on validation numbers
only: the ViT setting with the highest mean over ``datasets`` of (clean accuracy + certified
accuracy at ``select_eps``) / 2. The report says whether ``train_vit`` trains with it.

Each (dataset, setting) is an independent unit (:func:`units`, one DVC stage each:
``frontier_unit@<dataset>-<setting>``); :func:`run` gathers their records.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.figure import Figure
from torch import Tensor

from attncert import certify, diagnostics, soundness
from attncert.certvit.baseline import PixelLinear
from attncert.certvit.certificate import certified_radius
from attncert.data import as_float, load_processed
from attncert.figures import frontier as figs
from attncert.frontier import plan
from attncert.frontier.params import Params
from attncert.frontier.settings import (  # noqa: F401 (the stage's names)
    AXES,
    CERTIFICATE,
    GLOBAL,
    KINDS,
    Setting,
    parse_setting,
    settings_ok,
)
from attncert.frontier.study import (  # noqa: F401 (the stage's names)
    _records,
    attending,
    attention_targets,
    frame,
    grid_setting,
    model_config,
    select,
    sharpening_metrics,
    sharpening_table,
    split,
    task_parts,
    train_config,
    unit_attention,
    unit_table,
    write_sharpening,
)
from attncert.grid.params import TrainVitParams
from attncert.models import build_vit
from attncert.pipeline.context import Context
from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.jobs import Job
from attncert.pipeline.params import StudyParams
from attncert.pipeline.records import SplitRun, gathered, read_record, unit_key
from attncert.report.headline import numbers, row
from attncert.report.paper import MNIST_EPS, mnist_anchor
from attncert.training.checkpoint import fingerprint
from attncert.training.train import evaluate, train_resumable

#: this module's params.yaml section, and the other sections it reads
SECTION = "frontier"
SECTIONS = {"train_vit": TrainVitParams}


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.frontier.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return plan.jobs(params)


def units(p: Params) -> list[str]:
    """The stage's units, one DVC stage each (``frontier_unit@<dataset>-<setting>``)."""
    return [f"{d}-{s}" for d in p.datasets for s in p.settings]


def unit_stage(p: Params, unit: str) -> str:
    """The DVC stage that runs ``unit`` of :func:`units` (dvc.yaml)."""
    return f"frontier_unit@{unit}"


def unit_file(p: Params, unit: str) -> Path:
    return Path(p.results_dir) / "units" / f"{unit}.json"


def _key(p: Params, ctx: Context) -> dict[str, Any]:
    return (unit_key("frontier", p, ctx.require_base())
            | unit_key("train_vit", ctx.section("train_vit"), ctx.require_base()))


def run(p: Params, ctx: Context) -> SplitRun[Result]:
    """``ctx.item``: one unit of :func:`units` (:func:`_run_unit`: its record); ``None``: the
    gathering stage (:func:`_gather`: the :class:`Result`). The ViTs train with
    ``ctx.sections["train_vit"]``'s recipe. Both return a
    :class:`attncert.pipeline.records.SplitRun` (the record or metrics as written; the gathering
    stage's :class:`Result`)."""
    if ctx.item is None:
        return gathered(p.metrics, _gather(p, ctx))
    return SplitRun(ctx.item, _run_unit(p, ctx, ctx.item))


def _run_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """One unit (``<dataset>-<setting>``): train (resumable, ``results_dir/ckpt/<unit>``),
    certify and attack on the validation points, measure what the attention does; write the
    record (before the soundness check, so a failure can be inspected) and return it."""
    base, tv = ctx.require_base(), ctx.section("train_vit")
    dev, precision = ctx.device, ctx.precision
    if unit not in units(p):
        raise ValueError(f"frontier unit {unit!r}: not one of {units(p)}")
    dataset = next(d for d in p.datasets if unit.startswith(f"{d}-")
                   and unit[len(d) + 1:] in p.settings)
    name = unit[len(dataset) + 1:]
    setting = parse_setting(name)
    t0 = time.perf_counter()
    data = load_processed(dataset, ctx.processed_dir)
    data, train, val = task_parts(data, *split(data, p.holdout, p.max_train), setting, base.seed)
    cfg = train_config(p, tv, setting, base.seed)
    torch.manual_seed(base.seed)
    if setting.kind == "linear":
        model = PixelLinear(train["x"][0].numel(), len(data["classes"]), seed=base.seed)
    else:
        model = build_vit(model_config(p, tv, setting, dataset, data))
    fp = fingerprint(model.config, cfg, dataset,
                          f"{data['source']}; the first {len(train['y'])} of the training split "
                          f"minus its last {p.holdout}", precision)
    curves, status = train_resumable(model, train, val, cfg, Path(p.results_dir) / "ckpt" / unit,
                                     dev, fingerprint=fp, precision=precision,
                                     eval_name="validation")
    n = min(p.n_val, len(val["y"]))
    x = as_float(val["x"][:n]).to(dev, torch.float64)
    y = val["y"][:n].to(dev)
    model = model.eval().double()
    t1 = time.perf_counter()
    radii: dict[str, Tensor] = {}
    if setting.kind == "linear":
        with torch.no_grad():
            logits = model(x)
            radii[name] = certified_radius(logits, model.head_weight(), 1.0).cpu()
            correct = (logits.argmax(1) == y).cpu()
    elif setting.kind == "standard":  # not certifiable (LayerNorm): attacked only
        with torch.no_grad():
            correct = (model(x).argmax(1) == y).cpu()
    else:
        table = certify.certify_table(model, x, y, [CERTIFICATE[0], GLOBAL[0]], ["pairwise"],
                                      1.0, p.max_radius, p.cert_batch_size)
        correct = torch.tensor(table["correct"].to_numpy()).bool()
        radii[name] = torch.tensor(table["radius_{}_{}".format(*CERTIFICATE)].to_numpy())
        radii["global"] = torch.tensor(table["radius_{}_{}".format(*GLOBAL)].to_numpy())
    cert_seconds = time.perf_counter() - t1
    attention = (None if setting.kind == "linear" else
                 diagnostics.attention_diagnostics(model, x, y, p.cert_batch_size))
    m = p.audit.count(n)
    torch.manual_seed(base.seed)
    audit, _ = certify.audit(model, x[:m], y[:m], {k: r[:m] for k, r in radii.items()},
                             p.cert_eps, p.audit.steps, p.audit.restarts, base.seed,
                             p.audit.batch(p.cert_batch_size), progress=True)
    record = {
        "unit": unit, "key": _key(p, ctx), "device": str(dev), "dataset": dataset,
        "setting": name, "kind": setting.kind, "value": setting.value, "axes": setting.axes,
        "patch": getattr(model.config, "patch", None),
        "depth": getattr(model.config, "depth", None), "n_train": len(train["y"]), "n_val": n,
        "n_attacked": m, "checkpoint": status, "epochs": len(curves),
        "train_seconds": sum(r["seconds"] for r in curves),
        "clean_acc": float(correct.double().mean()),
        "val_acc_full": evaluate(model.float(), val, dev, tv.train.eval_batch_size)["acc"],
        "pgd_acc": {str(r["eps"]): r["robust_acc"] for r in audit},
        "broken": sum(r[f"broken_{k}"] for r in audit for k in radii),
        "certify_seconds_per_sample": cert_seconds / max(n, 1),
        "audit": audit, "attention": attention, "local_global_radius": None}
    if name in radii:
        record.update(
            certified_acc={str(k): a for k, a in certify.certified_accuracy(
                correct, radii[name], p.cert_eps).items()},
            certified_acc_attacked={str(r["eps"]): r[f"certified_{name}"] for r in audit},
            median_radius=float(radii[name].median()))
    if "global" in radii:
        record["certified_acc_global"] = {str(k): a for k, a in certify.certified_accuracy(
            correct, radii["global"], p.cert_eps).items()}
        record["median_radius_global"] = float(radii["global"].median())
        record["local_global_radius"] = diagnostics.local_global_radius(
            {"local": record["median_radius"], "global": record["median_radius_global"]},
            "local", "global")
    record["seconds"] = time.perf_counter() - t0
    write_json(unit_file(p, unit), record)
    check_unit(record, str(unit_file(p, unit)))
    return record


def check_unit(record: Mapping[str, Any], where: str) -> None:
    """No broken certificate, certified accuracy at most PGD accuracy on the attacked points
    (every certificate of the unit: its own and, for a ViT, the global bound's)."""
    claims = {}
    if "certified_acc_attacked" in record:
        claims[record["unit"]] = (record["certified_acc_attacked"], record["pgd_acc"])
    if "certified_acc_global" in record:
        claims[f"{record['unit']} (global)"] = (
            {str(r["eps"]): r["certified_global"] for r in record["audit"]}, record["pgd_acc"])
    if not claims:  # the standard ViT: attacked, nothing certified
        return
    soundness.require_sound({record["unit"]: record["audit"]}, claims, see=where)


def read_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """The record :func:`_run_unit` wrote; ValueError when missing or stale."""
    return read_record(unit_file(p, unit), _key(p, ctx), f"the frontier unit {unit!r}",
                       unit_stage(p, unit))


@dataclass
class Result:
    """What the notebook shows."""

    table: pd.DataFrame
    scores: pd.Series
    selected: str | None  # the best setting whose attention attends (None: none does)
    selected_any: str  # the best setting, attention not counted
    grid_setting: str | None
    figure: Figure
    attention_figure: Figure
    targets: pd.DataFrame  # attention_targets
    sharpening: pd.DataFrame  # sharpening_frame
    metrics: dict[str, Any]

    def attention_table(self) -> pd.DataFrame:
        """Per dataset and setting: clean and certified accuracy at the selection eps (LoFAST(M)
        and the global bound), the uniform and identity gaps (points), entropy / log n, the
        logit cap and the median radius ratio."""
        e = self.metrics["select_eps"]
        cols = ["dataset", "setting", "clean", f"certified@{e:g}", f"global@{e:g}",
                "uniform_gap", "identity_gap", "entropy", "logit_cap", "local_global"]
        return self.table[cols].set_index(["dataset", "setting"]).round(3)


def _gather(p: Params, ctx: Context) -> Result:
    """Gather every unit's record: write ``results_dir``'s frontier.csv, frontier.png,
    attention.png and the metrics file. Reads records only (no device); the units' checks run
    again."""
    t0 = time.perf_counter()
    tv = ctx.section("train_vit")
    records = [read_unit(p, ctx, u) for u in units(p)]
    for rec in records:
        check_unit(rec, str(unit_file(p, rec["unit"])))
    table = frame(records, p.cert_eps)
    out = Path(p.results_dir)
    with atomic_path(out / "frontier.csv") as tmp:
        table.to_csv(tmp, index=False)
    selected, scores = select(table, p.select_eps, p.min_attention_gap)
    selected_any, _ = select(table, p.select_eps)
    targets = attention_targets(table, min_gap=max(1.0, p.min_attention_gap))
    figures = {"frontier.png": figs.plot_frontier(table, p.cert_eps, p.select_eps),
               "attention.png": figs.plot_attention(table, p.select_eps, p.min_attention_gap,
                                                    min(p.cert_eps))}
    for fname, fig in figures.items():
        with atomic_path(out / fname) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)  # shown once, by the notebook
    sharp = write_sharpening(p, tv, ctx.require_base().seed, out / "sharpening.csv")
    grid = grid_setting(tv)
    metrics = {
        "settings": p.settings, "datasets": p.datasets, "eps": p.cert_eps,
        "select_eps": p.select_eps, "min_attention_gap": p.min_attention_gap,
        "selected": selected, "selected_any": selected_any, "grid_setting": grid,
        "grid_is_selected": grid == selected, "scores": scores.round(4).to_dict(),
        "attending": attending(table, p.min_attention_gap).to_dict(),
        "rows": _records(table), "targets": _records(targets),
        "broken": int(table["broken"].sum()), "sharpening": sharpening_metrics(sharp),
        "stage_seconds": sum(r["seconds"] for r in records) + time.perf_counter() - t0}
    write_json(p.metrics, metrics)
    return Result(table, scores, selected, selected_any, grid, figures["frontier.png"],
                  figures["attention.png"], targets, sharp, metrics)


def _row_of(m: Mapping, dataset: str, setting: str | None) -> Mapping | None:
    return next((r for r in m.get("rows", []) if r["dataset"] == dataset
                 and r["setting"] == setting), None)


def _pct(v: float | None) -> float | None:
    return None if v is None else v / 100


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """The selection (with attention counted, and without), then per dataset the selected
    settings', the standard ViT's and the linear baseline's clean and certified accuracy at
    the selection eps (validation split) with the points each loses with uniform attention,
    the study's target per certified setting, broken certificates."""
    eps = m.get("select_eps")
    sel, sel_any = m.get("selected"), m.get("selected_any", m.get("selected"))
    none = ("none: no certified setting's attention matters on the grid's task (uniform-"
            "attention gap below the threshold)")
    grid = m.get("grid_setting")
    out = [row("selected", f"selected setting with attention counted: {sel or none}; its score "
               "(validation)", m.get("scores", {}).get(sel), "percent", brief=True),
           row("selected_any", f"selected setting {sel_any} (attention not counted): its "
               "score", m.get("scores", {}).get(sel_any), "percent", brief=True),
           row("grid_is_selected", f"the grid trains the selected setting ({grid})"
               if sel else f"the grid trains a selected setting (it trains {grid}, whose "
               "attention does not matter)", int(bool(m.get("grid_is_selected"))), "flag",
               brief=True)]
    shown = [sel, sel_any] + [s for s in m.get("settings", [])
                              if s.startswith(("linear-", "standard"))]
    for ds in m.get("datasets", []):
        for setting in dict.fromkeys(s for s in shown if s is not None):
            r = _row_of(m, ds, setting)
            if r is None:
                continue
            out.append(row(f"{ds}/{setting}/clean", f"{ds} {setting}: clean (validation)",
                           r["clean"] / 100, "fraction", brief=True))
            if r.get(f"certified@{eps:g}") is not None:
                out.append(row(f"{ds}/{setting}/certified", f"{ds} {setting}: certified at "
                               f"eps {eps:g} (validation)", _pct(r[f"certified@{eps:g}"]),
                               "fraction", brief=True))
            if r.get("uniform_gap") is not None:
                out.append(row(f"{ds}/{setting}/uniform_gap", f"{ds} {setting}: points lost "
                               "with uniform attention", r["uniform_gap"], "value", brief=True))
    if "mnist" in m.get("datasets", []) and MNIST_EPS in m.get("eps", []):
        for setting in dict.fromkeys(s for s in (sel, sel_any) if s is not None):
            r = _row_of(m, "mnist", setting) or {}
            acc = _pct(r.get(f"certified@{MNIST_EPS:g}"))
            if acc is not None:
                out.append(row(f"mnist/{setting}/certified@{MNIST_EPS:g}", f"mnist {setting}: "
                               f"certified at eps {MNIST_EPS:g} (validation)", acc, "fraction",
                               *mnist_anchor("mnist", MNIST_EPS)))
    for t in m.get("targets", []):
        out.append(row(f"{t['dataset']}/{t['setting']}/target_met",
                       f"{t['dataset']} {t['setting']}: attends (>= half the standard ViT's "
                       "gap) and LoFAST(M) radius >= 1.3x global (1) or not (0)",
                       int(bool(t["target_met"])), "count"))
    out.append(row("broken", "broken certificates", m.get("broken"), "count"))
    return out


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: on the first dataset, the selected setting's (attention counted; the
    best setting when none attends) clean and certified accuracy at the selection eps, the
    points it loses with uniform attention, LoFAST(M)'s median radius over the global bound's;
    broken certificates."""
    ds = (m.get("datasets") or [None])[0]
    sel = m.get("selected") or m.get("selected_any")
    r = _row_of(m, ds, sel) if ds else None
    eps = m.get("select_eps")
    if r is None:
        return numbers(eps=eps, broken=m.get("broken"))
    return numbers(clean=r["clean"] / 100, cert=_pct(r.get(f"certified@{eps:g}")), eps=eps,
                   broken=m.get("broken"), attn_uniform_gap=r.get("uniform_gap"),
                   local_global_radius=r.get("local_global"))
