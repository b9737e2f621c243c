"""Figures of the SST-2 text stage: certified accuracy vs eps per model (LoFAST Figure 5
analog), clean accuracy against the average certified radius, and the attention sweep."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["plot_accuracy_vs_radius", "plot_attention_tradeoff", "plot_certified_vs_eps"]


def _style() -> None:
    sns.set_theme(style="whitegrid", context="paper")


def plot_certified_vs_eps(curves: pd.DataFrame, title: str = "") -> Figure:
    """Certified accuracy vs l2 eps on the embeddings, one line per model and bound variant.

    ``curves``: rows (model, variant, eps, certified_acc) as
    :func:`attncert.text.evaluate.evaluate_model` returns them.
    """
    _style()
    data = curves.assign(label=curves["model"] + " (" + curves["variant"] + ")")
    fig, ax = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
    sns.lineplot(data, x="eps", y="certified_acc", hue="label", marker="o", ax=ax)
    ax.set(xlabel="eps (l2, embedding space)", ylabel="certified accuracy", ylim=(0, 1),
           title=title or "Certified accuracy vs eps")
    ax.legend(fontsize="small", title=None)
    return fig


def plot_accuracy_vs_radius(table: pd.DataFrame) -> Figure:
    """Test accuracy against the average certified radius, one point per model.

    ``table``: one row per model with columns model, family, test_acc, avg_radius.
    """
    _style()
    fig, ax = plt.subplots(figsize=(6, 4), constrained_layout=True)
    sns.scatterplot(table, x="avg_radius", y="test_acc", hue="family", s=60, ax=ax)
    for _, row in table.iterrows():
        ax.annotate(row["model"], (row["avg_radius"], row["test_acc"]), fontsize=7,
                    xytext=(3, 3), textcoords="offset points")
    ax.set(xlabel="average certified radius (embedding l2)", ylabel="test accuracy")
    return fig


def plot_attention_tradeoff(sweep: pd.DataFrame) -> Figure:
    """Test accuracy against the average certified radius as attention is made to matter: one
    point per model, both averaging rules (filled: 0 for misclassified sentences; hollow:
    correctly classified only), labelled with the attention's max-probability ratio to 1/n.

    ``sweep``: rows with columns model, test_acc, avg_radius, avg_radius_correct, attn_ratio
    (NaN for a model without attention, e.g. the depth-0 baseline).
    """
    _style()
    fig, ax = plt.subplots(figsize=(6.5, 4), constrained_layout=True)
    palette = sns.color_palette(n_colors=len(sweep))
    for color, (_, row) in zip(palette, sweep.iterrows(), strict=True):
        ax.scatter(row["avg_radius"], row["test_acc"], color=color, s=50, label=row["model"])
        ax.scatter(row["avg_radius_correct"], row["test_acc"], facecolors="none",
                   edgecolors=color, s=50)
        ratio = row["attn_ratio"]
        ax.annotate("no attention" if pd.isna(ratio) else f"max p = {ratio:.2f} / n",
                    (row["avg_radius"], row["test_acc"]), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    ax.set(xlabel="average certified radius (embedding l2; hollow: correct only)",
           ylabel="test accuracy", title="Attention made to matter: accuracy vs radius")
    ax.legend(fontsize="x-small", title=None)
    return fig
