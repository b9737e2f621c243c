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
first ``n_attack`` (the soundness audit: a broken certificate fails the unit). The test split
is never read.

:func:`select` picks the setting a scale should train its grid with, on validation numbers
only: the ViT setting with the highest mean over ``datasets`` of (clean accuracy + certified
accuracy at ``select_eps``) / 2. The report says whether ``train_vit`` trains with it.

Each (dataset, setting) is an independent unit (:func:`units`, one DVC stage each:
``frontier_unit@<dataset>-<setting>``); :func:`run` gathers their records.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.figure import Figure

from attncert import certify, soundness
from attncert.certvit.baseline import PixelLinear
from attncert.certvit.certificate import certified_radius
from attncert.data import as_float, load_processed
from attncert.figures import frontier as figs
from attncert.models import build_vit
from attncert.pipeline import runs
from attncert.pipeline.context import Context
from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.params import (
    fail,
    image_datasets,
    nonempty,
    param,
    positive,
    unique,
)
from attncert.pipeline.records import read_record, unit_key
from attncert.pipeline.runs import GridPoint
from attncert.report.headline import numbers, row
from attncert.stages import train_vit
from attncert.training.train import TrainConfig, evaluate, train_resumable

#: setting kinds: ``<kind>-<value>``
KINDS = {"lmt": "LMT logit offset", "lofast": "LoFAST certified training at radius",
         "linear": "linear baseline, radius margin at offset"}
#: the certificate every ViT setting is measured with
CERTIFICATE = ("lofast_M", "pairwise")


def parse_setting(setting: str) -> tuple[str, float]:
    """``"lofast-0.5"`` -> ("lofast", 0.5); ValueError for anything else."""
    kind, _, value = setting.partition("-")
    try:
        v = float(value)
    except ValueError:
        v = -1.0
    if kind not in KINDS or not v > 0:
        raise ValueError(f"{setting!r}: a setting is <kind>-<value>, kind one of "
                         f"{', '.join(KINDS)} and value > 0 (e.g. lofast-0.5)")
    return kind, v


def settings_ok(key: str, v: list) -> None:
    for s in v:
        try:
            parse_setting(s)
        except ValueError as exc:
            fail(key, str(exc))
    if not any(parse_setting(s)[0] != "linear" for s in v):
        fail(key, "needs at least one ViT setting (lmt-* or lofast-*)")


#: this module's params.yaml section, and the other sections it reads
SECTION = "frontier"
SECTIONS = {"train_vit": train_vit.Params}


@dataclass(frozen=True)
class Params:
    """params.yaml ``frontier``."""

    datasets: list[str] = param(image_datasets, unique, nonempty)
    settings: list[str] = param(settings_ok, unique, nonempty,
                                doc="<kind>-<value>: lmt-<offset>, lofast-<radius>, "
                                    "linear-<offset>")
    depth: int = param(positive, doc="the grid shape every ViT setting trains")
    heads: int = param(positive)
    gamma_vo: float = param(positive)
    holdout: int = param(positive, doc="the last n training images: the validation split")
    n_val: int = param(positive, doc="first n validation images certified")
    n_attack: int = param(positive, doc="first n of them attacked (PGD accuracy, audit)")
    cert_eps: list[float] = param(positive, unique, nonempty)
    select_eps: float = param(positive, doc="the eps the selection rule reads (in cert_eps)")
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    cert_batch_size: int = param(positive)
    max_radius: float = param(positive, doc="the radius bisection's upper end (pixel l2): a "
                                            "radius is reported as at most this")
    linear_epochs: int = param(positive)
    linear_lr: float = param(positive)
    linear_logit_scale: float = param(positive)
    results_dir: str = param(doc="units/<unit>.json, ckpt/<unit>/, frontier.csv, frontier.png")
    metrics: str = param()

    def __post_init__(self) -> None:
        if self.select_eps not in self.cert_eps:
            fail("frontier.select_eps", f"{self.select_eps} is not one of cert_eps "
                                        f"{self.cert_eps}")
        if self.n_attack > self.n_val:
            fail("frontier.n_attack", f"{self.n_attack} > n_val {self.n_val}")
        if self.max_radius <= max(self.cert_eps):
            fail("frontier.max_radius", f"{self.max_radius} must exceed the largest cert_eps "
                                        f"{max(self.cert_eps)}")
        if self.n_val > self.holdout:
            fail("frontier.n_val", f"{self.n_val} > holdout {self.holdout}")


