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
# # 03 · Training one ViT of the grid
#
# One grid point of LoFAST section 5.2 / Figure 2 (a DVC matrix item): the Lipschitz ViT —
# normalisation inside the model (eps stays in pixel space), a patch embedding with spectral
# norm <= 1, LayerProject on the stream, dot-product attention with ||W^Q||, ||W^K|| <= gamma_qk
# and ||W^V||, ||W^O|| <= gamma_vo, SLL residual MLPs, a final LayerProject and a linear head.
# Cross-entropy with an optional margin term, AdamW and a cosine schedule; a checkpoint after
# every epoch, so an interrupted `dvc repro` resumes where it stopped.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun
point = {}  # the grid point: one value of each `vit_grid` list (nbrun --item)

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert.figures import show
from attncert.figures import vit as figs
from attncert.pipeline.context import setup
from attncert.stages import train_vit as stage

p, ctx = setup(stage, params_file, point=point)
b, dev = ctx.base, ctx.device
result = stage.run(p, ctx)
display(Markdown(
    f"**Run** `{result.name}` ({b.scale} scale, device {dev}, precision {result.precision})  \n"
    f"**Data** {result.dataset}: {result.n_train} training / {result.n_test} test images, "
    f"{result.source}  \n**Model** {result.parameters:,} parameters: "
    f"`{result.model_config}`  \n**Training** `{result.train_config}`"))

# %% [markdown]
# ## Training
# The test accuracy per epoch is for monitoring only: no epoch or setting is selected on it.
# The checkpoint in `ckpt/` resumes only for the same run (model, training, data, precision);
# otherwise it is cleared and training starts over.

# %%
display(Markdown(f"**Checkpoint:** {result.status}"))
show(figs.plot_training(result.curves))
pd.DataFrame(result.curves)[["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr",
                             "seconds"]].round(4)

# %% [markdown]
# ## Spectral norms of the final model
# Every constrained map must sit at or below its constraint (exact SVD). The patch embedding
# is <= 1 by construction; the head is unconstrained (the certificate uses its rows).

# %%
show(figs.plot_spectral_norms(result.curves[-1], result.constraints))

# %% [markdown]
# ## Final test metrics

# %%
pd.Series(result.metrics)
