"""LoFAST's Tables 1-2 from the crown stage's rows (:mod:`attncert.stages.crown`): one model's
rows, a dataset's part gathered from its units' records (figures saved as PNGs), and the
paper's tables beside ours.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import matplotlib.pyplot as plt
import pandas as pd
import torch
from matplotlib.figure import Figure

from attncert.crown.study import NOT_RUN, PROVEN, crown_certified
from attncert.figures import crown as figs
from attncert.pipeline.io import atomic_path
from attncert.report import paper

if TYPE_CHECKING:
    from attncert.crown.params import Params


@dataclass
class DatasetResult:
    """One dataset's part: the number of points, the trained models, one row per CROWN
    (point, eps), the PGD audit, Tables 1-2 (with their figures, saved as PNGs in
    ``results_dir``), the CROWN / LoFAST seconds ratio per depth and its metrics entry."""

    n: int
    trained: pd.DataFrame
    crown: pd.DataFrame
    audit: pd.DataFrame
    table1: pd.DataFrame
    table2: pd.DataFrame
    ratio: dict[str, float]
    figures: dict[str, Figure]
    metrics: dict[str, Any]


def gather_dataset(p: Params, dataset: str, records: Sequence[Mapping[str, Any]], out: Path,
                   frames: dict[str, list]) -> DatasetResult:
    """One dataset's part of :func:`attncert.stages.crown.run` from its units' records (in
    ``depths`` order); its rows are appended to ``frames`` (by CSV name) and every CSV is
    rewritten."""
    n = records[0]["n"]
    lofast_df = pd.DataFrame([r for rec in records for r in rec["lofast"]])
    crown_df = pd.DataFrame([r for rec in records for r in rec["crown"]])
    frames["lofast.csv"].append(lofast_df.assign(dataset=dataset))
    frames["crown.csv"].append(crown_df.assign(dataset=dataset))
    for name, dfs in frames.items():
        with atomic_path(out / name) as tmp:
            pd.concat(dfs).to_csv(tmp, index=False)
    table1 = pd.DataFrame([r for rec in records for r in rec["table1"]])
    table2 = pd.DataFrame([r for rec in records for r in rec["table2"]])
    audit = pd.DataFrame([r for rec in records for r in rec["audit"]])
    broken = int(audit[[c for c in audit if c.startswith("broken_")]].to_numpy().sum())

    figures = {"table1": figs.plot_table1(table1, dataset),
               "table2": figs.plot_table2(table2, dataset)}
    for name, fig in figures.items():
        with atomic_path(out / f"{name}_{dataset}.png") as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)  # shown once, by the notebook

    ratio = {}
    for d in p.depths:
        secs = table1[table1["depth"] == d].set_index("method")["seconds_per_sample"]
        ratio[str(d)] = float(secs.drop("LoFAST").iloc[0] / secs["LoFAST"])
    trained = [rec["trained"] for rec in records]
    metrics = {
        "n": n, "crown_over_lofast_seconds": ratio, "broken": broken,
        "table1": table1.to_dict("records"), "table2": table2.to_dict("records"),
        "crown_status": {f"L{d}": status_counts(crown_df[crown_df["depth"] == d])
                         for d in p.depths},
        "trained": trained, "seconds": sum(rec["seconds"] for rec in records),
        "attention": {f"L{rec['trained']['depth']}": rec["attention"] for rec in records
                      if rec.get("attention")}}
    return DatasetResult(n, pd.DataFrame(trained), crown_df, audit, table1, table2, ratio,
                         figures, metrics)


def attention_table(parts: Mapping[str, DatasetResult]) -> pd.DataFrame:
    """Per dataset and depth, on the whole test split: the attention rows' entropy / log n,
    clean accuracy (%) with the trained, uniform and identity attention, the points lost each
    way, the largest |logit| and the constraints' cap on it."""
    rows = [{"dataset": name, "depth": depth, "entropy / log n": a["entropy_mean"],
             "clean %": 100 * a["acc"], "uniform %": 100 * a["acc_uniform"],
             "identity %": 100 * a["acc_identity"], "uniform gap": a["uniform_gap"],
             "identity gap": a["identity_gap"], "max |logit|": a["logit_max"],
             "logit cap": a["logit_cap"]}
            for name, r in parts.items() for depth, a in r.metrics.get("attention", {}).items()]
    return pd.DataFrame(rows).set_index(["dataset", "depth"]).round(4) if rows else (
        pd.DataFrame())