def units(p: Params) -> list[str]:
    """The stage's units, one DVC stage each (``frontier_unit@<dataset>-<setting>``)."""
    return [f"{d}-{s}" for d in p.datasets for s in p.settings]


def unit_file(p: Params, unit: str) -> Path:
    return Path(p.results_dir) / "units" / f"{unit}.json"


def _key(p: Params, ctx: Context) -> dict[str, Any]:
    return (unit_key("frontier", p, ctx.require_base())
            | unit_key("train_vit", ctx.section("train_vit"), ctx.require_base()))


def split(data: Mapping[str, Any], holdout: int) -> tuple[dict, dict]:
    """(training part, validation part) of the training split: the last ``holdout`` images
    are the validation split."""
    n = len(data["train"]["y"])
    if holdout >= n:
        raise ValueError(f"frontier.holdout: {holdout} >= the {n} training images")
    cut = n - holdout
    return ({k: data["train"][k][:cut] for k in ("x", "y")},
            {k: data["train"][k][cut:] for k in ("x", "y")})


def grid_setting(tv: train_vit.Params) -> str | None:
    """The setting ``train_vit`` trains the grid with (None for a margin not in :data:`KINDS`)."""
    if tv.train.margin == "lmt":
        return f"lmt-{tv.train.lmt_offset:g}"
    if tv.train.margin == "lofast":
        return f"lofast-{tv.train.lofast_eps:g}"
    return None


def train_config(p: Params, tv: train_vit.Params, kind: str, value: float,
                 seed: int) -> TrainConfig:
    """The setting's training: ``train_vit``'s with its margin (a ViT); the linear baseline's
    own schedule with the radius margin."""
    if kind == "linear":
        t = tv.train
        return TrainConfig(epochs=p.linear_epochs, batch_size=t.batch_size, lr=p.linear_lr,
                           warmup_steps=t.warmup_steps, margin="radius", lmt_offset=value,
                           logit_scale=p.linear_logit_scale, eval_batch_size=t.eval_batch_size,
                           seed=seed)
    cfg = tv.train.config(seed)
    if kind == "lmt":
        return dataclasses.replace(cfg, margin="lmt", lmt_offset=value)
    return dataclasses.replace(cfg, margin="lofast", lofast_eps=value)


def run(p: Params, ctx: Context) -> dict[str, Any] | Result:
    """``ctx.item``: one unit of :func:`units` (:func:`_run_unit`: its record); ``None``: the
    gathering stage (:func:`_gather`: the :class:`Result`). The ViTs train with
    ``ctx.sections["train_vit"]``'s recipe."""
    return _gather(p, ctx) if ctx.item is None else _run_unit(p, ctx, ctx.item)


