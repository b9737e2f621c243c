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
# # 05 · The frontier: one unit (a dataset and a training setting)
#
# The frontier stage is split into independent units, one per (dataset, setting), each its
# own DVC stage. This unit trains the `train_vit` ViT of the frontier's grid shape with
# `train_vit`'s recipe and this setting's margin (`lmt-<offset>`, `lofast-<radius>`), or the
# linear baseline (`linear-<offset>`), on the training split minus its last `holdout` images
# (checkpoint `results_dir/ckpt/<unit>`: an interrupted unit resumes). It is measured on the held
# out images only: clean accuracy, certified accuracy (LoFAST(M), pairwise test; the linear
# model's exact radius) and L2 PGD accuracy, which audits every certificate (a broken one
# fails the unit). `05_frontier` gathers the units and selects a setting.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun
unit = ""  # one of attncert.stages.frontier.units: <dataset>-<setting> (nbrun --unit)

# %%
from IPython.display import Markdown, display

from attncert.pipeline.context import setup
from attncert.stages import frontier as stage

p, ctx = setup(stage, params_file, unit=unit)
b = ctx.base
rec = stage.run(p, ctx).record
display(Markdown(f"**Unit** `{unit}` ({b.scale} scale, device {rec['device']}, "
                 f"{rec['seconds'] / 60:.1f} min; checkpoint: {rec['checkpoint']}): "
                 f"{rec['epochs']} epochs in {rec['train_seconds']:.0f} s, "
                 f"{rec['n_val']} validation points certified, {rec['n_attacked']} attacked."))

# %% [markdown]
# ## Clean, certified and PGD accuracy on the validation points

# %%
stage.unit_table(rec)

# %% [markdown]
# ## Does the attention attend?
# On the same validation points: the attention rows' entropy per layer (1 = uniform), clean
# accuracy with every attention matrix replaced by uniform weights and by the identity, the
# points lost each way, the largest |attention logit| against its structural cap, and
# LoFAST(M)'s median certified radius over the global bound's (none for the linear baseline).

# %%
stage.unit_attention(rec)
