"""Figures of the ViT grid: training curves, spectral norms, certified accuracy vs eps."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["plot_training", "plot_spectral_norms", "plot_certified", "plot_radius_cost"]


def _style() -> None:
    sns.set_theme(style="whitegrid", context="paper")


def plot_training(rows: Sequence[Mapping]) -> Figure:
    """Loss and accuracy per epoch (train and test) from the training metrics rows."""
    _style()
    df = pd.DataFrame(rows)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2), constrained_layout=True)
    for ax, what in zip(axes, ("loss", "acc"), strict=True):
        long = df.melt(id_vars="epoch", value_vars=[f"train_{what}", f"test_{what}"],
                       var_name="split", value_name=what)
        sns.lineplot(long, x="epoch", y=what, hue="split", marker="o", ax=ax)
        ax.set(title={"loss": "training loss (margin term included)", "acc": "accuracy"}[what])
    return fig


def spectral_frame(row: Mapping) -> pd.DataFrame:
    """(module, sigma) from the ``sigma/<module>`` entries of one training metrics row."""
    return pd.DataFrame([{"module": k.split("/", 1)[1], "sigma": v}
                         for k, v in row.items() if k.startswith("sigma/")])


def plot_spectral_norms(row: Mapping, gammas: Mapping[str, float]) -> Figure:
    """Spectral norm of every linear map of the final model, with the constraint levels."""
    _style()
    df = spectral_frame(row)
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.22 * len(df))), constrained_layout=True)
    sns.barplot(df, y="module", x="sigma", color="C0", ax=ax)
    for i, (name, g) in enumerate(gammas.items()):
        ax.axvline(g, color=f"C{i + 1}", ls="--", label=f"{name} = {g}")
    ax.set(xlabel=r"$\|W\|_2$ (exact SVD)", ylabel="")
    if gammas:
        ax.legend(loc="lower right")
    return fig


def plot_certified(long: pd.DataFrame, title: str,
                   reference: Mapping[str, float] | None = None) -> Figure:
    """Certified accuracy vs eps for every variant (pairwise solid, logit dashed) and the PGD
    accuracy (an upper bound on any certified accuracy); ``reference`` draws a paper's
    (eps, certified %) claim as a labelled point."""
    _style()
    fig, ax = plt.subplots(figsize=(7, 4), constrained_layout=True)
    df = long.assign(accuracy=100 * long["accuracy"])
    sns.lineplot(df, x="eps", y="accuracy", hue="variant", style="test", markers=True, ax=ax,
                 dashes={"pairwise": "", "logit": (4, 2), "attack": (1, 1)})
    if reference is not None:
        ax.scatter([reference["eps"]], [reference["certified"]], marker="*", s=160, color="k",
                   zorder=5, label=reference["label"])
        ax.legend(fontsize=7)
    sns.move_legend(ax, "upper left", bbox_to_anchor=(1.01, 1), fontsize=7, frameon=False)
    ax.set(xscale="log", xlabel=r"$\epsilon$ ($\ell_2$, pixel space)",
           ylabel="accuracy (%)", title=title, ylim=(-2, 102))
    return fig


def plot_radius_cost(summary: Mapping) -> Figure:
    """Seconds per sample of each certificate, as a multiple of one forward pass."""
    _style()
    df = pd.DataFrame([{"certificate": k, "x forward": v}
                       for k, v in summary["cost_vs_forward"].items()])
    fig, ax = plt.subplots(figsize=(6, 0.35 * len(df) + 1), constrained_layout=True)
    sns.barplot(df, y="certificate", x="x forward", color="C2", ax=ax)
    ax.set(xscale="log", xlabel="cost per sample / forward pass per sample", ylabel="")
    return fig