def _run_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """One unit (``<dataset>-<setting>``): train (resumable, ``results_dir/ckpt/<unit>``),
    certify and attack on the validation points; write the record (before the soundness
    check, so a failure can be inspected) and return it."""
    base, tv = ctx.require_base(), ctx.section("train_vit")
    dev, precision = ctx.device, ctx.precision
    if unit not in units(p):
        raise ValueError(f"frontier unit {unit!r}: not one of {units(p)}")
    dataset = next(d for d in p.datasets if unit.startswith(f"{d}-")
                   and unit[len(d) + 1:] in p.settings)
    setting = unit[len(dataset) + 1:]
    kind, value = parse_setting(setting)
    t0 = time.perf_counter()
    data = load_processed(dataset, ctx.processed_dir)
    train, val = split(data, p.holdout)
    cfg = train_config(p, tv, kind, value, base.seed)
    torch.manual_seed(base.seed)
    if kind == "linear":
        model = PixelLinear(train["x"][0].numel(), len(data["classes"]), seed=base.seed)
    else:
        point = GridPoint(p.results_dir, dataset, p.depth, p.heads, p.gamma_vo)
        model = build_vit(train_vit.model_config(tv, point, data))
    fp = runs.fingerprint(model.config, cfg, dataset,
                          f"{data['source']}; training split minus its last {p.holdout}",
                          precision)
    curves, status = train_resumable(model, train, val, cfg, Path(p.results_dir) / "ckpt" / unit,
                                     dev, fingerprint=fp, precision=precision,
                                     eval_name="validation")
    n = min(p.n_val, len(val["y"]))
    x = as_float(val["x"][:n]).to(dev, torch.float64)
    y = val["y"][:n].to(dev)
    model = model.eval().double()
    t1 = time.perf_counter()
    if kind == "linear":
        with torch.no_grad():
            logits = model(x)
            radius = certified_radius(logits, model.head_weight(), 1.0).cpu()
            correct = (logits.argmax(1) == y).cpu()
    else:
        variant, test = CERTIFICATE
        table = certify.certify_table(model, x, y, [variant], [test], 1.0, p.max_radius,
                                      p.cert_batch_size)
        radius = torch.tensor(table[f"radius_{variant}_{test}"].to_numpy())
        correct = torch.tensor(table["correct"].to_numpy()).bool()
    cert_seconds = time.perf_counter() - t1
    m = min(p.n_attack, n)
    torch.manual_seed(base.seed)
    audit, _ = certify.audit(model, x[:m], y[:m], {setting: radius[:m]}, p.cert_eps,
                             p.attack_steps, p.attack_restarts, base.seed, p.cert_batch_size,
                             progress=True)
    record = {
        "unit": unit, "key": _key(p, ctx), "device": str(dev), "dataset": dataset,
        "setting": setting, "kind": kind, "value": value, "n_val": n, "n_attacked": m,
        "checkpoint": status, "epochs": len(curves),
        "train_seconds": sum(r["seconds"] for r in curves),
        "clean_acc": float(correct.double().mean()),
        "val_acc_full": evaluate(model.float(), val, dev, tv.train.eval_batch_size)["acc"],
        "certified_acc": {str(k): a for k, a in
                          certify.certified_accuracy(correct, radius, p.cert_eps).items()},
        "certified_acc_attacked": {str(r["eps"]): r[f"certified_{setting}"] for r in audit},
        "pgd_acc": {str(r["eps"]): r["robust_acc"] for r in audit},
        "broken": sum(r[f"broken_{setting}"] for r in audit),
        "median_radius": float(radius.median()),
        "certify_seconds_per_sample": cert_seconds / max(n, 1),
        "audit": audit, "seconds": time.perf_counter() - t0}
    write_json(unit_file(p, unit), record)
    check_unit(record, str(unit_file(p, unit)))
    return record


def check_unit(record: Mapping[str, Any], where: str) -> None:
    """No broken certificate, certified accuracy at most PGD accuracy on the attacked points."""
    soundness.require_sound({record["unit"]: record["audit"]},
                            {record["unit"]: (record["certified_acc_attacked"],
                                              record["pgd_acc"])}, see=where)


def unit_table(record: Mapping[str, Any]) -> pd.DataFrame:
    """One unit's record as one row per measure (certified, PGD; %) and a column per eps, with
    its clean accuracy (%) and broken certificates beside."""
    acc = pd.DataFrame({"certified": record["certified_acc"], "PGD": record["pgd_acc"]})
    return acc.mul(100).round(1).rename_axis("eps").T.assign(
        clean=round(100 * record["clean_acc"], 1), broken=record["broken"])


def read_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """The record :func:`_run_unit` wrote; ValueError when missing or stale."""
    return read_record(unit_file(p, unit), _key(p, ctx), f"the frontier unit {unit!r}",
                       f"frontier_unit@{unit}")


def frame(records: Sequence[Mapping[str, Any]], eps: Sequence[float]) -> pd.DataFrame:
    """One row per (dataset, setting): clean, certified and PGD accuracy at every eps (%)."""
    rows = []
    for r in records:
        out = {"dataset": r["dataset"], "setting": r["setting"], "kind": r["kind"],
               "clean": 100 * r["clean_acc"]}
        for e in eps:
            out[f"certified@{e:g}"] = 100 * r["certified_acc"][str(float(e))]
        for e in eps:
            out[f"pgd@{e:g}"] = 100 * r["pgd_acc"][str(float(e))]
        out.update(broken=r["broken"], n_val=r["n_val"], n_attacked=r["n_attacked"],
                   train_seconds=r["train_seconds"])
        rows.append(out)
    return pd.DataFrame(rows)


