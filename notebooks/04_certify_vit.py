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
# # 04 · Certifying one ViT of the grid with every bound variant
#
# For each test point: one forward pass with hooks collects every attention layer's clean
# input; the eps-independent terms of each variant are computed once; the certified radius
# (l2, pixel space) is found by bisection over the scalar recurrence of docs/math.md section 6.
# Variants: LoFAST(M) (eq. 27), LoFAST(xi) (eq. 28), naive (eq. 12), SpecFormer's local bound
# and the global Lipschitz product. Tests: the pairwise last-layer test and the sqrt(2) logit
# test (Proposition 1). Then L2 PGD at every eps on every correct point not yet broken at a
# smaller eps: the empirical robust accuracy, and the soundness audit (a certified point broken
# by PGD fails the stage).

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun
point = {}  # the grid point: one value of each `vit_grid` list (nbrun --item)

# %%
from IPython.display import Markdown, display

from attncert.figures import show
from attncert.figures import vit as figs
from attncert.pipeline.context import setup
from attncert.stages import certify_vit as stage

p, ctx = setup(stage, params_file, point=point)
b, dev = ctx.base, ctx.device
result = stage.run(p, ctx)
display(Markdown(f"**Run** `{result.name}` ({b.scale} scale, device {dev}): the first "
                 f"{result.n} test images of {result.dataset}, float64 (trained at precision "
                 f"`{b.precision}`; certificates never run under autocast).  \n"
                 f"**Model** `{result.model_config}`"))

# %% [markdown]
# ## Certified radii

# %%
result.radii()

# %% [markdown]
# ## L2 PGD: empirical robust accuracy and the soundness audit
# The radii run in ascending order; at each, every correctly classified point that no smaller
# radius broke is attacked (margin loss, random starts in the ball), and an adversarial example
# found at a smaller radius counts at every larger one (`attacked`: the points PGD ran on). A
# certified point that PGD breaks is a broken certificate: the stage fails (after
# `samples.csv` and `metrics.json` are written).

# %%
display(Markdown(f"**Soundness audit:** {result.summary['broken']} broken certificates over "
                 f"{len(p.cert_eps)} eps values; certified accuracy <= PGD accuracy everywhere."))
result.audit_table()

# %% [markdown]
# ## Certified accuracy vs eps (Figure 2 analog for this configuration)

# %%
show(result.figure)
result.certified_table()

# %% [markdown]
# ## Does the attention attend?
# On the certified points: the attention rows' entropy (1 = uniform), clean accuracy with every
# attention matrix replaced by uniform weights (mean pooling) and by the identity (each token
# attends to itself only), the points lost each way, the largest |attention logit| against the
# cap the constraints put on it (R^2 gamma_qk^2 / sqrt(d_h)), and LoFAST(M)'s median radius over
# the global bound's. A gap of 0 means the trained pattern changes no prediction: the
# certificate is then one of a token-wise MLP, and the local bound has nothing to exploit.

# %%
result.attention_table()

# %% [markdown]
# ## Cost of each certificate
# Seconds per sample for the whole certificate with its radius (the eps-independent terms, a
# share of the forward pass, the bisection), and the same as a multiple of one forward pass.

# %%
show(figs.plot_radius_cost(result.summary))
result.cost_table()
