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
# # 06 · SpecFormer (MSVP) and the Lipschitz-attention baselines, attacked and compared
#
# Five methods on one ViT skeleton (docs/math.md sections 1, 3, 7, 8): **vanilla** (dot-product
# attention, LayerNorm), **specformer** (vanilla + the maximum singular value penalty on every
# head's W^Q, W^K, W^V, one power-iteration step per training step), **l2former** (L2
# attention, W^K = W^Q), **lnformer** (LipschitzNorm attention) and **lipsformer** (CenterNorm,
# scaled cosine attention, x + alpha f(x), spectral init). Each is trained with plain
# cross-entropy and, for `adv_methods`, with PGD adversarial training; then attacked with
# FGSM and PGD-2 at l_inf 2/255 (SpecFormer Table 1), CW-n and PGD-n at l_inf 8/255 (its
# Table 2) and L2 PGD. Also: the largest singular value per layer (its Figure 2a), the cost of
# a training step relative to vanilla (its Table 3), and what the penalty buys in
# *certified* terms on a Lipschitz ViT.
#
# **Sources.** `sources` lists where each method's ViT comes from: `scratch` builds the ViT of
# `vit` and trains it with the `train` recipe; a Hugging Face
# `ViTForImageClassification` (hub id or `save_pretrained` folder; the paper scale: ImageNet
# ViT-S/16 and DeiT-Ti, as in SpecFormer's tables) is loaded into the same standard ViT, gets a
# head for the dataset's classes, eats the dataset's images upsampled to `image_size` inside the
# model (eps stays in the dataset's pixel space) and is fine-tuned with the `finetune` recipe.
# Pre-trained weights fit vanilla and SpecFormer only: the other baselines swap attention or
# norms. Runs of a pre-trained source are named `<dataset>@<model>`.
#
# **Attacks.** The project's own `attncert.attacks` (untargeted, pixel space [0, 1], the
# normalisation inside the model; a success is kept once found, a clean error counts as
# broken). They are the attacks the certification audit already trusts (tested against
# every certificate), they run on any `nn.Module` with the model's device, and they keep
# SpecFormer's definitions: FGSM = one signed CE-gradient step of size eps; PGD-n = n CE
# steps of 2.5 eps / n from a random start; CW-n = the same on the margin loss
# max_{j != y} f_j - f_y.
#
# **Units.** The work runs in independent units, each its own DVC stage and report
# (`06_specformer_unit`, one per dataset, per Table 5 lambda and for the certified pair), so
# that several GPUs share it; this report gathers their records and trains nothing.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert.figures import show
from attncert.figures import specformer as figs
from attncert.pipeline.context import setup
from attncert.report.paper import SPECFORMER_STEP_RATIO
from attncert.stages import specformer as stage

p, ctx = setup(stage, params_file, device=False)
b = ctx.base
res = stage.run(p, ctx).result
display(Markdown(res.overview))

# %% [markdown]
# ### The CIFAR-10 sample
# The mirror's 20 real CIFAR-10 test images (`cifar10_sample`) are used by
# `tests/test_specformer.py`: `test_paper_scale_cifar_grid_code_path` runs the from-scratch
# route (this stage's paper-scale parameters with `sources: [scratch]` and every method;
# only the model size, epochs, batch size, attack steps and number of attacked images shrunk)
# through the calls of this stage's `run` (`attncert.specformer.study.recipe`,
# `base_model_config`, `method_model_config`, `run_plan`, `method_train_config`, `train_run`,
# `attack_specs`, `eval_split`, `robust_accuracy`), and
# `test_paper_scale_pretrained_code_path` the pre-trained route (`pretrained_model`,
# `finetune_run`) with a tiny `ViTForImageClassification` saved by `save_pretrained` in place
# of the hub's ViT-S/16 and DeiT-Ti, vanilla and SpecFormer, standard and adversarial, on the
# 20 images shaped as CIFAR-10 and as CIFAR-100 (3 x 32 x 32, 10 and 100 classes, training
# set = test set). They check that the code path runs, not accuracy. This report does not
# evaluate the sample: its models are trained on the datasets listed above, and without a
# CIFAR-10 training set offline none of them was trained on CIFAR-10, so none can classify its
# images. At the paper scale `cifar10` and `cifar100` are training datasets, and the first
# `n_test` images of their test splits are attacked.

# %% [markdown]
# ## Training
# Every run builds its model from the seed (or loads its pre-trained source and seeds the new
# head), trains with AdamW and a cosine schedule, and keeps a per-epoch checkpoint under
# `results_dir/ckpt/<unit>/` (an interrupted unit resumes). The test accuracy is reported,
# never used to select anything.

