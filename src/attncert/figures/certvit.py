"""Figures of the CertViT stage: the Lipschitz constant per component before and after
constraining, accuracy and bound through the steps, Douglas-Rachford per site."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import sns

__all__ = ["plot_certified_modes", "plot_dr_sites", "plot_lipschitz_components", "plot_steps"]


def _style() -> None:
    sns.set_theme(style="whitegrid", context="paper")


def plot_lipschitz_components(table: pd.DataFrame) -> Figure:
    """Lipschitz constant of every component, one bar per labelled bound (log scale).

    ``table``: :func:`attncert.certvit.lipschitz_table` (name, kind, factor, one column per
    label, then the product rows). Factors of the product are drawn solid; the pieces a
    factor is made of (an attention layer, a linear map inside a residual) are hatched, and the
    products (features, logits) are left out: they are in the step figure.
    """
    _style()
    labels = [c for c in table.columns if c not in ("name", "kind", "factor")]
    parts = table[table["kind"] != "product"]
    long = parts.melt(id_vars=["name", "kind", "factor"], value_vars=labels,
                      var_name="model", value_name="lipschitz")
    fig, ax = plt.subplots(figsize=(8, max(3.0, 0.28 * len(parts) * max(1, len(labels)) / 2)),
                           constrained_layout=True)
    sns.barplot(long, y="name", x="lipschitz", hue="model", ax=ax)
    factor = dict(zip(parts["name"], parts["factor"], strict=True))
    names = list(parts["name"])
    for container in ax.containers:
        for bar, name in zip(container, names, strict=False):
            if not factor[name]:
                bar.set_hatch("//")
                bar.set_alpha(0.6)
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set(xscale="log", xlabel="Lipschitz constant (l2; hatched: inside a factor)",
           ylabel="", title="Lipschitz bound per component")
    return fig


def plot_steps(steps: pd.DataFrame, reference: float | None = None) -> Figure:
    """Clean accuracy and the global Lipschitz bounds through the steps.

    ``steps``: :meth:`attncert.certvit.steps.StepLog.frame`. Right: the bound of pixels ->
    logits and of pixels -> features (the certificate's constant); a step without a bound
    (the pre-trained model: LayerNorm and dot-product attention have none) has no bars.
    ``reference``: a paper's Lipschitz constant, drawn as a dashed line.
    """
    _style()
    df = steps.assign(accuracy=100 * steps["clean_acc"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), constrained_layout=True)
    sns.barplot(df, x="step", y="accuracy", color="C0", ax=axes[0])
    axes[0].bar_label(axes[0].containers[0], fmt="%.1f", fontsize=7)
    axes[0].set(ylabel="clean accuracy (%)", xlabel="", ylim=(0, 105))
    long = df.melt(id_vars="step", value_vars=["lipschitz", "lipschitz_features"],
                   var_name="bound", value_name="value").dropna(subset=["value"])
    long["bound"] = long["bound"].map({"lipschitz": "pixels -> logits",
                                       "lipschitz_features": "pixels -> features"})
    sns.barplot(long.astype({"value": float}), x="step", y="value", hue="bound",
                order=list(df["step"]), palette=["C3", "C1"], ax=axes[1])
    if reference is not None:
        axes[1].axhline(reference, color="k", ls="--", lw=1,
                        label=f"CertViT's reported constant {reference}")
    axes[1].legend(fontsize=7)
    axes[1].set(yscale="log", ylabel="global Lipschitz bound", xlabel="")
    for ax in axes:
        ax.tick_params(axis="x", rotation=20)
    return fig


def plot_dr_sites(diagnostics: pd.DataFrame) -> Figure:
    """Douglas-Rachford per site: spectral norm before/after, and the fraction of zeros.

    ``diagnostics``: one row per site (``DRResult.diagnostics``: site, sigma_before,
    sigma_after, sparsity, deviation, eta).
    """
    _style()
    fig, axes = plt.subplots(1, 2, figsize=(10, max(2.8, 0.26 * len(diagnostics))),
                             constrained_layout=True, sharey=True)
    long = diagnostics.melt(id_vars="site", value_vars=["sigma_before", "sigma_after"],
                            var_name="weights", value_name="sigma")
    long["weights"] = long["weights"].map({"sigma_before": "before", "sigma_after": "after"})
    sns.barplot(long, y="site", x="sigma", hue="weights", ax=axes[0])
    axes[0].set(xlabel=r"$\|W\|_2$ (exact SVD)", ylabel="")
    sparsity = diagnostics.assign(zeros=100 * diagnostics["sparsity"])
    sns.barplot(sparsity, y="site", x="zeros", color="C2", ax=axes[1])
    axes[1].set(xlabel="zero entries (%)", ylabel="", xlim=(0, 100))
    return fig


def plot_certified_modes(certified: dict, pgd: dict, pgd_note: str = "") -> Figure:
    """Certified (solid) and L2 PGD (dashed) accuracy against eps, one colour per mode.

    ``certified``, ``pgd``: {mode: {eps: fraction}} (``attncert.certvit.certify``'s
    ``certified_acc`` and ``pgd_acc``). PGD accuracy is an upper bound on the robust accuracy,
    certified accuracy a lower bound: the gap is what the certificate leaves open.
    ``pgd_note`` follows the PGD legend entries (e.g. the points attacked, when fewer).
    """
    _style()
    fig, ax = plt.subplots(figsize=(6, 3.4), constrained_layout=True)
    for i, mode in enumerate(certified):
        eps = sorted(certified[mode])
        ax.plot(eps, [100 * certified[mode][e] for e in eps], "o-", color=f"C{i}",
                label=f"{mode}: certified")
        if mode in pgd:
            pe = sorted(pgd[mode])
            ax.plot(pe, [100 * pgd[mode][e] for e in pe], "s--", color=f"C{i}", alpha=0.7,
                    label=f"{mode}: L2 PGD{pgd_note}")
    ax.set(xscale="log", xlabel="eps (pixel-space l2)", ylabel="accuracy (%)", ylim=(0, 100),
           title="Certified and PGD accuracy of each mode's final model")
    ax.legend(fontsize=7)
    return fig
