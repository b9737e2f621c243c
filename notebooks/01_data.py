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
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert.figures import data as figs
from attncert.figures import show
from attncert.pipeline.context import setup
from attncert.stages import data as stage

p, ctx = setup(stage, params_file, base=False)
summary = stage.run(p, ctx)

# %% [markdown]
# ## Sources and sizes
# `source` says which route provided each dataset: the local mirror or the download. A
# 20-image sample without a route (or not listed in `samples`) is skipped, never fatal: the
# stages that use it say so in their reports. So is a dataset listed in `optional` (Yelp
# polarity and QQP: offline they have no route).

# %%
display(Markdown("**Skipped samples and optional datasets**: "
                 + ("; ".join(f"`{k}`: {v}" for k, v in stage.skipped(summary).items())
                    or "none")))
pd.DataFrame(summary).set_index("dataset")

# %% [markdown]
# ## Sample images per class

# %%
objs = stage.prepared(p, summary)
for obj in objs:
    if obj["kind"] == "image":
        split = "train" if "train" in obj else "test"
        show(figs.class_grid(obj, p.grid_per_class, split))

# %% [markdown]
# ## Class balance per split

# %%
counts = figs.class_counts(objs)
if not counts.empty:
    show(figs.class_balance(counts))
figs.class_count_table(counts)

# %% [markdown]
# ## Text lengths
# Whitespace words per example (SST-2 sentences, Yelp reviews, QQP question pairs: both questions).

# %%
for obj in objs:
    if obj["kind"] == "text":
        lengths = figs.sentence_lengths(obj)
        show(figs.length_histogram(lengths, obj["name"]))
        display(figs.length_summary(lengths))
        print(obj["name"], "splits without labels (not used for reporting):",
              obj["unlabelled_splits"] or "none")
