"""The certify_vit stage: every bound variant and certificate test on one trained grid point.

The first ``n_test`` test images (0: all), in float64: certified radii per variant and test
(:func:`attncert.certify.certify_table`), then L2 PGD at every eps on every correct point of the
first ``audit.n`` not yet broken at a smaller eps (:func:`attncert.certify.audit`): the
empirical robust accuracy and the soundness audit, which compares certified and PGD accuracy
on those same points; then the
attention diagnostics on the certified points
(:func:`attncert.diagnostics.attention_diagnostics`: does the model's attention change any
prediction?). The point's results folder receives ``samples.csv`` (one row per test point),
``metrics.json`` (:func:`attncert.certify.summarize`) and ``certified.png``; a broken
certificate then fails the stage (:func:`attncert.soundness.require_sound`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from attncert import certify, diagnostics, soundness
from attncert.data import as_float, load_processed
from attncert.figures import vit as figs
from attncert.grid import plan
from attncert.grid.params import CertifyVitParams
from attncert.models import ViTConfig
from attncert.models.vit import load_vit
from attncert.pipeline.context import Context
from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.jobs import Job
from attncert.pipeline.params import StudyParams
from attncert.report.headline import middle_eps, numbers, row
from attncert.report.paper import mnist_anchor

#: this module's params.yaml section and its schema (:mod:`attncert.grid.params`)
SECTION = "certify_vit"
Params = CertifyVitParams


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.grid.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return [j for j in plan.jobs(params) if j.stage == SECTION]


@dataclass(frozen=True)
class Certified:
    """What the notebook shows of one certified grid point."""

    name: str
    dataset: str
    n: int  # test points certified
    model_config: ViTConfig
    table: pd.DataFrame  # samples.csv
    audit: pd.DataFrame  # one row per eps: attacked, robust accuracy, broken per variant
    summary: dict[str, Any]  # metrics.json without run and dataset
    long: pd.DataFrame  # certified accuracy per variant, test and eps
    figure: Any  # certified accuracy vs eps (saved as certified.png; closed, for display)
    samples: Path  # samples.csv

    def radii(self) -> pd.DataFrame:
        """The certified radii (and clean columns) of every point, summarised per column."""
        return self.table[[c for c in self.table if not c.startswith("pgd_")]].describe().T.round(4)

    def audit_table(self) -> pd.DataFrame:
        """Per eps: points attacked, PGD accuracy and broken certificates per variant."""
        return self.audit[["eps", "attacked", "robust_acc"]
                          + [c for c in self.audit if c.startswith("broken_")]]

    def certified_table(self) -> pd.DataFrame:
        """Certified accuracy (%) per variant and test (rows) and eps (columns)."""
        return self.long.pivot_table(index=["variant", "test"], columns="eps",
                                     values="accuracy").mul(100).round(1)

    def attention_table(self) -> pd.DataFrame:
        """Does the attention do anything: :func:`attention_summary` of this point."""
        return attention_summary({self.name: self.summary})

    def cost_table(self) -> pd.DataFrame:
        """Per certificate: seconds per sample, the same in forward passes, median radius."""
        s = self.summary
        return pd.DataFrame({"seconds/sample": s["seconds_per_sample"],
                             "x forward": s["cost_vs_forward"],
                             "median radius": s["median_radius"]}).round(4)


def run(p: Params, ctx: Context) -> Certified:
    """Certify, attack and audit the model of the grid point ``ctx.point`` on ``ctx.device``;
    write its results (a broken certificate raises
    :class:`attncert.soundness.UnsoundCertificateError` after they are written)."""
    point, device, base = ctx.point, ctx.device, ctx.require_base()
    out_dir = Path(p.results_dir) / point.name
    model = load_vit(point.run_dir / "model.pt", device).double()
    data = load_processed(point.dataset, ctx.processed_dir)
    n = len(data["test"]["y"]) if p.n_test == 0 else min(p.n_test, len(data["test"]["y"]))
    x = as_float(data["test"]["x"][:n]).double().to(device)
    y = data["test"]["y"][:n].to(device)
    table = certify.certify_table(model, x, y, p.variants, p.tests, p.softmax_lipschitz,
                                  p.max_radius, p.cert_batch_size)
    # the audit attacks the first audit.n points; its rows compare certified and PGD
    # accuracy on those same points
    m = p.audit.count(n)
    radii = {f"{v}_{t}": torch.tensor(table[f"radius_{v}_{t}"].to_numpy()[:m])
             for v in p.variants for t in p.tests}
    torch.manual_seed(base.seed)
    rows, attacked = certify.audit(model, x[:m], y[:m], radii, p.cert_eps, p.audit.steps,
                                   p.audit.restarts, base.seed,
                                   p.audit.batch(p.cert_batch_size), progress=True)
    for e, success in zip(p.cert_eps, attacked, strict=True):  # empty past the attacked
        table[f"pgd_adversarial_at_{e}"] = pd.array([*success.tolist(), *[None] * (n - m)],
                                                    dtype="boolean")
    summary = {**certify.summarize(table, rows, p.cert_eps, p.variants, p.tests),
               "n_attacked": m,
               "attention": diagnostics.attention_diagnostics(model, x, y, p.cert_batch_size)}
    summary["local_global_radius"] = diagnostics.local_global_radius(summary["median_radius"])
    samples = out_dir / "samples.csv"
    with atomic_path(samples) as tmp:
        table.to_csv(tmp, index=False)
    write_json(out_dir / "metrics.json", {"run": point.name, "dataset": point.dataset, **summary})
    soundness.require_sound({point.name: rows},
                            {name: ({str(r["eps"]): r[f"certified_{name}"] for r in rows},
                                    summary["pgd_acc"]) for name in radii},
                            see=str(samples))
    long = certify.long_certified_accuracy(summary)
    fig = figs.plot_certified(long, f"{point.name}: certified accuracy")
    with atomic_path(out_dir / "certified.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)  # shown once, by the notebook
    return Certified(point.name, point.dataset, n, model.config, table, pd.DataFrame(rows),
                     summary, long, fig, samples)


def attention_summary(metrics: Mapping[str, Mapping]) -> pd.DataFrame:
    """One row per model ({name: metrics with an ``attention`` entry}): mean row entropy / log n,
    clean accuracy (%) with the trained, uniform and identity attention, the gaps (points), the
    largest |logit| seen against the structural cap, and LoFAST(M)'s median certified radius over
    the global bound's (``local_global_radius``, when the model was certified with both)."""
    rows = []
    for name, m in metrics.items():
        a = m["attention"]
        rows.append({"model": name, "entropy / log n": a["entropy_mean"],
                     "clean %": 100 * a["acc"], "uniform %": 100 * a["acc_uniform"],
                     "identity %": 100 * a["acc_identity"], "uniform gap": a["uniform_gap"],
                     "identity gap": a["identity_gap"], "max |logit|": a["logit_max"],
                     "logit cap": a["logit_cap"],
                     "LoFAST(M) / global radius": m.get("local_global_radius")})
    return pd.DataFrame(rows).set_index("model").round(4)


