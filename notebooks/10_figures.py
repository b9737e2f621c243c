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
import pandas as pd
from IPython.display import Markdown, display

from attncert.figures import frontier as frontier_figs
from attncert.figures import show
from attncert.figures import summary as figs
from attncert.pipeline.context import setup
from attncert.stages import figures as stage
from attncert.stages.registry import load_params

p, ctx = setup(stage, params_file, device=False, study=load_params(params_file))
res = stage.run(p, ctx)
result = res.summary
display(Markdown(f"**Scale** {ctx.base.scale}: {len(res.runs)} stage runs declared in dvc.yaml."))
pd.DataFrame([{"stage": name, "status": e["status"], "metrics read": len(e["metrics"]),
               "missing": len(e["missing"])} for name, e in result["stages"].items()])

# %% [markdown]
# ## LoFAST Table 3 and Figures 3-4: tightness of every bound on one attention layer
# Bound / PGD lower bound (1 = exact). The paper's layer is its trained ViT's; compare the
# ratios, not the values. Figures 3-4 (perturbed weights, input norm) have no numbers in the
# paper to draw beside ours.

# %%
note = res.note("tightness")
if note:
    display(Markdown(note))
else:
    tight_m = res.metrics("tightness")["tightness"]
    tight = figs.tightness_frame(tight_m)
    show(figs.plot_tightness(tight), res.key_figure(1, "tightness_of_every_bound"))
    fig3, fig4 = figs.ablation_frames(tight_m)
    if len(fig3) or len(fig4):
        show(figs.plot_ablations(fig3, fig4, tight_m.get("fig3_eps")))
    display(tight.pivot_table(index="eps", columns=["source", "method"], values="ratio").round(4))
    display(figs.headline_frame([r for r in res.rows("tightness") if r["key"].endswith("_max")]))

# %% [markdown]
# ## Certified accuracy vs eps for every grid point (LoFAST Figure 2 analog)
# One panel per configuration: every bound variant with the pairwise (solid) and logit
# (dashed) tests, and L2 PGD accuracy (an upper bound on any certified accuracy). Stars are
# the papers' numbers for that configuration: LoFAST Table 1 (CIFAR-10, 128-d ViT, depth 3-5)
# and CertViT's MNIST claim (its eps is not pixel-space).

# %%
points = res.metrics("certify_vit")
note = res.note("certify_vit")
long = res.certified
if note:
    display(Markdown(note))
if points:
    # LoFAST Figure 2 prints no numbers to set beside
    show(figs.plot_certified_grid(long), res.key_figure(2, "certified_accuracy_vs_eps"))
    display(long[long.test != "logit"].pivot_table(index=["run", "variant"], columns="eps",
                                                   values="accuracy").mul(100).round(1))

# %% [markdown]
# ## Certified vs clean accuracy across the grid (pairwise test)

# %%
items = res.items("certify_vit")
if points:
    show(figs.plot_tradeoff(figs.tradeoff_frame(points)),
         res.key_figure(3, "certified_vs_clean_accuracy"))

# %% [markdown]
# ## Each grid point beside the trivial baseline and the frontier
# The linear model on pixels (the certvit stage's, exact radius) certified on the same first
# n test images as the grid point; PGD accuracy on each model's own attacked points
# (`n_attacked`). The frontier's rows (its selected margin setting and its linear model) are
# on its validation split, held out of the training images: other images than the test rows.

# %%
if res.beside is not None and len(res.beside):
    display(res.beside.set_index(["point", "model"]).round(1))
else:
    display(Markdown(note or "(no grid point certified yet)"))

# %% [markdown]
# ## The frontier: certified vs clean accuracy per training margin (validation split)
# The grid's ViT shape trained with each margin setting, the linear baseline in black and
# PGD accuracy dotted (`05_frontier`); measured on images held out of the training split.

# %%
front = res.metrics("frontier").get("frontier")
if front:
    show(frontier_figs.plot_frontier(pd.DataFrame(front["rows"]), front["eps"],
                                     front["select_eps"]),
         res.key_figure(4, "frontier_per_training_margin"))
    display(Markdown(f"Selected on validation: `{front['selected']}`; the grid trains with "
                     f"`{front['grid_setting']}`."))
else:
    display(Markdown(res.note("frontier") or "(the frontier stage has not run)"))

# %% [markdown]
# ## Certification cost per sample
# Seconds per sample of the whole certificate (radius by bisection), mean over the grid with
# its range, and the crown stage's LoFAST and CROWN seconds per dataset and depth; LoFAST
# Table 1's seconds for LoFAST and alpha,beta-CROWN beside (their GPU).

# %%
crown = res.metrics("crown").get("crown")
if points or crown:
    cost = figs.cost_frame(points, crown)
    show(figs.plot_cost(cost))
    display(cost.groupby(["source", "method"])["seconds"].agg(["mean", "min", "max"]))

# %% [markdown]
# ## SpecFormer Tables 1-3

# %%
note = res.note("specformer")
if note:
    display(Markdown(note))
else:
    spec = figs.specformer_frame(res.metrics("specformer")["specformer"])
    show(figs.plot_specformer(spec))
    display(spec.pivot_table(index=["training", "method"],
                             columns=["source", "dataset", "attack"], values="accuracy").round(1))
    display(figs.headline_frame([r for r in res.rows("specformer")
                                 if not r["key"].startswith("robustness/")]))

# %% [markdown]
# ## OLSA and LoFAST on text (SST-2): certified accuracy vs eps (LoFAST Figure 5 analog)
# eps is l2 in each model's embedding space. The table lists every model's headline rows:
# OLSA's average certified radius on SST (3-layer OLSA; Shi et al.'s in the source column) is
# beside every 3-layer OLSA of ours.

# %%
note = res.note("text")
if note:
    display(Markdown(note))
else:
    text_curves = figs.text_certified_frame(res.metrics("text")["text"])
    if not text_curves.empty:
        show(figs.plot_text_certified(text_curves), res.key_figure(5, "text_certified_accuracy"))
    rows = res.rows("text")
    fig = figs.plot_headline(rows, "OLSA's SST radius beside ours")
    if fig is not None:
        show(fig)
    display(figs.headline_frame(rows, brief_only=len(rows) > 40))

# %% [markdown]
# ## LoFAST Tables 1-2: LoFAST vs CROWN, and LoFAST first with CROWN on the rest
# Ours solid, the paper's dashed (its CIFAR-10 / SVHN ViTs and alpha,beta-CROWN; ours:
# auto_LiRPA's CROWN on each of the crown stage's datasets, one line style per dataset).

# %%
note = res.note("crown")
if note:
    display(Markdown(note))
else:
    show(figs.plot_crown(figs.crown_frame(crown)), res.key_figure(6, "lofast_vs_crown"))
    display(figs.headline_frame(res.rows("crown")))

# %% [markdown]
# ## CertViT's Table 1 beside ours

# %%
note = res.note("certvit")
if note:
    display(Markdown(note))
else:
    rows = res.rows("certvit")
    fig = figs.plot_headline(rows, "CertViT Table 1 beside ours")
    if fig is not None:
        show(fig)
    display(figs.headline_frame(rows))

# %% [markdown]
# ## The reports as HTML
# Every executed notebook as one self-contained page (figures embedded, no external
# scripts) and an index with each report's headline numbers. This notebook's own page is
# written by the stage command after it finishes (`python -m attncert.report html`).

# %%
display(Markdown(f"{len(res.pages)} page(s) written to `{p.html_dir}/` (open `index.html`)."))
