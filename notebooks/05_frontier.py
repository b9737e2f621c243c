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
# # 05 · The frontier: certified against clean accuracy per training setting
#
# Every setting of `frontier.settings` trained the ViT of one grid shape (`depth`, `heads`,
# `gamma_vo`, with `train_vit`'s recipe) and changed its margin (LMT's fixed logit offset, or
# certified training with LoFAST's local bound at a training radius,
# `attncert.training.certified_training`) and, through its axes, what lets the attention attend:
# the patch size (more tokens), `gamma_qk` and the attention radius R (every attention logit is
# at most R^2 gamma_qk^2 / sqrt(d_h)). `standard*` is the standard, unconstrained ViT of the same
# shape and budget (how much attention can matter on the task); `linear-*` the trivial
# baseline, a linear model on the pixels trained for its exact radius. All are measured on a
# validation split held out of the training images (the test split is never read): certified
# accuracy (LoFAST(M) and the global bound, pairwise test) beside PGD accuracy, an upper bound
# on what any certificate can reach, and what the attention does: clean accuracy with every
# attention matrix replaced by uniform weights and by the identity. The selection rule reads
# validation numbers only: the certified ViT setting with the highest mean over datasets of
# (clean + certified accuracy at `select_eps`) / 2, among the settings that lose at least
# `min_attention_gap` points with uniform attention on every dataset (a setting whose attention
# changes no prediction is not counted as a transformer); the best setting without that rule
# is shown beside it.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
from IPython.display import Markdown, display

from attncert.figures import show
from attncert.pipeline.context import setup
from attncert.stages import frontier as stage

p, ctx = setup(stage, params_file, device=False)
b = ctx.base
res = stage.run(p, ctx).result
verdict = ("trains its grid with it" if res.metrics["grid_is_selected"] else
           f"trains its grid with `{res.grid_setting}`, not the selected setting"
           if res.selected else f"trains its grid with `{res.grid_setting}`; no certified "
           "setting's attention changes its predictions, so none is selected with attention "
           "counted")
display(Markdown(f"**Selected** (attention counted) `{res.selected}`, (attention not counted) "
                 f"`{res.selected_any}` ({b.scale} scale, eps {p.select_eps:g}); this scale "
                 f"{verdict}.  \n**Broken certificates:** {res.metrics['broken']}."))

# %% [markdown]
# ## The frontier (validation split)

# %%
show(res.figure)
res.table.round(1)

# %% [markdown]
# ## Does the attention attend?
# Certified accuracy at `select_eps` (LoFAST(M) filled, the global bound hollow) against the
# points of clean accuracy lost when every attention matrix is made uniform; grey: dead
# attention (a token-wise MLP with mean pooling); dotted: the standard ViT's gap on the same
# patch size. The table: the study's target per certified setting (a uniform-attention gap of
# at least half the standard ViT's and 1 point, LoFAST(M)'s median radius at least 1.3x the
# global bound's, no broken certificate).

# %%
show(res.attention_figure)
display(res.attention_table())
res.targets.round(3)

# %% [markdown]
# ## Why the local bound closes the attention: the bound against PGD as attention sharpens
# One seeded random residual attention layer of the study's width per token count, its logit
# cap R^2 ||B_l|| / sqrt(d_h) set to each of `sharpen_caps` (values and inputs fixed): the rows'
# entropy / log n, the largest logit on the inputs, the sensitivity at `sharpen_eps` found by
# PGD (a lower bound on the truth) and each bound's ratio to it. Certified training lowers the
# bound, not the sensitivity: where the bound grows with sharpness much faster than the
# sensitivity does, training pays for a sharper pattern with margin it does not need.

# %%
stage.sharpening_table(res.sharpening).round(3)

# %% [markdown]
# ## Selection scores: mean over datasets of (clean + certified at `select_eps`) / 2

# %%
res.scores.round(2).sort_values(ascending=False).to_frame("score (%)")
