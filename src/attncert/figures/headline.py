"""The summary's rows as a table and, where a paper gives the number, ours beside it drawn
as bars (every stage section of the figures report ends with them)."""

from __future__ import annotations

import textwrap
from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["headline_frame", "plot_headline"]

OURS = "ours"
#: characters per line of a bar's label and of a legend entry: a row's label names its run
#: and setting and a paper source names every difference of setting, both too long for a line
LABEL_WIDTH, SOURCE_WIDTH = 48, 80


def headline_frame(rows: Sequence[Mapping], brief_only: bool = False) -> pd.DataFrame:
    """summary.json rows as a table: quantity, ours, paper (accuracies in %), paper source."""
    keep = [r for r in rows if r["brief"] or not brief_only]

    def scaled(r, v):
        return None if v is None else (100 * v if r["unit"] == "fraction" else v)

    return pd.DataFrame({
        "run": [r.get("run") or "" for r in keep],
        "quantity": [r["label"] + (" (%)" if r["unit"] in ("fraction", "percent") else "")
                     for r in keep],
        "ours": [scaled(r, r["ours"]) for r in keep],
        "paper": [scaled(r, r["paper"]) for r in keep],
        "paper source": [r["source"] or "" for r in keep]})


def _wrap(text: str, width: int) -> str:
    return "\n".join(textwrap.wrap(text, width)) or text


def plot_headline(rows: Sequence[Mapping], title: str) -> Figure | None:
    """Ours beside the paper for every row where the paper gives a number (None if none): one
    bar pair per row, labels and sources wrapped and the legend under the axes, so that long
    labels never squeeze the axes away."""
    table = headline_frame([r for r in rows if r["paper"] is not None and r["ours"] is not None])
    if table.empty:
        return None
    sns.set_theme(style="whitegrid", context="paper")
    label = (table["run"] + " " + table["quantity"]).str.strip().map(
        lambda s: _wrap(s, LABEL_WIDTH))
    source = ("paper: " + table["paper source"]).map(lambda s: _wrap(s, SOURCE_WIDTH))
    long = pd.concat([pd.DataFrame({"quantity": label, "value": table["ours"], "source": OURS}),
                      pd.DataFrame({"quantity": label, "value": table["paper"],
                                    "source": source})])
    label_lines = sum(s.count("\n") + 1 for s in label.unique())
    legend_lines = sum(s.count("\n") + 1 for s in source.unique()) + 1
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.28 * max(label_lines, 2 * len(label))
                                    + 0.16 * legend_lines), constrained_layout=True)
    sns.barplot(long, y="quantity", x="value", hue="source", ax=ax)
    ax.set(xlabel="", ylabel="", title=title)
    ax.tick_params(axis="y", labelsize="small")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.08), fontsize="x-small", title=None,
              frameon=False)
    return fig
