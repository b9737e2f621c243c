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
seed = 0
device = "cpu"
precision = "auto"
scale = "paper"
runs_dir = "runs/vit"
dataset = "mnist"
depth = 3
heads = 4
gamma_vo = 0.5
kind = "lipschitz"
patch = 4
dim = 128
mlp_hidden = 256
block = "stream"
pool = "mean"
radius_attn = 4.0
radius_stream = None
gamma_qk = 0.25
head_norm = True
normalize = "mean"
epochs = 1
batch_size = 128
lr = 1e-2
weight_decay = 0.0
warmup_steps = 50
margin = "lmt"
lmt_offset = 0.2
olsa_gamma = 0.0
logit_scale = 30.0
augment = "none"
grad_clip = 0.0
eval_batch_size = 500
msvp_lambda = [0.0, 0.0, 0.0]
adversarial = "none"
adv_eps = 0.0313725
adv_steps = 10
processed_dir = "data/processed"

# %%
from pathlib import Path

import pandas as pd
import torch
from IPython.display import Markdown, display

from attncert import runs
from attncert.data import load_processed
from attncert.figures import show
from attncert.figures import vit as figs
from attncert.io import write_json
from attncert.models import build_vit
from attncert.models.vit import save_vit
from attncert.precision import resolve_precision
from attncert.train import evaluate, resolve_device, train_resumable

settings = dict(kind=kind, patch=patch, dim=dim, mlp_hidden=mlp_hidden, block=block, pool=pool,
                radius_attn=radius_attn, radius_stream=radius_stream, gamma_qk=gamma_qk,
                head_norm=head_norm,
                normalize=normalize, epochs=epochs, batch_size=batch_size, lr=lr,
                weight_decay=weight_decay, warmup_steps=warmup_steps, margin=margin,
                lmt_offset=lmt_offset, olsa_gamma=olsa_gamma, logit_scale=logit_scale,
                augment=augment, grad_clip=grad_clip, eval_batch_size=eval_batch_size,
                msvp_lambda=msvp_lambda, adversarial=adversarial, adv_eps=adv_eps,
                adv_steps=adv_steps)
dev = resolve_device(device)
name = runs.run_name(dataset, depth, heads, gamma_vo)
run_dir = Path(runs_dir) / name
data = load_processed(dataset, processed_dir)
model_cfg = runs.vit_config(data, settings, depth, heads, gamma_vo)
train_cfg = runs.train_config(settings, seed)
fp = runs.fingerprint(model_cfg, train_cfg, dataset, data["source"],
                      resolve_precision(precision, dev))
torch.manual_seed(seed)
model = build_vit(model_cfg)
n_params = sum(p.numel() for p in model.parameters())
display(Markdown(
    f"**Run** `{name}` ({scale} scale, device {dev}, precision "
    f"{resolve_precision(precision, dev)})  \n"
    f"**Data** {dataset}: {len(data['train']['y'])} training / {len(data['test']['y'])} test "
    f"images, {data['source']}  \n**Model** {n_params:,} parameters: `{model_cfg}`  \n"
    f"**Training** `{train_cfg}`"))

# %% [markdown]
# ## Training
# The test accuracy per epoch is for monitoring only: no epoch or setting is selected on it.
# The checkpoint in `ckpt/` resumes only for the same run (model, training, data, precision);
# otherwise it is cleared and training starts over.

# %%
curves, status = train_resumable(model, data["train"], data["test"], train_cfg, run_dir / "ckpt",
                                 dev, fingerprint=fp, metrics_path=run_dir / "train.json",
                                 precision=precision)
save_vit(model, run_dir / "model.pt")
display(Markdown(f"**Checkpoint:** {status}"))
show(figs.plot_training(curves))
pd.DataFrame(curves)[["epoch", "train_loss", "train_acc", "test_loss", "test_acc", "lr",
                      "seconds"]].round(4)

# %% [markdown]
# ## Spectral norms of the final model
# Every constrained map must sit at or below its constraint (exact SVD). The patch embedding
# is <= 1 by construction; the head is unconstrained (the certificate uses its rows).

# %%
gammas = {"gamma_qk": gamma_qk, "gamma_vo": gamma_vo} if kind == "lipschitz" else {}
show(figs.plot_spectral_norms(curves[-1], gammas))

# %%
final = evaluate(model, data["test"], dev, eval_batch_size)
metrics = {"run": name, "dataset": dataset, "clean_acc": final["acc"], "test_loss": final["loss"],
           "epochs": len(curves), "train_seconds": sum(r["seconds"] for r in curves),
           "parameters": n_params}
write_json(run_dir / "metrics.json", metrics)
pd.Series(metrics)