# %%
res.trained.round(4)

# %% [markdown]
# ## Robustness (SpecFormer Tables 1 and 2 layout)
# Accuracy (%) under each attack, method x (run, attack); "paper" columns are SpecFormer's
# Table 1 (ViT-S on CIFAR-10, standard training) where it reports the cell, beside the CIFAR-10
# runs of the first source (the paper scale: the pre-trained ViT-S/16). Standard-training
# rows answer Table 1 (FGSM, PGD-2 at 2/255); adversarial-training rows Table 2 (CW-n, PGD-n
# at 8/255). Every model is attacked with every attack; L2 PGD radii are in pixels.

# %%
res.comparison.round(2)

# %%
for name in res.runs:
    show(figs.plot_robustness(res.robustness, name))
    show(figs.plot_l2_curves(res.robustness, name))

# %% [markdown]
# ## Does each model's attention do anything
# Every trained model on the images it was attacked on: clean accuracy with its own attention
# weights, with every attention matrix replaced by uniform weights (mean pooling) and by the
# identity (no token mixing), the points lost each way, and the rows' mean entropy over log n
# (1: uniform). A gap near 0 with entropy near 1 is a model whose attention pattern does
# nothing (docs/attention.md).

# %%
res.attention.set_index(["dataset", "training", "method"]).round(4)

# %% [markdown]
# ## Largest singular value per layer (SpecFormer Figure 2a)
# max over heads of sigma_max of each head's W^Q, W^K, W^V block (exact, float64), for every
# standard-trained method; the figure shows vanilla vs SpecFormer as in the paper. L2Former's
# W^K is its W^Q.

# %%
for name in res.runs:
    show(figs.plot_max_sigma(res.sigma_pair(name), f"{name}: vanilla vs SpecFormer (MSVP)"))
res.sigma_table()

# %% [markdown]
# ## Cost of a training step (SpecFormer Table 3)
# Every method's training step (forward, loss incl. MSVP, backward, AdamW) on the same batch of
# `train.batch_size` (a pre-trained source: `finetune.batch_size`) training images of the first
# dataset, with the first source's models and recipe, measured side by side in this one run:
# after `timing_warmup` steps each, `timing_rounds` rounds time `timing_steps` steps of every
# method in turn (the start rotates); the ratio to vanilla is taken within each round, then
# the median over rounds. SpecFormer reports MSVP at 1.5x vanilla; that is the limit here.

# %%
show(figs.plot_step_ratios(res.ratios, SPECFORMER_STEP_RATIO, SPECFORMER_STEP_RATIO, p.methods))
if res.msvp_ratio is not None:
    verdict = "within" if res.msvp_ratio <= SPECFORMER_STEP_RATIO else "ABOVE"
    display(Markdown(f"**MSVP step / vanilla step = {res.msvp_ratio:.3f}**, {verdict} the "
                     f"{SPECFORMER_STEP_RATIO}x of SpecFormer's Table 3."))
res.ratios.round(4)

# %% [markdown]
# ## What the penalty buys in certified terms
# The LayerNorm models above have no certificate: LayerNorm has no Lipschitz constant (it
# divides by the tokens' standard deviation), so the certification engine refuses them, as
# shown. The penalty's certified value is therefore measured on the Lipschitz ViT of LoFAST
# section 5.2 (LayerProject, constrained dot-product attention, SLL MLPs; the normalisation
# x - mean only): one trained without and one with MSVP (`certified.msvp_lambda`), on the
# first dataset, certified with LoFAST(M) and SpecFormer's own local bound (docs/math.md section 3),
# pairwise test, l2 radii in pixel space. Every certified image is also attacked with L2 PGD at
# each radius (`pgd@eps`): a certificate the attack breaks (`broken`) fails the stage. On the
# same images, each model's attention: the points of clean accuracy lost when every attention
# matrix is replaced by uniform weights (`uniform_gap`) or by the identity (`identity_gap`),
# and the rows' entropy / log n (`attn_entropy`, 1 = uniform).

# %%
display(Markdown(f"**certify(vanilla)**: `{res.refusal}`"))

# %%
display(res.cert_sigma_table())
res.certified.round(4)

# %% [markdown]
# The Lipschitz ViT caps every ||W^Q||, ||W^K|| at gamma_qk and ||W^V||, ||W^O|| at gamma_vo
# already, so MSVP can only push the per-head norms further below those caps; the table above
# shows what that does to the certified radii of both bounds.

# %%
pd.Series({k: v for k, v in res.metrics.items() if not isinstance(v, dict | list)})
