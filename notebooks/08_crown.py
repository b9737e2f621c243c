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
# # 08 · LoFAST vs CROWN, and LoFAST + CROWN (LoFAST Tables 1-2)
#
# One Lipschitz ViT per depth is trained here (stream blocks, 128-d features at the paper
# scale). The first `n_test` test images are certified for their TRUE label at every l2 eps
# (pixel space) by LoFAST (`lofast_variant`, pairwise test, one radius per point) and by CROWN
# through auto_LiRPA 0.3 (`attncert.crown`: the compatibility patches, a graph equal to the ViT,
# the pairwise margin specification). A CROWN bound that fails (time limit, memory, overflow,
# an unsupported operator, a bound outside an operator's domain) is a recorded "-", never a
# crash. Table 2 is a read-out of the same rows: LoFAST first, CROWN on the points it left.
# Every certified point is then attacked with L2 PGD: a broken certificate fails the stage.
# Everything runs on `base.device` (CROWN too: auto_LiRPA bounds on the GPU when there is one);
# LoFAST and the audit in float64, CROWN in `bound_dtype`.

# %% tags=["parameters"]
base = {}  # params.yaml `base`, passed whole by attncert.nbrun
crown = {}  # params.yaml `crown`, passed whole by attncert.nbrun
processed_dir = "data/processed"

# %%
from IPython.display import Markdown, display

from attncert.crown import PATCHES
from attncert.figures import show
from attncert.params import BaseParams, parse_section
from attncert.stages import crown as stage

b = parse_section("base", base, BaseParams)
p = parse_section("crown", crown, stage.Params)
res = stage.run(p, b, processed_dir)
display(Markdown(f"**{b.scale} scale**: {p.dataset}, depths {p.depths}, {p.dim}-d, patch "
                 f"{p.patch}, {res.n} test points, eps {p.cert_eps}; CROWN methods {p.methods} "
                 f"in {p.bound_dtype} on {res.device} (time limit {p.time_limit:g} s per "
                 f"bound).  \n**auto_LiRPA patches applied:** {', '.join(PATCHES)}"))

# %% [markdown]
# ## Training one ViT per depth

# %%
res.trained.round(2)

# %% [markdown]
# ## Certifying the same points with LoFAST and CROWN
# One row per (point, eps) and CROWN method; the count of each status per depth.

# %%
res.crown.groupby(["depth", "method", "status"]).size().unstack(fill_value=0)

# %% [markdown]
# ## Soundness audit
# L2 PGD at each eps on every correct point; a point certified by LoFAST, CROWN or the
# combination that PGD breaks is a soundness bug and fails the stage (so does a combination
# that certifies fewer points than one of its methods).

# %%
display(res.audit[["depth", "eps", "attacked", "robust_acc"]
                  + [c for c in res.audit if c.startswith("broken_")]])
display(Markdown(f"**0 broken certificates** over {len(p.cert_eps)} eps and {len(p.depths)} "
                 "depths; the combination certifies at least what either method does."))

# %% [markdown]
# ## LoFAST Table 1: certified accuracy (%) and seconds per sample
# "-" (None): every CROWN bound at that eps failed. LoFAST's seconds cover its radius (every
# eps at once); CROWN's are the mean of one (point, eps) bound.

# %%
show(res.figures["table1"])
stage.table1_with_paper(res.table1, p.dataset).round(3)

# %% [markdown]
# ## LoFAST Table 2: CROWN alone vs LoFAST first, CROWN on the rest

# %%
show(res.figures["table2"])
display(stage.paper_table2())
res.table2.round(3)

# %% [markdown]
# ## Speed ratio

# %%
display(Markdown("**CROWN / LoFAST seconds per sample**: "
                 + ", ".join(f"L{d}: {r:.0f}x" for d, r in res.ratio.items())))
