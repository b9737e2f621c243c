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
# # 09 · LoFAST vs CROWN, and LoFAST + CROWN (LoFAST Tables 1-2)
#
# One Lipschitz ViT per depth is trained here on each dataset of `datasets` (stream blocks,
# 128-d features at the paper scale; CIFAR-10 and SVHN, LoFAST Table 2's rows). The first
# `n_test` test images are certified for their TRUE label at every l2 eps (pixel space) by
# LoFAST (`lofast_variant`, pairwise test, one radius per point) and by CROWN
# through auto_LiRPA 0.3 (`attncert.crown`: the compatibility patches, a graph equal to the ViT,
# the pairwise margin specification). A CROWN bound that fails (time limit, memory, overflow,
# an unsupported operator, a bound outside an operator's domain) is recorded with its status,
# never a crash. Table 2 is a read-out of the same rows: LoFAST first, CROWN on the points it left.
# Every certified point is then attacked with L2 PGD: a broken certificate fails the stage.
# Everything runs on `base.device` (CROWN too: auto_LiRPA bounds on the GPU when there is one);
# LoFAST and the audit in float64, CROWN in `bound_dtype`.
#
# **Units.** Each (dataset, depth) trains, certifies and audits in its own DVC stage and report
# (`09_crown_unit`, `crown_unit@<dataset>-<depth>`), so that several GPUs share the stage; a
# unit fails on a broken certificate or when more than `max_error_share` of its CROWN bounds
# fail. This report gathers their records and trains nothing.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
from IPython.display import Markdown, display

from attncert.crown import PATCHES, tables
from attncert.figures import show
from attncert.pipeline.context import setup
from attncert.stages import crown as stage

p, ctx = setup(stage, params_file, device=False)
b = ctx.base
res = stage.run(p, ctx).result
parts = res.datasets
display(Markdown(f"**{b.scale} scale**: {', '.join(p.datasets)}, depths {p.depths}, "
                 f"{p.vit.dim}-d, patch {p.vit.patch}, "
                 f"{', '.join(f'{k}: {r.n}' for k, r in parts.items())} test points, "
                 f"eps {p.cert_eps}; CROWN methods {p.methods} in {p.bound_dtype} on "
                 f"{res.device} (time limit {p.time_limit:g} s per bound; "
                 f"{p.batch_size} points bounded per call at first (grown to the GPU's "
                 f"memory there), their seconds shared; "
                 + (f"budget {p.time_budget:g} s of bounds per unit; " if p.time_budget else "")
                 + (f"points LoFAST certified skip CROWN, except the first {p.alone_points}, "
                    "where CROWN alone is measured" if p.skip_lofast_certified
                    else "CROWN on every point")
                 + ("; alpha-CROWN only where CROWN did not certify"
                    if p.cascade else "") + ").  \n"
                 f"**auto_LiRPA patches applied:** {', '.join(PATCHES)}"))

# %% [markdown]
# ## Training one ViT per depth and dataset

# %%
tables.trained_table(parts)

# %% [markdown]
# ## Certifying the same points with LoFAST and CROWN
# One row per (point, eps) and CROWN method; the count of each status per dataset and depth.

# %%
tables.crown_status_table(parts)

# %% [markdown]
# ## Does the attention attend?
# Each model on the whole test split: the attention rows' entropy (1 = uniform), clean
# accuracy with every attention matrix replaced by uniform weights and by the identity, the
# points lost each way, and the largest |attention logit| against the cap the constraints put
# on it (R^2 gamma_qk^2 / sqrt(d_h)). A gap of 0: LoFAST and CROWN certify a model whose
# attention changes no prediction.

# %%
tables.attention_table(parts)

# %% [markdown]
# ## Soundness audit
# L2 PGD at each eps on every correct point; a point certified by LoFAST, CROWN or the
# combination that PGD breaks is a soundness bug and fails the stage (so does a combination
# that certifies fewer points than one of its methods).

# %%
audit, note = tables.audit_summary(parts)
display(audit)
display(Markdown(note + " The combination certifies at least what either method does (the "
                        "stage checks it)."))

# %% [markdown]
# ## LoFAST Table 1: certified accuracy (%) and seconds per sample
# One figure per dataset; the paper's numbers are CIFAR-10's. A dash (None): every CROWN bound at
# that eps failed, for any reason (the statuses are counted above); the paper's "-" marks
# overflow failures only. LoFAST's seconds cover its radius (every eps at once); CROWN's are
# the mean of one (point, eps) bound. Both are per point of a batch: a batch's seconds shared
# among its points (LoFAST 100 a call; CROWN `crown.batch_size`, the `batch` column of its rows).

# %%
for k, r in parts.items():
    show(r.figures["table1"])
    display(tables.table1_with_paper(r.table1, k).round(3))

# %% [markdown]
# ## LoFAST Table 2: CROWN alone vs LoFAST first, CROWN on the rest
# One figure per dataset; the paper's rows (CIFAR-10, SVHN; 3 layers) below.

# %%
for r in parts.values():
    show(r.figures["table2"])
display(tables.paper_table2())
tables.table2_all(parts)

# %% [markdown]
# ## Speed ratio

# %%
display(Markdown("**CROWN / LoFAST seconds per sample**: " + "; ".join(
    f"{k} " + ", ".join(f"L{d}: {x:.0f}x" for d, x in r.ratio.items())
    for k, r in parts.items())))
