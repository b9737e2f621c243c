"""Figures of the CROWN study: certified accuracy and cost, LoFAST vs CROWN vs the combination."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["plot_table1", "plot_table2"]


def plot_table1(table1: pd.DataFrame, dataset: str) -> Figure:
    """LoFAST Table 1 on one dataset as bars: certified accuracy per eps (all depths), and
    seconds per sample (log scale) per method and depth."""
    sns.set_theme(style="whitegrid", context="paper")
    acc = table1.melt(id_vars=["depth", "method"],
                      value_vars=[c for c in table1 if c.startswith("acc_")],
                      var_name="eps", value_name="certified accuracy (%)")
    acc["eps"] = acc["eps"].str.removeprefix("acc_")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), constrained_layout=True)
    sns.barplot(acc, x="eps", y="certified accuracy (%)", hue="method", ax=axes[0],
                errorbar=None)
    axes[0].set(title="certified accuracy (all depths; '-' = failed, shown as 0)")
    sns.barplot(table1, x="depth", y="seconds_per_sample", hue="method", ax=axes[1],
                errorbar=None)
    axes[1].set(yscale="log", ylabel="seconds per sample", title="cost per sample")
    fig.suptitle(f"LoFAST Table 1 on {dataset}")
    return fig


def plot_table2(table2: pd.DataFrame, dataset: str) -> Figure:
    """LoFAST Table 2 on one dataset: CROWN alone vs LoFAST + CROWN, accuracy and seconds per
    sample by eps."""
    sns.set_theme(style="whitegrid", context="paper")
    rows = []
    for _, r in table2.iterrows():
        label = f"L{r['depth']} eps {r['eps']}"
        rows += [{"point": label, "method": "CROWN alone", "acc": r["crown_acc"],
                  "seconds": r["crown_seconds"]},
                 {"point": label, "method": "LoFAST + CROWN", "acc": r["combined_acc"],
                  "seconds": r["combined_seconds"]}]
    df = pd.DataFrame(rows)
    df["acc"] = pd.to_numeric(df["acc"])  # None: CROWN alone not measured on every point
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), constrained_layout=True)
    sns.barplot(df, x="point", y="acc", hue="method", ax=axes[0], errorbar=None)
    axes[0].set(ylabel="certified accuracy (%)", xlabel="")
    sns.barplot(df, x="point", y="seconds", hue="method", ax=axes[1], errorbar=None)
    axes[1].set(ylabel="seconds per sample", xlabel="")
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle(f"LoFAST Table 2 on {dataset}")
    return fig
