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
seed = 0
device = "cpu"
precision = "auto"
scale = "paper"
dataset = "mnist"
depths = [3, 4, 5]
patch = 14
dim = 128
heads = 4
mlp_hidden = 256
pool = "mean"
radius_attn = 4.0
gamma_qk = 0.25
gamma_vo = 0.5
normalize = "mean"
max_train = 10000
epochs = 2
batch_size = 128
lr = 1e-2
warmup_steps = 50
lmt_offset = 0.2
logit_scale = 30.0
n_test = 5
cert_eps = [0.02, 0.05, 0.1]
lofast_variant = "lofast_M"
methods = ["crown"]
bound_dtype = "float64"
alpha_iterations = 20
time_limit = 60.0
attack_steps = 50
attack_restarts = 2
work_dir = "runs/crown"
metrics = "reports/metrics/crown.json"
processed_dir = "data/processed"

# %%
import time
from pathlib import Path

import pandas as pd
import torch
from IPython.display import Markdown, display

from attncert import certify, soundness
from attncert.crown import METHODS, PATCHES, study
from attncert.data import as_float, load_processed
from attncert.figures import crown as figs
from attncert.figures import show
from attncert.io import atomic_path, write_json
from attncert.paper import LOFAST_TABLE1, LOFAST_TABLE2, LOFAST_TABLE_EPS
from attncert.train import resolve_device

stage_t0 = time.perf_counter()
dev = resolve_device(device)
out = Path(work_dir)
p = dict(patch=patch, dim=dim, heads=heads, mlp_hidden=mlp_hidden, pool=pool,
         radius_attn=radius_attn, gamma_qk=gamma_qk, gamma_vo=gamma_vo, normalize=normalize,
         max_train=max_train, epochs=epochs, batch_size=batch_size, lr=lr,
         warmup_steps=warmup_steps, lmt_offset=lmt_offset, logit_scale=logit_scale)
data = load_processed(dataset, processed_dir)
n = min(n_test, len(data["test"]["y"]))
x = as_float(data["test"]["x"][:n]).to(dev, torch.float64)
y = data["test"]["y"][:n].to(dev)
display(Markdown(f"**{scale} scale**: {dataset}, depths {depths}, {dim}-d, patch {patch}, "
                 f"{n} test points, eps {cert_eps}; CROWN methods {methods} in {bound_dtype} "
                 f"on {dev} (time limit {time_limit:g} s per bound).  \n"
                 f"**auto_LiRPA patches applied:** {', '.join(PATCHES)}"))

# %% [markdown]
# ## Training one ViT per depth

# %%
models, trained = {}, []
for depth in depths:
    model, acc, secs = study.train_model(data, p, depth, seed, out / "ckpt" / f"L{depth}", dev,
                                         precision)
    models[depth] = model
    trained.append({"depth": depth, "test_acc": 100 * acc, "train_seconds": secs})
pd.DataFrame(trained).round(2)

# %% [markdown]
# ## Certifying the same points with LoFAST and CROWN

# %%
lofast_all, crown_all, t1, t2, audits = [], [], [], [], []
for depth, model in models.items():
    lo = study.lofast_frame(model.double(), x, y, lofast_variant, cert_eps)
    lofast_all.append(lo.assign(depth=depth))
    certified = {e: torch.tensor(lo[f"certified_{e}"].to_numpy()) for e in cert_eps}
    radii = {"lofast": study.grid_radius(certified)}
    for method in methods:
        rows, build_s = study.crown_frame(model, x, y, cert_eps, method, time_limit,
                                          alpha_iterations, getattr(torch, bound_dtype),
                                          progress=True)
        crown_all.append(rows.assign(depth=depth))
        a, b = study.tables(lo, rows, cert_eps, depth, METHODS[method])
        t1 += a if method == methods[0] else a[1:]
        t2 += b
        cr = {e: study.crown_certified(rows, n, e) for e in cert_eps}
        radii[method] = study.grid_radius(cr)
        radii[f"lofast+{method}"] = study.grid_radius({e: certified[e] | cr[e] for e in cert_eps})
    rows_a, _ = certify.audit(model.double(), x, y, radii, cert_eps, attack_steps,
                              attack_restarts, seed)
    audits += [dict(r, depth=depth) for r in rows_a]
