"""The frontier stage's figure: certified against clean accuracy per training setting."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["plot_attention", "plot_frontier"]


def plot_frontier(table: pd.DataFrame, eps: Sequence[float], select_eps: float) -> Figure:
    """One column per dataset. Top: certified accuracy against eps for every setting (solid)
    and its PGD accuracy (dotted, the same colour; an upper bound on what any certificate can
    reach), the linear baseline in black. Bottom: certified accuracy at ``select_eps`` against
    clean accuracy, one labelled point per setting (the frontier)."""
    sns.set_theme(style="whitegrid", context="paper")
    table = table[table["kind"] != "standard"]  # not certified: the attention figure has it
    datasets = list(dict.fromkeys(table["dataset"]))
    settings = list(dict.fromkeys(table["setting"]))
    palette = dict(zip([s for s in settings if not s.startswith("linear-")],
                       sns.color_palette("tab10"), strict=False))
    palette.update({s: "black" for s in settings if s.startswith("linear-")})
    fig, axes = plt.subplots(2, len(datasets), figsize=(5 * len(datasets), 7.5),
                             squeeze=False, constrained_layout=True)
    for col, ds in enumerate(datasets):
        top, bottom = axes[0, col], axes[1, col]
        part = table[table["dataset"] == ds]
        for _, r in part.iterrows():
            c = palette[r["setting"]]
            top.plot(eps, [r[f"certified@{e:g}"] for e in eps], marker="o", color=c,
                     label=f"{r['setting']} certified")
            top.plot(eps, [r[f"pgd@{e:g}"] for e in eps], ls=":", marker=".", color=c,
                     label=f"{r['setting']} PGD")
            bottom.scatter(r["clean"], r[f"certified@{select_eps:g}"], color=c, s=40,
                           marker="s" if r["kind"] == "linear" else "o")
            bottom.annotate(r["setting"], (r["clean"], r[f"certified@{select_eps:g}"]),
                            textcoords="offset points", xytext=(4, 3), fontsize=7)
        top.set(xscale="log", ylim=(-2, 102), title=f"{ds}: validation split",
                xlabel=r"$\epsilon$ ($\ell_2$, pixel space)", ylabel="accuracy (%)")
        top.set_xticks(list(eps), [f"{e:g}" for e in eps])
        top.minorticks_off()
        bottom.set(xlabel="clean accuracy (%)",
                   ylabel=f"certified accuracy at eps {select_eps:g} (%)")
        if col == len(datasets) - 1:
            top.legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return fig


def plot_attention(table: pd.DataFrame, select_eps: float, min_gap: float,
                   low_eps: float | None = None) -> Figure:
    """One panel per dataset: certified accuracy at ``select_eps`` (LoFAST(M), filled; the
    global bound on the same model, hollow) against the points of clean accuracy lost when
    every attention matrix is made uniform. Settings below ``min_gap`` (dead attention: the
    model is a token-wise MLP) in grey; the standard ViT of each task shape as a dotted
    vertical line at its gap (how much attention can matter on the task); the linear baseline
    as a horizontal line. With ``low_eps`` (a smaller eps the table has), a second row of
    panels at it: where models whose attention matters still certify."""
    sns.set_theme(style="whitegrid", context="paper")
    datasets = list(dict.fromkeys(table["dataset"]))
    levels = [select_eps] + ([low_eps] if low_eps is not None and low_eps != select_eps
                             and f"certified@{low_eps:g}" in table else [])
    fig, axes = plt.subplots(len(levels), len(datasets),
                             figsize=(5.5 * len(datasets), 4.2 * len(levels)),
                             squeeze=False, constrained_layout=True)
    for row, eps in zip(axes, levels, strict=True):
        for ax, ds in zip(row, datasets, strict=True):
            _attention_panel(ax, table[table["dataset"] == ds], ds, eps, min_gap)
    return fig


def _attention_panel(ax, part: pd.DataFrame, ds: str, eps: float, min_gap: float) -> None:
    col = f"certified@{eps:g}"
    for i, (_, r) in enumerate(part.iterrows()):
        if r["kind"] == "linear":
            ax.axhline(r[col], color="black", lw=1, label=f"{r['setting']} (linear)")
        elif r["kind"] == "standard":
            ax.axvline(r["uniform_gap"], color="tab:purple", ls=":", lw=1.2,
                       label=f"{r['setting']}: its gap")
        else:
            c = "tab:blue" if r["uniform_gap"] >= min_gap else "grey"
            ax.scatter(r["uniform_gap"], r[col], color=c, s=40, zorder=3)
            ax.scatter(r["uniform_gap"], r[f"global@{eps:g}"], facecolors="none",
                       edgecolors=c, s=40, zorder=3)
            ax.annotate(r["setting"], (r["uniform_gap"], r[col]), textcoords="offset points",
                        xytext=(4, 3 + 9 * (i % 3)), fontsize=7)  # staggered: near points
    ax.axvspan(-100, min_gap, color="grey", alpha=0.12, lw=0,
               label=f"dead attention (gap < {min_gap:g} points)")
    if (~part["kind"].isin(["linear", "standard"])).any():  # the two markers of a certified model
        ax.scatter([], [], color="dimgrey", s=40, label="LoFAST(M) certified")
        ax.scatter([], [], facecolors="none", edgecolors="dimgrey", s=40,
                   label="global bound certified (same model)")
    gaps = part["uniform_gap"].dropna()
    ax.set(xlim=(min(-1.0, gaps.min() - 1) if len(gaps) else -1,
                 max(5.0, gaps.max() * 1.1 + 1) if len(gaps) else 5),
           ylim=(-2, 102), title=f"{ds}: validation split, eps {eps:g}",
           xlabel="points of clean accuracy lost with uniform attention",
           ylabel=f"certified accuracy at eps {eps:g} (%)")
    ax.legend(fontsize=6, loc="best", frameon=False)
