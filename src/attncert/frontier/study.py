"""The frontier study's settings and tables (:mod:`attncert.stages.frontier` runs it).

A setting is ``<kind>-<value>[_<axis><value>...]`` (or ``standard[_p<patch>]``): a training
margin (``lmt``, ``lofast``), the linear baseline (``linear``) or the standard ViT of the same
shape, with axes that override one field of the ViT ``train_vit`` gives (the patch size, the
norms of the attention maps, the attention radius) or of its recipe. The tables read the units'
records: the frontier table, which settings attend (lose clean accuracy when every attention
matrix is made uniform), the selection rule and the study's targets.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from attncert.frontier.params import Params as FrontierParams
from attncert.frontier.settings import (
    Setting,
)
from attncert.grid.params import TrainVitParams
from attncert.grid.params import model_config as grid_model_config
from attncert.models import ViTConfig
from attncert.pipeline.runs import GridPoint
from attncert.training.train import TrainConfig


def unit_table(record: Mapping[str, Any]) -> pd.DataFrame:
    """One unit's record as one row per measure (certified with LoFAST(M) and with the global
    bound where the unit certifies, PGD; %) and a column per eps, with its clean accuracy (%)
    and broken certificates beside."""
    cols = {"certified": record.get("certified_acc"),
            "certified (global)": record.get("certified_acc_global"), "PGD": record["pgd_acc"]}
    acc = pd.DataFrame({k: v for k, v in cols.items() if v is not None})
    return acc.mul(100).round(1).rename_axis("eps").T.assign(
        clean=round(100 * record["clean_acc"], 1), broken=record["broken"])


def unit_attention(record: Mapping[str, Any]) -> pd.DataFrame | None:
    """One unit's attention diagnostics (None for the linear baseline): per layer the rows'
    entropy / log n, then clean accuracy (%) with the trained, uniform and identity attention,
    the gaps (points), the largest |logit| and its cap, LoFAST(M) / global median radius."""
    a = record.get("attention")
    if a is None:
        return None
    return pd.DataFrame([{
        **{f"entropy {name}": e for name, e in zip(a["layers"], a["entropy"], strict=True)},
        "clean %": 100 * a["acc"], "uniform %": 100 * a["acc_uniform"],
        "identity %": 100 * a["acc_identity"], "uniform gap": a["uniform_gap"],
        "identity gap": a["identity_gap"], "max |logit|": a["logit_max"],
        "logit cap": a["logit_cap"], "LoFAST(M) / global radius": record["local_global_radius"]}],
        index=[record["unit"]]).T.round(4)


def frame(records: Sequence[Mapping[str, Any]], eps: Sequence[float]) -> pd.DataFrame:
    """One row per (dataset, setting): clean, certified (LoFAST(M) and the global bound) and
    PGD accuracy at every eps (%), the attention diagnostics (uniform / identity gaps in
    points, entropy / log n, the logit cap) and LoFAST(M)'s median radius over the global
    bound's; NaN where a setting has no such number (the standard ViT is not certified, the
    linear baseline has no attention)."""
    nan = float("nan")
    rows = []
    for r in records:
        out = {"dataset": r["dataset"], "setting": r["setting"], "kind": r["kind"],
               "task": "routed" if (r.get("axes") or {}).get("route") else "plain",
               "patch": r.get("patch"), "depth": r.get("depth"), "clean": 100 * r["clean_acc"]}
        for e in eps:
            out[f"certified@{e:g}"] = 100 * r.get("certified_acc", {}).get(str(float(e)), nan)
        for e in eps:
            out[f"global@{e:g}"] = 100 * r.get("certified_acc_global", {}).get(str(float(e)),
                                                                              nan)
        for e in eps:
            out[f"pgd@{e:g}"] = 100 * r["pgd_acc"][str(float(e))]
        a = r.get("attention") or {}
        out.update(uniform_gap=a.get("uniform_gap", nan), identity_gap=a.get("identity_gap", nan),
                   entropy=a.get("entropy_mean", nan),
                   logit_cap=nan if a.get("logit_cap") is None else a["logit_cap"],
                   local_global=nan if r.get("local_global_radius") is None
                   else r["local_global_radius"],
                   broken=r["broken"], n_val=r["n_val"], n_attacked=r["n_attacked"],
                   train_seconds=r["train_seconds"])
        rows.append(out)
    return pd.DataFrame(rows)


def attending(table: pd.DataFrame, min_gap: float) -> pd.Series:
    """Per certified ViT setting: True when it loses at least ``min_gap`` points of clean
    accuracy with uniform attention on every dataset (its attention changes predictions)."""
    vit = table[table["kind"].isin(["lmt", "lofast"]) & (table["task"] == "plain")]
    return (vit["uniform_gap"] >= min_gap).groupby(vit["setting"], sort=False).all()


def select(table: pd.DataFrame, select_eps: float, min_gap: float | None = None
           ) -> tuple[str | None, pd.Series]:
    """The certified ViT setting with the highest mean over datasets of (clean + certified at
    ``select_eps``) / 2, and every certified ViT setting's score (ties: the first in
    ``settings``). With ``min_gap``, only the settings that attend (:func:`attending`) can be
    selected; None when none does. Settings on the routing task are not candidates (another
    task than the grid's): None when every setting routes."""
    vit = table[table["kind"].isin(["lmt", "lofast"]) & (table["task"] == "plain")]
    score = ((vit["clean"] + vit[f"certified@{select_eps:g}"]) / 2).groupby(
        vit["setting"], sort=False).mean()
    if min_gap is not None:
        ok = attending(table, min_gap)
        eligible = score[ok.reindex(score.index, fill_value=False)]
        return (str(eligible.idxmax()) if len(eligible) else None), score
    return (str(score.idxmax()) if len(score) else None), score


def attention_targets(table: pd.DataFrame, share: float = 0.5, min_gap: float = 1.0,
                      ratio: float = 1.3) -> pd.DataFrame:
    """Per certified ViT row: the standard ViT's uniform-attention gap on the same dataset,
    task, patch and depth (NaN when the frontier trains none), the row's share of it, and
    whether the row meets the study's target: a gap of at least ``share`` of the standard
    ViT's and ``min_gap`` points, LoFAST(M)'s median radius at least ``ratio`` x the global
    bound's, 0 broken. A table without a depth column (records before it) matches on the rest."""
    def shape(r: pd.Series) -> tuple:
        depth = r.get("depth")
        return r["dataset"], r["patch"], None if pd.isna(depth) else int(depth), r["task"]

    std = table[table["kind"] == "standard"]
    ref = {shape(r): r["uniform_gap"] for _, r in std.iterrows()}
    rows = []
    for _, r in table[table["kind"].isin(["lmt", "lofast"])].iterrows():
        g = ref.get(shape(r), float("nan"))
        met = bool(pd.notna(g) and r["uniform_gap"] >= max(min_gap, share * g)
                   and r["local_global"] >= ratio and r["broken"] == 0)
        rows.append({"dataset": r["dataset"], "setting": r["setting"], "task": r["task"],
                     "patch": r["patch"], "depth": r.get("depth"),
                     "uniform_gap": r["uniform_gap"], "standard_gap": g,
                     "share_of_standard": r["uniform_gap"] / g if pd.notna(g) and g > 0
                     else float("nan"),
                     "local_global": r["local_global"], "broken": r["broken"],
                     "target_met": met})
    return pd.DataFrame(rows)


def _records(table: pd.DataFrame) -> list[dict[str, Any]]:
    """The table's rows for JSON: NaN (no such number) as null."""
    return table.astype(object).where(table.notna(), None).to_dict("records")


def split(data: Mapping[str, Any], holdout: int, max_train: int = 0) -> tuple[dict, dict]:
    """(training part, validation part) of the training split: the last ``holdout`` images
    are the validation split; the training part is the first ``max_train`` of the others
    (0: all of them)."""
    n = len(data["train"]["y"])
    if holdout >= n:
        raise ValueError(f"frontier.holdout: {holdout} >= the {n} training images")
    cut = n - holdout
    end = cut if max_train == 0 else min(cut, max_train)
    return ({k: data["train"][k][:end] for k in ("x", "y")},
            {k: data["train"][k][cut:] for k in ("x", "y")})


def task_parts(data: Mapping[str, Any], train: Mapping[str, Any], val: Mapping[str, Any],
               setting: Setting, seed: int) -> tuple[dict, dict, dict]:
    """(data, training part, validation part) of the setting's task: as they are, or on the
    routing task, each part composed from its own images (no image of the validation part
    in a training composite) and ``data``'s normalisation that of the composed training part."""
    if not setting.routed:
        return dict(data), dict(train), dict(val)
    from attncert.data import routing

    train, val = routing.compose(train, seed), routing.compose(val, seed + 1)
    return dict(data) | routing.routed_stats(train), train, val


def grid_setting(tv: TrainVitParams) -> str | None:
    """The setting ``train_vit`` trains the grid with (None for a margin not in :data:`KINDS`)."""
    if tv.train.margin == "lmt":
        return f"lmt-{tv.train.lmt_offset:g}"
    if tv.train.margin == "lofast":
        return f"lofast-{tv.train.lofast_eps:g}"
    return None


def train_config(p: FrontierParams, tv: TrainVitParams, setting: Setting,
                 seed: int) -> TrainConfig:
    """The setting's training: ``train_vit``'s with its margin and its recipe axes (a ViT);
    ``train_vit``'s without a margin at ``standard.lr`` (the standard ViT); the linear
    baseline's own recipe (``linear``: the radius margin at the setting's offset)."""
    if setting.kind == "linear":
        return dataclasses.replace(p.linear.config(seed), lmt_offset=setting.value)
    cfg = tv.train.config(seed)
    if setting.kind == "standard":
        return dataclasses.replace(cfg, margin="none", lr=p.standard.lr, **setting.train_axes())
    cfg = dataclasses.replace(cfg, **setting.train_axes())
    if setting.kind == "lmt":
        return dataclasses.replace(cfg, margin="lmt", lmt_offset=setting.value)
    return dataclasses.replace(cfg, margin="lofast", lofast_eps=setting.value)


def model_config(p: FrontierParams, tv: TrainVitParams, setting: Setting, dataset: str,
                 data: Mapping[str, Any]) -> ViTConfig:
    """The setting's ViT: ``train_vit``'s model of the frontier's grid shape with the
    setting's model axes; the standard ViT is that shape (patch axis included) with the
    standard ViT's parts (LayerNorm, GELU MLP, free attention, pre-norm blocks)."""
    point = GridPoint(p.results_dir, dataset, p.depth, p.heads, p.gamma_vo)
    cfg = grid_model_config(tv, point, data)
    if setting.kind == "standard":
        return dataclasses.replace(cfg, kind="standard", block="prenorm",
                                   **setting.model_axes())
    return dataclasses.replace(cfg, **setting.model_axes())


def sharpening_frame(p: FrontierParams, tv: TrainVitParams, seed: int) -> pd.DataFrame:
    """Why the local bound closes the attention: one seeded random residual attention layer of
    the frontier's shape (``train_vit``'s width, ``heads``, ``gamma_vo``; tokens projected to
    ``train_vit.radius_attn``) per ``sharpen_tokens``, its logit cap set to each of
    ``sharpen_caps``; per cap the rows' entropy, the largest logit, and the sensitivity at
    ``sharpen_eps`` by PGD (the audit's steps and restarts), LoFAST(M), LoFAST(xi) and the
    global bound (:func:`attncert.tightness.studies.attention_sharpening`), float64 on the
    host."""
    from attncert.tightness.layer import random_attention_layer
    from attncert.tightness.studies import attention_sharpening

    dim = tv.vit.arch(depth=p.depth, heads=p.heads)["dim"]
    frames = []
    for n in p.sharpen_tokens:
        w, x = random_attention_layer(n, dim, p.heads, seed, (1.0, p.gamma_vo),
                                      p.sharpen_samples, token_norm=tv.radius_attn)
        frames.append(attention_sharpening(w, x, p.sharpen_caps, p.sharpen_eps,
                                           p.audit.steps, p.audit.restarts, seed)
                      .assign(tokens=n))
    return pd.concat(frames, ignore_index=True)


def write_sharpening(p: FrontierParams, tv: TrainVitParams, seed: int, path: Path
                     ) -> pd.DataFrame:
    """:func:`sharpening_frame`, written to ``path`` (CSV, atomically) and returned."""
    from attncert.pipeline.io import atomic_path

    sharp = sharpening_frame(p, tv, seed)
    with atomic_path(path) as tmp:
        sharp.to_csv(tmp, index=False)
    return sharp


def sharpening_table(sharp: pd.DataFrame) -> pd.DataFrame:
    """Per token count and cap: entropy / log n, the largest logit, PGD's sensitivity and each
    bound's ratio to it."""
    ratio = sharp.pivot_table(index=["tokens", "cap"], columns="method",
                              values="ratio_to_pgd").drop(columns="PGD")
    ratio.columns = [f"{c} / PGD" for c in ratio.columns]
    pgd = sharp[sharp.method == "PGD"].set_index(["tokens", "cap"])
    return pgd[["entropy", "logit_max"]].assign(PGD=pgd["value"]).join(ratio)


def sharpening_metrics(sharp: pd.DataFrame) -> dict[str, Any]:
    """{tokens: {cap: {entropy, logit_max, pgd, lofast_M_over_pgd, global_over_pgd}}}."""
    t = sharpening_table(sharp)
    return {f"n{n}": {f"{cap:g}": {"entropy": float(r["entropy"]),
                                    "logit_max": float(r["logit_max"]), "pgd": float(r["PGD"]),
                                    "lofast_M_over_pgd": float(r["LoFAST(M) / PGD"]),
                                    "global_over_pgd": float(r["global / PGD"])}
                      for (_, cap), r in t.loc[[n]].iterrows()}
            for n in t.index.get_level_values(0).unique()}