# ------------------------------------------------------------------ Tables 1-2
def tables(lofast: pd.DataFrame, crown: pd.DataFrame, eps_grid: Sequence[float],
           depth: int, method: str, alone: int | None = None,
           prior: pd.DataFrame | None = None) -> tuple[list[dict], list[dict]]:
    """Rows of Table 1 (LoFAST vs CROWN) and Table 2 (CROWN alone vs LoFAST + CROWN) for one
    model. Accuracies in %; a CROWN entry whose pairs all failed is None (for any reason, time
    limit included, where LoFAST's "-" marks overflow failures only).

    CROWN alone (its accuracy and seconds per bound) is measured on its own sample, the first
    ``alone`` points (all of them by default), where it ran whatever LoFAST certified; each row
    says how many (``crown_n``). Its accuracy is None when some of those points were left to
    LoFAST or to the budget (then not measured). CROWN's seconds are per (point, eps) bound that
    ran on that sample (misclassified points and the larger eps of a point not certified cost
    nothing and are not counted; with an empty sample, over the bounds that ran where LoFAST did
    not certify); the combined seconds are per test point: LoFAST everywhere, CROWN where
    LoFAST did not certify.

    ``prior``: the rows of the method that ran first in a cascade (CROWN's, before
    alpha-CROWN: ``crown.alpha_after_crown``); ``crown``'s rows are then the cascade's: a pair
    costs both methods' seconds, and a pair the first certified (status
    :data:`attncert.crown.study.PROVEN`) counts as a bound with its seconds."""
    n = len(lofast)
    k = n if alone is None else min(alone, n)
    lo_s = float(lofast["seconds"].mean())
    done = ("ok",)
    if prior is not None:
        first = prior[~prior["status"].isin(NOT_RUN)].groupby(["index", "eps"])["seconds"].sum()
        pairs = pd.MultiIndex.from_frame(crown[["index", "eps"]])
        crown = crown.assign(seconds=crown["seconds"].to_numpy()
                             + first.reindex(pairs).fillna(0.0).to_numpy())
        done = ("ok", PROVEN)
    ran = crown[~crown["status"].isin(NOT_RUN) | crown["status"].isin(done)]
    own, own_ran = crown[crown["index"] < k], ran[ran["index"] < k]

    def alone_acc(e: float, failed: bool = False) -> float | None:
        """CROWN's own certified accuracy at e on its sample: None when not measured there,
        and with ``failed`` when no bound at e succeeded."""
        at = own[own["eps"] == e]
        if k == 0 or at["status"].isin(("lofast", "budget")).any() or (
                failed and not own_ran[own_ran["eps"] == e]["status"].isin(done).any()):
            return None
        return 100 * float(crown_certified(own, k, e).double().mean())

    def own_seconds(e: float | None = None) -> float:
        """Mean seconds per bound on CROWN's own sample (at e, or over every eps); without
        one (``alone`` 0), over the points it bounded where LoFAST did not certify."""
        rows = own_ran if k else ran
        rows = rows if e is None else rows[rows["eps"] == e]
        return float(rows["seconds"].mean()) if len(rows) else float("nan")

    t1 = [{"depth": depth, "method": "LoFAST", "seconds_per_sample": lo_s, "n": n,
           **{f"acc_{e}": 100 * float(lofast[f"certified_{e}"].mean()) for e in eps_grid}},
          {"depth": depth, "method": method, "seconds_per_sample": own_seconds(), "n": k,
           **{f"acc_{e}": alone_acc(e, True) for e in eps_grid}}]
    t2 = []
    for e in eps_grid:
        lo = torch.tensor(lofast[f"certified_{e}"].to_numpy())
        cr = crown_certified(crown, n, e)
        at = crown[crown["eps"] == e].sort_values("index")
        sec = torch.tensor(at["seconds"].to_numpy(), dtype=torch.float64)
        t2.append({"depth": depth, "eps": e, "method": method,
                   "crown_acc": alone_acc(e), "crown_n": k,
                   "crown_seconds": own_seconds(e),
                   "combined_acc": 100 * float((lo | cr).double().mean()),
                   "combined_seconds": lo_s + float(sec[~lo].sum()) / n,
                   "lofast_acc": 100 * float(lo.double().mean())})
    return t1, t2


