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
# # 05 · The frontier: certified against clean accuracy per training margin
#
# Every setting of `frontier.settings` trained the same ViT (the grid shape `depth`, `heads`,
# `gamma_vo`, with `train_vit`'s recipe) and changed only its margin: LMT's fixed logit
# offset, or certified training with LoFAST's local bound at a training radius
# (`attncert.training.certified_training`); `linear-*` is the trivial baseline, a linear model on
# the pixels trained for its exact radius. All are measured on a validation split held out of
# the training images (the test split is never read): certified accuracy (LoFAST(M), pairwise
# test) beside PGD accuracy, an upper bound on what any certificate can reach. The selection
# rule reads validation numbers only: the ViT setting with the highest mean over datasets of
# (clean + certified accuracy at `select_eps`) / 2.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
from IPython.display import Markdown, display

from attncert.figures import show
from attncert.pipeline.context import setup
from attncert.stages import frontier as stage

p, ctx = setup(stage, params_file, device=False)
b = ctx.base
res = stage.run(p, ctx)
verdict = ("trains its grid with it" if res.metrics["grid_is_selected"] else
           f"trains its grid with `{res.grid_setting}`, not the selected setting: set "
           "`train_vit`'s margin to it in the scale's profile")
display(Markdown(f"**Selected** `{res.selected}` ({b.scale} scale, eps {p.select_eps:g}); "
                 f"this scale {verdict}.  \n**Broken certificates:** "
                 f"{res.metrics['broken']}."))

# %% [markdown]
# ## The frontier (validation split)

# %%
show(res.figure)
res.table.round(1)

# %% [markdown]
# ## Selection scores: mean over datasets of (clean + certified at `select_eps`) / 2

# %%
res.scores.round(2).sort_values(ascending=False).to_frame("score (%)")
