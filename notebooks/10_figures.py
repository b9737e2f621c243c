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
# # 10 · Comparison figures and the study's summary
#
# Every stage's saved metrics side by side, with the papers' numbers drawn beside ours where
# a paper gives them (labelled "paper:" and the table; the papers' models and settings differ from
# ours, so they are references, not targets). Nothing is recomputed: the paths of every
# metrics file come from dvc.yaml and params.yaml (each grid point by name), and a stage whose
# metrics are missing is shown as "not run". The stage's run (the first cell) writes the summary
# (a DVC metric), the certified-accuracy table (a DVC plot) and the HTML export of every report.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
from IPython.display import Markdown, display

from attncert.figures import sections
from attncert.figures.sections import show_parts
from attncert.pipeline.context import setup
from attncert.stages import figures as stage
from attncert.stages.registry import load_params

p, ctx = setup(stage, params_file, device=False, study=load_params(params_file))
res = stage.run(p, ctx)
show_parts(sections.overview(res, ctx.base.scale))

# %% [markdown]
# ## LoFAST Table 3 and Figures 3-4: tightness of every bound on one attention layer
# Bound / PGD lower bound (1 = exact). The paper's layer is its trained ViT's; compare the
# ratios, not the values. Figures 3-4 (perturbed weights, input norm) have no numbers in the
# paper to draw beside ours.

# %%
show_parts(sections.tightness(res))

# %% [markdown]
# ## Certified accuracy vs eps for every grid point (LoFAST Figure 2 analog)
# One panel per configuration: every bound variant with the pairwise (solid) and logit
# (dashed) tests, and L2 PGD accuracy (an upper bound on any certified accuracy). No paper
# number stands beside the grid: LoFAST Figure 2 prints none, and LoFAST Table 1's ViTs (128-d)
# are the crown stage's, below. Then certified against clean accuracy across the grid
# (pairwise test).

# %%
show_parts(sections.certified_grid(res))

# %% [markdown]
# ## Each grid point beside the trivial baseline and the frontier
# The linear model on pixels (the certvit stage's, exact radius) certified on the same first
# n test images as the grid point; PGD accuracy on each model's own attacked points
# (`n_attacked`). The frontier's rows (its selected margin setting and its linear model) are
# on its validation split, held out of the training images: other images than the test rows.

# %%
show_parts(sections.baselines(res))

# %% [markdown]
# ## The frontier: certified vs clean accuracy per training margin (validation split)
# The grid's ViT shape trained with each margin setting, the linear baseline in black and
# PGD accuracy dotted (`05_frontier`); measured on images held out of the training split.

# %%
show_parts(sections.frontier(res))

# %% [markdown]
# ## Certification cost per sample
# Seconds per sample of the whole certificate (radius by bisection), mean over the grid with
# its range, and the crown stage's LoFAST and CROWN seconds per dataset and depth; LoFAST
# Table 1's seconds for LoFAST and alpha,beta-CROWN beside the crown stage's CIFAR-10 rows only
# (its 128-d ViTs, measured on "our local machine", which LoFAST does not name).

# %%
show_parts(sections.cost(res))

# %% [markdown]
# ## SpecFormer Tables 1-3

# %%
show_parts(sections.specformer(res))

# %% [markdown]
# ## OLSA and LoFAST on text (SST-2): certified accuracy vs eps (LoFAST Figure 5 analog)
# eps is l2 in each model's embedding space. The table lists every model's headline rows:
# OLSA's average certified radius on SST (3-layer OLSA; Shi et al.'s in the source column) is
# beside every 3-layer OLSA of ours.

# %%
show_parts(sections.text(res))

# %% [markdown]
# ## LoFAST Tables 1-2: LoFAST vs CROWN, and LoFAST first with CROWN on the rest
# Ours solid, the paper's dashed (its CIFAR-10 / SVHN ViTs and alpha,beta-CROWN; ours:
# auto_LiRPA's CROWN on each of the crown stage's datasets, one line style per dataset).

# %%
show_parts(sections.crown(res))

# %% [markdown]
# ## CertViT's Table 1 beside ours

# %%
show_parts(sections.certvit(res))

# %% [markdown]
# ## The reports as HTML
# Every executed notebook as one self-contained page (figures embedded, no external
# scripts) and an index with each report's headline numbers. This notebook's own page is
# written by the stage command after it finishes (`python -m attncert.report html`).

# %%
display(Markdown(f"{len(res.pages)} page(s) written to `{p.html_dir}/` (open `index.html`)."))
