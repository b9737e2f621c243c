# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Data
#
# Fetches every dataset of the study (local mirror first, then the real download), loads it
# through torchvision's own dataset classes, subsets it as params.yaml says, and saves uint8
# tensors with per-channel mean/std (models normalise inside, so eps stays in pixel space).
# SST-2, Yelp polarity and QQP (question pairs) are kept as raw text and labels; tokenisation
# belongs to the text models.

# %% tags=["parameters"]
mirror = "../shared/datasets"
raw_dir = "data/raw"
processed_dir = "data/processed"
datasets = ["mnist"]
optional = []
samples = []
download = True
max_train = 0
max_test = 0
subset_seed = 0
grid_per_class = 8
metrics = "reports/metrics/data.json"

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert import data
from attncert.figures import data as figs
from attncert.figures import show
from attncert.io import write_json

summary = data.prepare(datasets, samples, mirror, raw_dir, processed_dir, download,
                       max_train, max_test, subset_seed, optional=optional)
write_json(metrics, {row["dataset"]: row for row in summary})

# %% [markdown]
# ## Sources and sizes
# `source` says which route provided each dataset: the local mirror or the download. A
# 20-image sample without a route (or not listed in `samples`) is skipped, never fatal: the
# stages that use it say so in their reports. So is a dataset listed in `optional` (Yelp
# polarity and QQP: offline they have no route).

# %%
skipped = {row["dataset"]: row["skipped"] for row in summary if "skipped" in row}
display(Markdown("**Skipped samples and optional datasets**: "
                 + ("; ".join(f"`{k}`: {v}" for k, v in skipped.items()) or "none")))
pd.DataFrame(summary).set_index("dataset")

# %% [markdown]
# ## Sample images per class

# %%
objs = [data.load_processed(row["dataset"], processed_dir) for row in summary
        if "skipped" not in row]
for obj in objs:
    if obj["kind"] == "image":
        split = "train" if "train" in obj else "test"
        show(figs.class_grid(obj, grid_per_class, split))

# %% [markdown]
# ## Class balance per split

# %%
counts = figs.class_counts(objs)
if not counts.empty:
    show(figs.class_balance(counts))
counts.pivot_table(index=["dataset", "class"], columns="split", values="count")

# %% [markdown]
# ## Text lengths
# Whitespace words per example (SST-2 sentences, Yelp reviews, QQP question pairs: both questions).

# %%
for obj in objs:
    if obj["kind"] == "text":
        lengths = figs.sentence_lengths(obj)
        show(figs.length_histogram(lengths, obj["name"]))
        display(lengths.groupby("split")["words"].describe())
        print(obj["name"], "splits without labels (not used for reporting):",
              obj["unlabelled_splits"] or "none")
