"""Figures of the LoFAST tightness study, drawn from the frames of attncert.tightness."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns
from attncert.tightness import paper_table3_frame

__all__ = ["plot_figure1", "plot_table3", "plot_figure3", "plot_figure4"]


def _style() -> None:
    sns.set_theme(style="whitegrid", context="paper")


def plot_figure1(df_single: pd.DataFrame, df_multi: pd.DataFrame) -> Figure:
    """LoFAST Figure 1: single-head Delta_{2,1} and Delta_{2,2} bounds, and the multi-head
    bounds, against PGD over eps."""
    _style()
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6), constrained_layout=True)
    for ax, quantity, title in zip(
        axes[:2],
        ("Delta21", "Delta22"),
        (r"$\Delta_{2,1} = \|P(X') - P(X)\|_F$", r"$\Delta_{2,2} = \|X' A\|$"),
        strict=True,
    ):
        sub = df_single[df_single.quantity == quantity]
        sns.lineplot(sub, x="eps", y="value", hue="method", style="method", markers=True, ax=ax)
        ax.set(title=f"single head: {title}", xlabel=r"$\epsilon$", ylabel="value")
    sns.lineplot(
        df_multi, x="eps", y="value", hue="method", style="method", markers=True, ax=axes[2]
    )
    axes[2].set(
        title=r"multi-head: $\|F(X') - F(X)\|_F$",
        xlabel=r"$\epsilon$",
        ylabel="value",
        yscale="log",
    )
    return fig


def plot_table3(df: pd.DataFrame) -> Figure:
    """LoFAST Table 3 as a plot: bound vs eps (log y), ours solid, the paper's numbers dashed."""
    _style()
    both = pd.concat([df.assign(source="ours"), paper_table3_frame()], ignore_index=True)
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    sns.lineplot(
        both,
        x="eps",
        y="value",
        hue="method",
        style="source",
        markers=True,
        ax=ax,
        style_order=["ours", "paper"],
    )
    ax.set(
        yscale="log",
        xlabel=r"$\epsilon$",
        ylabel=r"bound on $\|F(X')-F(X)\|_F$",
        title="Table 3: bounds vs PGD",
    )
    ratios = both[both.method.isin(["LoFAST(M)", "LoFAST(xi)"])]
    sns.lineplot(
        ratios,
        x="eps",
        y="ratio_to_pgd",
        hue="method",
        style="source",
        markers=True,
        ax=ax_r,
        style_order=["ours", "paper"],
    )
    ax_r.axhline(1.05, color="grey", ls=":", lw=1)
    ax_r.set(xlabel=r"$\epsilon$", ylabel="bound / PGD", title="tightness (1 = exact)")
    return fig


def plot_figure3(df: pd.DataFrame) -> Figure:
    """LoFAST Figure 3: bound / PGD under random perturbations of each weight and of X."""
    _style()
    fig, ax = plt.subplots(figsize=(6, 3.8), constrained_layout=True)
    sns.lineplot(
        df,
        x="size",
        y="ratio",
        hue="target",
        style="target",
        markers=True,
        errorbar=("pi", 100),
        ax=ax,
    )
    ax.axhline(1.0, color="grey", ls=":", lw=1)
    ax.set(
        xlabel="perturbation size (Frobenius)",
        ylabel="LoFAST(M) / PGD",
        title=f"tightness under perturbation, eps = {df.eps.iloc[0]:g}",
    )
    return fig


def plot_figure4(df: pd.DataFrame) -> Figure:
    """LoFAST Figure 4: bounds and their ratio to PGD against the input norm."""
    _style()
    fig, (ax, ax_r) = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    sns.lineplot(df, x="input_norm", y="value", hue="method", style="method", markers=True, ax=ax)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel=r"mean $\|X\|$",
        ylabel="value",
        title=f"bounds vs input norm, eps = {df.eps.iloc[0]:g}",
    )
    bounds = df[df.method != "PGD"]
    sns.lineplot(
        bounds,
        x="input_norm",
        y="ratio_to_pgd",
        hue="method",
        style="method",
        markers=True,
        ax=ax_r,
    )
    ax_r.set(
        xscale="log",
        yscale="log",
        xlabel=r"mean $\|X\|$",
        ylabel="bound / PGD",
        title="tightness vs input norm",
    )
    return fig
