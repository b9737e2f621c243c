"""Figures of the data report, drawn from the processed datasets."""

from __future__ import annotations

from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from attncert.figures import sns


def class_grid(obj: dict[str, Any], per_class: int, split: str = "train"):
    """A grid of the first ``per_class`` images of every class (rows = classes)."""
    x, y = obj[split]["x"], obj[split]["y"]
    classes = sorted(int(c) for c in y.unique())
    if len(classes) > 20:  # e.g. ImageNet samples: one row of all images
        idx_rows = [list(range(len(y)))]
        row_labels = [""]
    else:
        idx_rows = [(y == c).nonzero().flatten()[:per_class].tolist() for c in classes]
        row_labels = [_name(obj, c) for c in classes]
    cols = max(len(r) for r in idx_rows)
    fig, axes = plt.subplots(len(idx_rows), cols, figsize=(0.9 * cols + 1.2, 0.9 * len(idx_rows)),
                             squeeze=False)
    for r, idx in enumerate(idx_rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_visible(False)
            if c < len(idx):
                img = x[idx[c]].permute(1, 2, 0).squeeze(-1)
                ax.imshow(img.numpy(), cmap="gray" if img.ndim == 2 else None, vmin=0, vmax=255)
                if len(idx_rows) == 1:
                    ax.set_title(_name(obj, int(y[idx[c]]))[:12], fontsize=6)
        axes[r][0].set_ylabel(row_labels[r], rotation=0, ha="right", va="center", fontsize=7)
    fig.suptitle(f"{obj['name']} ({split})", fontsize=10)
    fig.tight_layout()
    return fig


def _name(obj: dict[str, Any], c: int) -> str:
    classes = obj.get("classes") or []
    return classes[c] if c < len(classes) else str(c)


def class_counts(objs: list[dict[str, Any]]) -> pd.DataFrame:
    """Long table: dataset, split, class, count."""
    rows = []
    for obj in objs:
        for split in ("train", "dev", "test"):
            if split not in obj:
                continue
            counts = torch.bincount(obj[split]["y"])
            for c, n in enumerate(counts.tolist()):
                rows.append({"dataset": obj["name"], "split": split, "class": _name(obj, c),
                             "count": n})
    return pd.DataFrame(rows)


def class_count_table(counts: pd.DataFrame) -> pd.DataFrame:
    """:func:`class_counts` as dataset x class rows, one column per split."""
    if counts.empty:
        return counts
    return counts.pivot_table(index=["dataset", "class"], columns="split", values="count")


def class_balance(counts: pd.DataFrame, max_classes: int = 20):
    """Bar chart of class frequencies per split, one panel per dataset.

    Datasets with more than ``max_classes`` classes (CIFAR-100, ImageNet) are left to the table.
    """
    n_classes = counts.groupby("dataset")["class"].transform("nunique")
    counts = counts[n_classes <= max_classes]
    frac = counts.assign(
        fraction=counts["count"] / counts.groupby(["dataset", "split"])["count"].transform("sum")
    )
    g = sns.catplot(data=frac, x="class", y="fraction", hue="split", col="dataset", col_wrap=2,
                    kind="bar", sharex=False, height=2.6, aspect=1.8)
    for ax in g.axes.flat:
        ax.tick_params(axis="x", labelrotation=60, labelsize=6)
    g.figure.subplots_adjust(hspace=0.9)
    g.figure.suptitle("class balance per split", y=1.02)
    return g.figure


def sentence_lengths(obj: dict[str, Any]) -> pd.DataFrame:
    """Whitespace-token counts of every example (tokenisation belongs to the text models); a
    sentence pair (QQP) counts both sentences."""
    rows = []
    for split in ("train", "dev", "test"):
        if split not in obj:
            continue
        part = obj[split]
        pairs = part.get("text_pair", [""] * len(part["text"]))
        rows += [{"split": split, "words": len(t.split()) + len(u.split()),
                  "label": obj["classes"][int(lab)]}
                 for t, u, lab in zip(part["text"], pairs, part["y"].tolist(), strict=True)]
    return pd.DataFrame(rows)


def length_histogram(lengths: pd.DataFrame, name: str = "sst2"):
    fig, ax = plt.subplots(figsize=(7, 3))
    sns.histplot(data=lengths, x="words", hue="split", stat="density", common_norm=False,
                 discrete=True, element="step", ax=ax)
    ax.set_title(f"{name} text length (words)")
    fig.tight_layout()
    return fig


def length_summary(lengths: pd.DataFrame) -> pd.DataFrame:
    """:func:`sentence_lengths` summarised per split (count, mean, quantiles)."""
    return lengths.groupby("split")["words"].describe()
