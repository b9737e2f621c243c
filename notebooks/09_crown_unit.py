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
# # 09 · LoFAST vs CROWN: one unit (a dataset and a depth)
#
# The crown stage is split into independent units, one per (dataset, depth), each its own DVC
# stage, so that several GPUs share it (`scripts/repro-gpus`). This unit trains its Lipschitz
# ViT (checkpoint `results_dir/ckpt/<dataset>/L<depth>`: an interrupted unit resumes), certifies
# the first `n_test` test points by LoFAST and every CROWN method (at most `time_budget`
# seconds of CROWN bounds; with `skip_lofast_certified` only where LoFAST did not certify; with
# `alpha_after_crown` alpha-CROWN only where CROWN did not),
# then audits every certified point with L2 PGD. It fails on a broken certificate, on a
# combination that certifies less than one of its methods, or when more than
# `max_error_share` of the CROWN bounds that ran ended in an error. `09_crown` gathers the
# units into LoFAST's Tables 1-2.

# %% tags=["parameters"]
params_file = "params.yaml"  # the study's params, passed by attncert.pipeline.nbrun
unit = ""  # one of attncert.stages.crown.units: <dataset>-L<depth> (nbrun --unit)

# %%
import pandas as pd
from IPython.display import Markdown, display

from attncert.crown import tables
from attncert.pipeline.context import setup
from attncert.stages import crown as stage

p, ctx = setup(stage, params_file, unit=unit)
b = ctx.base
rec = stage.run(p, ctx).record
t = rec["trained"]
a = rec["attention"]
display(Markdown(f"**Unit** `{unit}` ({b.scale} scale, device {rec['device']}, "
                 f"{rec['seconds'] / 60:.1f} min): clean accuracy {t['test_acc']:.2f}%, "
                 f"{rec['n']} test points certified and audited.  \n**Attention** on the "
                 f"whole test split: entropy / log n {a['entropy_mean']:.4f}; "
                 f"{a['uniform_gap']:.2f} points lost with uniform attention, "
                 f"{a['identity_gap']:.2f} with the identity; largest |logit| "
                 f"{a['logit_max']:.3g} (cap {a['logit_cap']:.3g})."))

# %% [markdown]
# ## CROWN's (point, eps) rows by status, and the unit's Tables 1-2 rows

# %%
display(tables.unit_status_counts(rec["crown"]))
display(pd.DataFrame(rec["table1"]).round(3))
pd.DataFrame(rec["table2"]).round(3)
