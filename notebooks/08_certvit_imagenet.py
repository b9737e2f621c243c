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
# # 08 · CertViT Table 3: ImageNet-pretrained ViTs on ImageNet (one unit)
#
# Every model of `imagenet.sources` (at the paper scale ViT-T/16 and DeiT-T, the two that
# certify anything in CertViT's Table 3, and ViT-B/16, which certifies nothing there) through
# the same loader as the other units, adapted and constrained in every mode of `constrain` on
# the first `imagenet.calibration` images (they also set the norm radii), then certified and
# attacked on one image per class of the rest (CertViT sec. 4.2: 1000 validation images, one
# per class), beside the loaded model's clean accuracy on the same images. The images are the
# user's ImageNet validation images (`data.samples`: `imagenet_val`, see docs/data.md), else the
# 20-image sample. There is no fine-tune here (no ImageNet training images): the adapted and
# constrained accuracies show what the module surgery and the constraining cost by themselves.
# CertViT's clean accuracy and bound stand beside the paper mode of its own checkpoints; its
# ImageNet eps was lost in the text's extraction, so no certified number is compared. With
# `imagenet.sources: [tiny]` (offline) a tiny random ViT checks the route: its accuracy is
# that of a random network, not a result.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
from IPython.display import Markdown, display

from attncert.certvit import tables
from attncert.pipeline.context import setup
from attncert.stages import certvit as stage

p, ctx = setup(stage, params_file, unit=stage.IMAGENET)
b = ctx.base
dev = ctx.device
record = stage.run(p, ctx).record
net = record["imagenet"]
if isinstance(net, dict):
    display(Markdown(f"**Scale** {b.scale}, device {dev}.  \n**Images** `{net['images']}`"
                     + "".join(f" ({k} skipped: {v})" for k, v in net["skipped_images"].items())
                     + f"; **models** {record['imagenet_model']}"))
    display(tables.imagenet_frame(net))
else:
    display(Markdown(f"**ImageNet route {net}**"))