def status_counts(crown: pd.DataFrame) -> dict[str, int]:
    """How many (point, eps) pairs ended in each status."""
    return {str(k): int(v) for k, v in crown["status"].value_counts().items()}


def table1_with_paper(table1: pd.DataFrame, dataset: str) -> pd.DataFrame:
    """Our Table 1 beside LoFAST's (CIFAR-10), indexed by (depth, method)."""
    t = paper.LOFAST_TABLE1
    ours = table1.assign(method=table1["method"] + f" (ours, {dataset})")
    theirs = pd.DataFrame([{"depth": d, "method": f"{name} (paper, CIFAR-10)",
                            "seconds_per_sample": t[f"{m}_seconds"][d],
                            **{f"acc_{e}": a
                               for e, a in zip(paper.LOFAST_TABLE_EPS, accs, strict=True)}}
                           for m, name in (("lofast", "LoFAST"), ("crown", "alpha,beta-CROWN"))
                           for d, accs in t[m].items()])
    return pd.concat([ours, theirs]).sort_values(["depth", "method"]).set_index(
        ["depth", "method"])


def paper_table2() -> pd.DataFrame:
    """LoFAST's Table 2: accuracy and seconds per (dataset, method) and eps."""
    df = pd.DataFrame([{"dataset": ds, "method": m, "eps": e, "acc": a, "seconds": s}
                       for ds, per in paper.LOFAST_TABLE2.items() for m, vals in per.items()
                       for e, (a, s) in zip(paper.LOFAST_TABLE_EPS[:2], vals, strict=True)])
    return df.pivot_table(index=["dataset", "method"], columns="eps", values=["acc", "seconds"])


def audit_summary(parts: Mapping[str, Any]) -> tuple[pd.DataFrame, str]:
    """Every dataset's audit rows in one frame (dataset, depth, eps, attacked, PGD accuracy,
    broken per method) and one line (Markdown) counting the broken certificates in them."""
    audit = pd.concat([r.audit.assign(dataset=k) for k, r in parts.items()])
    broken = [c for c in audit if c.startswith("broken_")]
    n = sum(r.metrics["broken"] for r in parts.values())
    cells = audit[["dataset", "depth", "eps"]].drop_duplicates()
    methods = ", ".join(c.removeprefix("broken_") for c in broken)
    return (audit[["dataset", "depth", "eps", "attacked", "robust_acc", *broken]],
            f"**{n} broken certificates** over {len(cells)} (dataset, depth, eps) cells and "
            f"{len(broken)} certified methods ({methods}).")


def _stacked(parts: Mapping[str, Any], name: str) -> pd.DataFrame:
    """Frame ``name`` of every dataset's result, with its dataset as a column."""
    return pd.concat([getattr(r, name).assign(dataset=k) for k, r in parts.items()])


def trained_table(parts: Mapping[str, Any]) -> pd.DataFrame:
    """Every dataset's trained ViTs, one row per dataset and depth."""
    return _stacked(parts, "trained").set_index(["dataset", "depth"]).round(2)


def crown_status_table(parts: Mapping[str, Any]) -> pd.DataFrame:
    """CROWN's (point, eps) bounds: the count of each status per dataset, depth and method."""
    return _stacked(parts, "crown").groupby(
        ["dataset", "depth", "method", "status"]).size().unstack(fill_value=0)


def table2_all(parts: Mapping[str, Any]) -> pd.DataFrame:
    """LoFAST Table 2's rows of every dataset (dataset, depth, eps, method)."""
    return _stacked(parts, "table2").set_index(["dataset", "depth", "eps", "method"]).round(3)


def unit_status_counts(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """One unit's CROWN (point, eps) rows: pairs per method and status."""
    return pd.DataFrame(rows).groupby(["method", "status"]).size().to_frame("pairs")
