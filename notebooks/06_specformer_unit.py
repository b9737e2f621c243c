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
# # 06 · SpecFormer: one unit of work
#
# The specformer stage is split into independent units, each its own DVC stage, so that
# several GPUs share it (`scripts/repro-gpus`): **a dataset** (every source, training and
# method on it, trained and attacked; the first dataset also times a training step, SpecFormer
# Table 3, and asks the certifier for a LayerNorm model's certificate), **`lambda<i>`** (the
# i-th `msvp_lambda_ablation` triple of SpecFormer Table 5: the specformer method on the first
# dataset and source, both trainings, attacked; the triple equal to `msvp_lambda` reuses the
# main runs' models) and **`certified`** (the Lipschitz ViT trained without and with MSVP,
# certified). This report shows the unit's own tables; `06_specformer` gathers every unit and
# compares with the paper. Checkpoints: `results_dir/ckpt/<unit>/` (an interrupted unit
# resumes).

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun
unit = ""  # one of attncert.stages.specformer.units (nbrun --unit)

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert.pipeline.context import setup
from attncert.specformer.study import attack_table, step_times
from attncert.stages import specformer as stage

p, ctx = setup(stage, params_file, unit=unit)
b = ctx.base
dev = ctx.device
rec = stage.run(p, ctx).record
display(Markdown(f"**Unit** `{unit}` ({b.scale} scale, device {dev})  \n**Data** {rec['data']}"
                 + "".join(f"  \n{k}: {v}" for k, v in rec["notes"].items())))

# %% [markdown]
# ## Training (dataset units)
# Test accuracy per run: for monitoring only, never used to select anything.

# %%
pd.DataFrame(rec["trained"]).round(4) if rec["trained"] else Markdown("(no main runs here)")

# %% [markdown]
# ## Accuracy under attack
# Dataset units: every run and attack (SpecFormer Tables 1-2). `lambda<i>` units: the
# specformer method at this unit's triple (Table 5).

# %%
rows = rec["robustness"] or rec["ablation"] or []
if rows:
    display(attack_table(rows))
else:
    display(Markdown("(none here: this triple is `msvp_lambda`, answered by the main runs)"
                     if rec["ablation"] is None and unit.startswith("lambda")
                     else "(no attacked models here)"))

# %% [markdown]
# ## Step times (the first dataset's unit) and the certified pair (`certified`)

# %%
if rec["times"]:
    display(step_times(rec["times"]))
if rec["refusal"]:
    display(Markdown(f"**certify(vanilla)**: `{rec['refusal']}`"))
pd.DataFrame(rec["certified"]).round(4) if rec["certified"] else None
