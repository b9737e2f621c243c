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
# # 07 · Sentiment transformers: one unit of work
#
# The text stage is split into independent units, each its own DVC stage, so that several
# GPUs share it (`scripts/repro-gpus`): on SST-2 **`sst2-olsa`** (OLSA at depth 0 and at every
# depth), **`sst2-controls`** (the gamma ablation, the residual and alpha1 controls, Kim-L2,
# the standard transformer), **`sst2-lofast`** (LoFAST's small-BERT grid) and
# **`sst2-frozen`** (the OLSA head over the frozen encoder); then **`yelp_polarity`** and
# **`qqp`** (OLSA from scratch and the frozen head where the scale lists them). This report
# shows the unit's models and its soundness audit (a broken certificate fails the unit);
# `07_text` gathers every unit. Checkpoints: `results_dir/ckpt/<unit>/<model>` (an
# interrupted unit resumes).

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun
unit = ""  # one of attncert.stages.text.UNITS (nbrun --unit)

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert.pipeline.context import setup
from attncert.stages import text as stage

p, ctx = setup(stage, params_file, unit=unit)
b = ctx.base
rec = stage.run(p, ctx).record
models = rec["results"] or (rec["entry"] or {}).get("models", {})
display(Markdown(f"**Unit** `{unit}` ({b.scale} scale, device {rec['device']}, "
                 f"{rec['seconds'] / 60:.1f} min): {len(models)} models"
                 + ("" if models else " (the scale leaves this unit's dataset out)")))

# %% [markdown]
# ## The unit's models
# Accuracy on the reported split, the average certified radius (0 where wrong, best variant)
# and the broken certificates of the PGD audit.

# %%
pd.DataFrame([{"model": name, "test_acc": r["test_acc"],
               "avg_radius": max(r["avg_radius"].values()), "broken": r["broken"],
               "train_seconds": r["train_seconds"]} for name, r in models.items()])

# %%
display(Markdown(f"**Soundness audit** (run by the stage): "
                 f"{sum(r['broken'] for r in models.values())} broken certificates over "
                 f"{len(rec['audits'])} models."))