lofast_df, crown_df = pd.concat(lofast_all), pd.concat(crown_all)
for name, df in (("lofast.csv", lofast_df), ("crown.csv", crown_df)):
    with atomic_path(out / name) as tmp:
        df.to_csv(tmp, index=False)
table1, table2, audit = pd.DataFrame(t1), pd.DataFrame(t2), pd.DataFrame(audits)
crown_df.groupby(["depth", "method", "status"]).size().unstack(fill_value=0)

# %% [markdown]
# ## Soundness audit
# L2 PGD at each eps on every correct point; a point certified by LoFAST, CROWN or the
# combination that PGD breaks is a soundness bug and fails the stage.

# %%
display(audit[["depth", "eps", "attacked", "robust_acc"]
              + [c for c in audit if c.startswith("broken_")]])
broken = int(audit[[c for c in audit if c.startswith("broken_")]].to_numpy().sum())
soundness.require_sound({dataset: audits}, by=("depth",), see=str(out))
for r in t2:
    if r["combined_acc"] < max(r["crown_acc"], r["lofast_acc"]):
        raise RuntimeError(f"the combination certifies fewer points than one method: {r}")
display(Markdown(f"**0 broken certificates** over {len(cert_eps)} eps and {len(depths)} "
                 "depths; the combination certifies at least what either method does."))

# %% [markdown]
# ## LoFAST Table 1: certified accuracy (%) and seconds per sample
# "-" (None): every CROWN bound at that eps failed. LoFAST's seconds cover its radius (every
# eps at once); CROWN's are the mean of one (point, eps) bound.

# %%
show(figs.plot_table1(table1), out / "table1.png")
paper1 = pd.DataFrame([{"depth": d, "method": f"{name} (paper, CIFAR-10)",
                        "seconds_per_sample": LOFAST_TABLE1[f"{m}_seconds"][d],
                        **{f"acc_{e}": a for e, a in zip(LOFAST_TABLE_EPS, accs, strict=True)}}
                       for m, name in (("lofast", "LoFAST"), ("crown", "alpha,beta-CROWN"))
                       for d, accs in LOFAST_TABLE1[m].items()])
pd.concat([table1.assign(method=table1["method"] + f" (ours, {dataset})"), paper1]).sort_values(
    ["depth", "method"]).set_index(["depth", "method"]).round(3)

# %% [markdown]
# ## LoFAST Table 2: CROWN alone vs LoFAST first, CROWN on the rest

# %%
show(figs.plot_table2(table2), out / "table2.png")
paper2 = pd.DataFrame([{"dataset": ds, "method": m, "eps": e, "acc": a, "seconds": s}
                       for ds, per in LOFAST_TABLE2.items() for m, vals in per.items()
                       for e, (a, s) in zip(LOFAST_TABLE_EPS[:2], vals, strict=True)])
display(paper2.pivot_table(index=["dataset", "method"], columns="eps",
                           values=["acc", "seconds"]))
table2.round(3)

# %% [markdown]
# ## Speed ratio and metrics

# %%
ratio = {}
for d in depths:
    rows = table1[table1["depth"] == d].set_index("method")["seconds_per_sample"]
    ratio[str(d)] = float(rows.drop("LoFAST").iloc[0] / rows["LoFAST"])
summary = {"dataset": dataset, "n": n, "eps": cert_eps, "depths": depths,
           "crown_over_lofast_seconds": ratio, "broken": broken,
           "table1": table1.to_dict("records"), "table2": table2.to_dict("records"),
           "crown_status": {f"L{d}": study.status_counts(crown_df[crown_df["depth"] == d])
                            for d in depths},
           "trained": trained, "stage_seconds": time.perf_counter() - stage_t0}
write_json(metrics, summary)
display(Markdown("**CROWN / LoFAST seconds per sample**: "
                 + ", ".join(f"L{d}: {r:.0f}x" for d, r in ratio.items())))
