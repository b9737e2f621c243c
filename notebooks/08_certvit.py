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
# # 08 · CertViT: every unit gathered
#
# The certvit stage runs as independent units (`08_certvit/<unit>` reports): `main`, the
# section's own pre-trained ViT adapted, constrained, fine-tuned and certified in every mode
# beside a linear classifier on pixels; `table1-<dataset>`, the same steps on a CertViT Table 1
# ViT trained here; `imagenet`, CertViT Table 3's ImageNet-pretrained ViTs. This report gathers
# their records (nothing is recomputed): the `main` unit's headline, CertViT's Table 1 beside
# the Table 1 runs (at the pixel-space radius CertViT's eps covers on each dataset: 1.58 x
# 0.3081 on MNIST, 0.141 x min std on CIFAR; its constant leaves out components ours counts,
# docs/math.md sections 4-5), and Table 3's route. A broken certificate in any record fails it.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert.certvit import tables
from attncert.pipeline.context import setup
from attncert.stages import certvit as stage

p, ctx = setup(stage, params_file, device=False)
b = ctx.base
m = stage.run(p, ctx).record
display(Markdown(f"**Scale** {b.scale}; **units** {', '.join(stage.units(p))}; **source** "
                 f"`{m['source']}` on {m['dataset']} (headline mode `{m['headline_mode']}`)."))

# %% [markdown]
# ## Headline rows: the `main` unit, then the Table 1 and Table 3 units
# The `main` unit's model is not a model of CertViT's Table 1: no paper number stands beside it.

# %%
pd.DataFrame(stage.headline_rows(m, {}))[["key", "label", "ours", "paper", "source"]]

# %% [markdown]
# ## CertViT Table 1: small ViTs trained here

# %%
if m["table1"]:
    display(tables.table1_frame(m["table1"]).round(4))
else:
    display(Markdown("**Table 1 runs:** none (`table1.datasets` is empty at this scale)."))

# %% [markdown]
# ## CertViT Table 3: ImageNet-pretrained ViTs on ImageNet

# %%
if isinstance(m["imagenet"], dict):
    record = stage.read_unit(p, b, stage.IMAGENET)
    display(Markdown(f"**Images** `{m['imagenet']['images']}`; **models** "
                     f"{record['imagenet_model']}"))
    display(tables.imagenet_frame(m["imagenet"]))
else:
    display(Markdown(f"**ImageNet route {m['imagenet']}**"))
