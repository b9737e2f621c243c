"""Figures of the SpecFormer study: robust accuracy per attack, L2 PGD curves, the largest
singular value per layer (SpecFormer Figure 2a) and the cost of a training step (Table 3)."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["plot_l2_curves", "plot_max_sigma", "plot_robustness", "plot_step_ratios"]


def _style() -> None:
    sns.set_theme(style="whitegrid", context="paper")


def plot_robustness(rows: pd.DataFrame, dataset: str) -> Figure:
    """Accuracy (%) under every l_inf attack (and clean) per method, one panel per training
    (standard / adversarial); ``rows``: robust_accuracy rows with training, method, dataset."""
    _style()
    df = rows[(rows["dataset"] == dataset) & (rows["kind"] != "pgd_l2")]
    df = df.assign(accuracy=100 * df["accuracy"])
    trainings = list(dict.fromkeys(df["training"]))
    fig, axes = plt.subplots(1, len(trainings), figsize=(6 * len(trainings), 3.6),
                             constrained_layout=True, squeeze=False)
    for ax, training in zip(axes[0], trainings, strict=True):
        sns.barplot(df[df["training"] == training], x="attack", y="accuracy", hue="method",
                    ax=ax)
        ax.set(title=f"{dataset}, {training} training", xlabel="", ylabel="accuracy (%)",
               ylim=(0, 100))
        ax.legend(fontsize=7)
    return fig


def plot_l2_curves(rows: pd.DataFrame, dataset: str) -> Figure:
    """L2 PGD accuracy (%) vs eps (pixel space) per method and training (clean at eps = 0)."""
    _style()
    df = rows[(rows["dataset"] == dataset) & rows["kind"].isin(["clean", "pgd_l2"])]
    df = df.assign(accuracy=100 * df["accuracy"])
    fig, ax = plt.subplots(figsize=(6, 3.6), constrained_layout=True)
    sns.lineplot(df, x="eps", y="accuracy", hue="method", style="training", markers=True, ax=ax)
    ax.set(xlabel=r"$\epsilon$ ($\ell_2$, pixel space)", ylabel="accuracy (%)",
           title=f"{dataset}: L2 PGD", ylim=(-2, 102))
    return fig


def plot_max_sigma(frame: pd.DataFrame, title: str = "") -> Figure:
    """Largest singular value over the heads per layer, for W^Q, W^K, W^V (one panel each),
    per method (SpecFormer Figure 2a); ``frame``:
    :func:`attncert.specformer.methods.max_sigma_frame`."""
    _style()
    maps = ("q", "k", "v")
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.2), constrained_layout=True, sharey=True)
    for ax, m in zip(axes, maps, strict=True):
        sns.lineplot(frame[frame["map"] == m], x="depth", y="sigma", hue="method", marker="o",
                     ax=ax, legend=m == "v")
        ax.set(title=rf"$W^{{{m.upper()}}}$", xlabel="layer", ylabel=r"max$_h\ \sigma_{max}$")
        ax.xaxis.get_major_locator().set_params(integer=True)
    if title:
        fig.suptitle(title)
    return fig


def plot_step_ratios(ratios: pd.DataFrame, paper_ratio: float | None = None,
                     limit: float | None = None, order: Sequence[str] | None = None) -> Figure:
    """Training step time relative to vanilla per method (median, min-max whiskers), with
    SpecFormer's reported MSVP ratio and an acceptance limit as lines."""
    _style()
    df = ratios.reset_index(names="method")
    if order is not None:
        df = df.set_index("method").loc[list(order)].reset_index()
    fig, ax = plt.subplots(figsize=(6, 0.45 * len(df) + 1.2), constrained_layout=True)
    ax.barh(df["method"], df["ratio"], color="C0",
            xerr=[df["ratio"] - df["ratio_min"], df["ratio_max"] - df["ratio"]], capsize=3)
    ax.invert_yaxis()
    if paper_ratio is not None:
        ax.axvline(paper_ratio, color="C3", ls="--", label=f"SpecFormer's MSVP ({paper_ratio}x)")
    if limit is not None and limit != paper_ratio:
        ax.axvline(limit, color="k", ls=":", label=f"limit {limit}x")
    ax.axvline(1.0, color="grey", lw=0.8)
    ax.set(xlabel="seconds per training step / vanilla", ylabel="")
    if paper_ratio is not None or limit is not None:
        ax.legend(fontsize=7, loc="lower right")
    return fig
