"""The grid's key figures (LoFAST Figure 2's analog and certified against clean accuracy), drawn
to be read at the index page's width: variants whose numbers coincide share one labelled mark
(a bound that certifies exactly what another does is a finding, never a hidden line), a few eps
panels in one row, axes on the data.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["merge_coinciding", "plot_certified_grid", "tradeoff_frame", "plot_tradeoff",
           "spread", "MAX_WIDTH_INCHES", "PANEL_INCHES"]

#: the widest a key figure is drawn (inches; about 1100 pixels at the export's 120 dpi, the
#: index page's column), so that it shows at its own size there
MAX_WIDTH_INCHES = 9.2
#: a panel's height (inches)
PANEL_INCHES = 2.4


def merge_coinciding(df: pd.DataFrame, by: Sequence[str], over: str, value: str,
                     column: str = "variant") -> pd.DataFrame:
    """``df`` with the ``column`` values that give the same ``value`` at every ``over`` within
    each ``by`` group joined into one ("global = lofast_M"), one row each: what coincides is
    drawn once, under a label that says so."""
    out = []
    for _, group in df.groupby(list(by), sort=False, dropna=False):
        series: dict[tuple, list[Hashable]] = {}
        for name, rows in group.groupby(column, sort=False):
            key = tuple(rows.sort_values(over)[[over, value]].itertuples(index=False))
            series.setdefault(key, []).append(name)
        for names in series.values():
            rows = group[group[column] == names[0]]
            out.append(rows.assign(**{column: " = ".join(map(str, names))}))
    return pd.concat(out, ignore_index=True) if out else df.iloc[0:0]


def spread(values: Sequence[float], k: int = 3) -> list[float]:
    """At most ``k`` of the sorted distinct ``values``, spread from the smallest to the largest."""
    distinct = sorted(set(values))
    if len(distinct) <= k:
        return distinct
    return [distinct[int(round(i))] for i in np.linspace(0, len(distinct) - 1, k)]


def plot_certified_grid(long: pd.DataFrame, col_wrap: int = 3) -> Figure:
    """Certified accuracy vs eps, one panel per grid point: every bound variant (variants that
    certify the same at every eps share a line, labelled with all their names), the pairwise
    test solid and the logit test dashed, and the PGD accuracy (an upper bound). No paper
    number stands beside: LoFAST Figure 2 prints none."""
    df = merge_coinciding(long.assign(accuracy=100 * long["accuracy"]), ("run", "test"), "eps",
                          "accuracy")
    runs = df["run"].nunique()
    cols = min(col_wrap, runs)
    g = sns.relplot(df, x="eps", y="accuracy", hue="variant", style="test", col="run",
                    col_wrap=cols, kind="line", markers=True, palette="tab10",
                    height=PANEL_INCHES, aspect=_aspect(cols), facet_kws={"sharey": True})
    g.set_axis_labels("eps (pixel-space l2)", "accuracy (%)")
    g.set_titles("{col_name}")
    _legend_below(g)
    g.figure.suptitle("Certified accuracy vs eps per grid point (LoFAST Figure 2 analog)",
                      y=1.03)
    return g.figure


def _aspect(cols: int) -> float:
    """Panel aspect that fills the index's width with ``cols`` panels (at most 1.6)."""
    return min(1.6, (MAX_WIDTH_INCHES - 0.8) / (cols * PANEL_INCHES))


def _legend_below(g: sns.FacetGrid) -> None:
    """The legend under the panels, in columns: it takes no width from them."""
    sns.move_legend(g, "upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, fontsize="small",
                    title_fontsize="small", frameon=False)
    g.figure.set_size_inches(min(MAX_WIDTH_INCHES, g.figure.get_figwidth()),
                             g.figure.get_figheight())
    g.tight_layout()


def tradeoff_frame(points: Mapping[str, Mapping], test: str = "pairwise") -> pd.DataFrame:
    """(run, dataset, variant, eps, clean, certified) for every grid point at every eps."""
    rows = [{"run": run, "dataset": m.get("dataset"), "variant": key.rsplit("_", 1)[0],
             "eps": float(e), "clean": m["clean_acc"], "certified": a}
            for run, m in points.items() for key, accs in m["certified_acc"].items()
            if key.rsplit("_", 1)[1] == test for e, a in accs.items()]
    return pd.DataFrame(rows, columns=["run", "dataset", "variant", "eps", "clean", "certified"])


def plot_tradeoff(df: pd.DataFrame, panels: int = 3) -> Figure:
    """Certified vs clean accuracy across the grid at ``panels`` eps spread over the grid's
    (a mark is a grid point and a variant; variants that certify the same share a mark; the
    diagonal is the ceiling: certified <= clean), the clean axis on the grid's range."""
    d = df.assign(clean=100 * df["clean"], certified=100 * df["certified"])
    d = d[d["eps"].isin(spread(d["eps"].tolist(), panels))]
    d = merge_coinciding(d.assign(point=d["run"]), ("run", "eps"), "point", "certified")
    cols = max(1, d["eps"].nunique())
    g = sns.relplot(d, x="clean", y="certified", hue="variant", style="dataset", col="eps",
                    palette="tab10", height=PANEL_INCHES, aspect=min(1.3, _aspect(cols)), s=60)
    low = max(0.0, float(d["clean"].min()) - 10) if len(d) else 0.0
    for ax in g.axes.flat:
        ax.plot([0, 100], [0, 100], color="grey", lw=0.8, ls=":")
        ax.set(xlim=(low, 101), ylim=(-3, 101))
    g.set_axis_labels("clean accuracy (%)", "certified accuracy (%)")
    g.set_titles("eps = {col_name}")
    _legend_below(g)
    g.figure.suptitle("Certified vs clean accuracy across the grid (pairwise test)", y=1.04)
    return g.figure