def select(table: pd.DataFrame, select_eps: float) -> tuple[str, pd.Series]:
    """The ViT setting with the highest mean over datasets of (clean + certified at
    ``select_eps``) / 2, and every ViT setting's score (ties: the first in ``settings``)."""
    vit = table[table["kind"] != "linear"]
    score = ((vit["clean"] + vit[f"certified@{select_eps:g}"]) / 2).groupby(
        vit["setting"], sort=False).mean()
    return str(score.idxmax()), score


@dataclass
class Result:
    """What the notebook shows."""

    table: pd.DataFrame
    scores: pd.Series
    selected: str
    grid_setting: str | None
    figure: Figure
    metrics: dict[str, Any]


def _gather(p: Params, ctx: Context) -> Result:
    """Gather every unit's record: write ``results_dir``'s frontier.csv and frontier.png and the
    metrics file. Reads records only (no device); the units' checks run again."""
    t0 = time.perf_counter()
    tv = ctx.section("train_vit")
    records = [read_unit(p, ctx, u) for u in units(p)]
    for rec in records:
        check_unit(rec, str(unit_file(p, rec["unit"])))
    table = frame(records, p.cert_eps)
    out = Path(p.results_dir)
    with atomic_path(out / "frontier.csv") as tmp:
        table.to_csv(tmp, index=False)
    selected, scores = select(table, p.select_eps)
    fig = figs.plot_frontier(table, p.cert_eps, p.select_eps)
    with atomic_path(out / "frontier.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)  # shown once, by the notebook
    grid = grid_setting(tv)
    metrics = {
        "settings": p.settings, "datasets": p.datasets, "eps": p.cert_eps,
        "select_eps": p.select_eps, "selected": selected, "grid_setting": grid,
        "grid_is_selected": grid == selected, "scores": scores.round(4).to_dict(),
        "rows": table.to_dict("records"), "broken": int(table["broken"].sum()),
        "stage_seconds": sum(r["seconds"] for r in records) + time.perf_counter() - t0}
    write_json(p.metrics, metrics)
    return Result(table, scores, selected, grid, fig, metrics)


def _row_of(m: Mapping, dataset: str, setting: str) -> Mapping | None:
    return next((r for r in m.get("rows", []) if r["dataset"] == dataset
                 and r["setting"] == setting), None)


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Per dataset: the selected setting's and the linear baseline's clean and certified
    accuracy at the selection eps (validation split), then broken certificates."""
    eps = m.get("select_eps")
    sel = m.get("selected")
    out = [row("selected", f"selected setting {sel}: its score (validation)",
               m.get("scores", {}).get(sel), "percent", brief=True),
           row("grid_is_selected", f"the grid trains with {sel} (1) or with "
               f"{m.get('grid_setting')} (0)", int(bool(m.get("grid_is_selected"))), "count",
               brief=True)]
    for ds in m.get("datasets", []):
        for setting in [m.get("selected")] + [s for s in m.get("settings", [])
                                             if s.startswith("linear-")]:
            r = _row_of(m, ds, setting)
            if r is None:
                continue
            out.append(row(f"{ds}/{setting}/clean", f"{ds} {setting}: clean (validation)",
                           r["clean"] / 100, "fraction", brief=True))
            out.append(row(f"{ds}/{setting}/certified", f"{ds} {setting}: certified at eps "
                           f"{eps:g} (validation)", r[f"certified@{eps:g}"] / 100, "fraction",
                           brief=True))
    out.append(row("broken", "broken certificates", m.get("broken"), "count"))
    return out


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: the selected setting's clean and certified accuracy at the
    selection eps on the first dataset, broken certificates."""
    ds = (m.get("datasets") or [None])[0]
    r = _row_of(m, ds, m.get("selected")) if ds else None
    eps = m.get("select_eps")
    return numbers(clean=None if r is None else r["clean"] / 100,
                   cert=None if r is None else r[f"certified@{eps:g}"] / 100,
                   eps=eps, broken=m.get("broken"))