def attention_rows(m: Mapping) -> list[dict]:
    """Headline rows of the attention diagnostics (``m["attention"]``) and the local / global
    radius ratio."""
    a = m.get("attention")
    if a is None:
        return []
    out = [row("attention/entropy_mean", "attention entropy / log n (1 = uniform)",
               a["entropy_mean"], "ratio"),
           row("attention/uniform_gap", "points lost with uniform attention", a["uniform_gap"],
               "value", brief=True),
           row("attention/identity_gap", "points lost with self-only attention",
               a["identity_gap"], "value")]
    if a.get("logit_cap") is not None:
        out.append(row("attention/logit_cap", "structural cap on |attention logit|",
                       a["logit_cap"], "value"))
    if m.get("local_global_radius") is not None:
        out.append(row("local_global_radius", "median radius LoFAST(M) / global",
                       m["local_global_radius"], "ratio", brief=True))
    return out


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Clean, PGD and certified accuracy per eps, seconds per sample, cost per forward pass,
    broken certificates, the attention diagnostics. The grid is LoFAST Figure 2's (384-d ViTs),
    which prints no numbers: LoFAST Table 1's are of 128-d models (the crown stage) and
    CertViT's of its own ViTs (the certvit stage), so no paper's number of the same setting
    stands beside a grid point; on MNIST at eps 1.58 the field's anchor does, labelled as
    another model and training (:func:`attncert.report.paper.mnist_anchor`)."""
    rows = [row("clean_acc", "clean accuracy", m["clean_acc"], "fraction", brief=True)]
    for eps, acc in m.get("pgd_acc", {}).items():
        rows.append(row(f"pgd_acc/{eps}", f"L2 PGD accuracy at eps {eps}", acc, "fraction"))
    for key, accs in m.get("certified_acc", {}).items():
        headline = key == "lofast_M_pairwise"
        for eps, acc in accs.items():
            anchor = mnist_anchor(m.get("dataset"), eps) if headline else (None, None)
            rows.append(row(f"certified_acc/{key}/{eps}", f"certified {key} at eps {eps}", acc,
                             "fraction", *anchor, brief=headline))
    for key, s in m.get("seconds_per_sample", {}).items():
        rows.append(row(f"seconds_per_sample/{key}", f"seconds per sample {key}", s, "seconds",
                         brief=key == "lofast_M_pairwise"))
    for key, c in m.get("cost_vs_forward", {}).items():
        rows.append(row(f"cost_vs_forward/{key}", f"cost / forward pass {key}", c, "ratio"))
    if "broken" in m:
        rows.append(row("broken", "broken certificates", m["broken"], "count"))
    return rows + attention_rows(m)


#: the certificate the DVC headline reports (LoFAST(M), pairwise test)
HEADLINE_CERTIFICATE = "lofast_M_pairwise"


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: clean accuracy, LoFAST(M)'s certified and PGD accuracy at the middle
    eps, broken certificates, the points lost with uniform attention and LoFAST(M)'s median
    radius over the global bound's."""
    pgd = m.get("pgd_acc", {})
    eps = middle_eps(pgd)
    cert = m.get("certified_acc", {}).get(HEADLINE_CERTIFICATE, {})
    return numbers(clean=m.get("clean_acc"), cert=cert.get(eps), pgd=pgd.get(eps),
                   eps=None if eps is None else float(eps), broken=m.get("broken"),
                   attn_uniform_gap=m.get("attention", {}).get("uniform_gap"),
                   local_global_radius=m.get("local_global_radius"))
