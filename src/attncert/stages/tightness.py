"""The tightness stage: LoFAST's Table 3 and Figures 1, 3 and 4 on one residual attention layer.

The layer is a trained Lipschitz ViT's (its clean inputs, projected onto the input ball) or a
seeded random one (:mod:`attncert.tightness`); every bound uses certificate-grade spectral
norms and is measured against PGD, a lower bound, so bound / PGD >= 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import pandas as pd
import torch

from attncert import tightness
from attncert.pipeline.context import Context
from attncert.pipeline.io import write_json
from attncert.pipeline.jobs import Job
from attncert.pipeline.params import (
    ParamsError,
    StudyParams,
    nonneg,
    one_of_numbers,
    param,
    positive,
)
from attncert.report.headline import eps_match, numbers, row, scale_caveat
from attncert.tightness import plan

#: this module's params.yaml section
SECTION = "tightness"


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.tightness.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return plan.jobs(params)


@dataclass(frozen=True)
class Params:
    """params.yaml ``tightness``."""

    checkpoint: str = param(doc="'' uses a seeded random layer; else a ViT checkpoint (.pt)")
    inputs: str = param(doc="processed dataset whose test images feed a checkpoint's layer")
    layer: int = param(nonneg, doc="which attention layer of the checkpoint")
    input_radius: float = param(positive, doc="every input token projected to ||x_i|| <= R")
    n_tokens: int = param(positive)
    dim: int = param(positive)
    heads: int = param(positive)
    samples: int = param(positive)
    gamma_qk: float = param(positive)
    gamma_vo: float = param(positive)
    cert_eps: list[float] = param(positive, doc="radii at which every bound and PGD are evaluated")
    softmax_lipschitz: float = param(one_of_numbers(0.5, 1.0))
    fig3_eps: float = param(positive)
    fig3_sizes: list[float] = param(nonneg)
    fig3_samples: int = param(positive)
    fig4_scales: list[float] = param(positive)
    attack_steps: int = param(positive, doc="PGD steps of the lower bound")
    attack_restarts: int = param(positive)
    metrics: str = param()

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ParamsError(f"tightness.heads: dim = {self.dim} is not divisible by "
                              f"heads = {self.heads}")


@dataclass(frozen=True)
class Result:
    """What the notebook shows: the layer, and every measurement as a long frame."""

    layer_source: str
    device: torch.device
    inputs: tuple[int, ...]        # (inputs, tokens, features) of the measured X
    heads: int
    dtype: torch.dtype
    table3: pd.DataFrame           # Table 3: every bound and PGD per eps
    figure1_single: pd.DataFrame   # Figure 1, one head: Delta_{2,1} and Delta_{2,2}
    figure3: pd.DataFrame          # Figure 3: perturbed W^Q, W^K, W^V, W^O and X
    figure4: pd.DataFrame          # Figure 4: every bound per input scale
    metrics: dict

    @property
    def figure1_multi(self) -> pd.DataFrame:
        """Figure 1, multi-head: Table 3's bounds without SpecFormer."""
        return self.table3[self.table3.method != "SpecFormer"]

    def table3_values(self) -> pd.DataFrame:
        """Table 3, eps x method: every bound and the PGD lower bound."""
        return self.table3.pivot_table(index="eps", columns="method", values="value")

    def table3_ratios(self) -> pd.DataFrame:
        """bound / PGD per eps and method, ours beside the paper's (LoFAST Table 3, on its
        own trained layer: compare the ratios, not the values)."""
        paper = tightness.paper_table3_frame()
        return pd.concat({src: t.pivot_table(index="eps", columns="method",
                                             values="ratio_to_pgd")
                          for src, t in (("ours", self.table3), ("paper", paper))},
                         axis=1).round(4)

    def figure1_ratios(self) -> pd.DataFrame:
        """Figure 1, one head: each piece's bound / PGD per eps."""
        return self.figure1_single.pivot_table(index="eps", columns=["quantity", "method"],
                                               values="ratio_to_pgd")

    def figure3_ratios(self) -> pd.DataFrame:
        """Figure 3: mean, min and max bound / PGD per perturbed target and size."""
        return self.figure3.groupby(["target", "size"])["ratio"].describe()[
            ["mean", "min", "max"]]

    def figure4_ratios(self) -> pd.DataFrame:
        """Figure 4: bound / PGD per input scale (and norm) and method."""
        return self.figure4.pivot_table(index=["scale", "input_norm"], columns="method",
                                        values="ratio_to_pgd")

    def lofast_over_pgd(self) -> pd.Series:
        """LoFAST(M) / PGD per eps (the metrics file's)."""
        return pd.Series(self.metrics["table3_lofast_M_over_pgd"], name="LoFAST(M) / PGD")


def run(p: Params, ctx: Context) -> Result:
    """Measure Table 3 and Figures 1, 3, 4 on the study's layer on ``ctx.device``; write the
    metrics file."""
    base, dev = ctx.require_base(), ctx.device
    seed, steps, restarts = base.seed, p.attack_steps, p.attack_restarts
    w, x, layer_source = tightness.study_layer(p.checkpoint, p.inputs, p.n_tokens, p.dim,
                                               p.heads, p.samples, p.gamma_qk, p.gamma_vo,
                                               seed, p.layer, p.input_radius)
    w, x = w.to(dev), x.to(dev)
    t3 = tightness.table3(w, x, p.cert_eps, steps, restarts, True, p.softmax_lipschitz, seed)
    f1 = tightness.figure1_single_head(w, x, p.cert_eps, 0, steps, restarts,
                                       p.softmax_lipschitz, seed)
    f3 = tightness.figure3_weight_perturbation(w, x, p.fig3_sizes, p.fig3_eps, p.fig3_samples,
                                               seed, steps, restarts)
    f4 = tightness.figure4_input_norm(w, x, p.fig4_scales, p.fig3_eps, steps, restarts, True,
                                      seed)
    summary = {"scale": base.scale,
               **tightness.summary_metrics(t3, f1, f3, f4, layer_source)}
    write_json(p.metrics, summary)
    return Result(layer_source, dev, tuple(x.shape), w.h, x.dtype, t3, f1, f3, f4, summary)


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Every bound / PGD of Table 3 per eps (LoFAST's ratio beside for LoFAST(xi), the form
    of its Table 3 row, and SpecFormer), and the largest ratios of Figures 1, 3 and 4."""
    t3 = tightness.PAPER_TABLE3
    rows = []
    methods = (("lofast_M", "LoFAST(M)", None), ("lofast_xi", "LoFAST(xi)", "LoFAST"),
               ("naive", "naive", None), ("specformer", "SpecFormer", "SpecFormer"))
    for key, label, paper_row in methods:
        for eps, ratio in m.get(f"table3_{key}_over_pgd", {}).items():
            i = eps_match(eps, t3["eps"])
            ref = t3[paper_row][i] / t3["PGD"][i] if paper_row and i is not None else None
            rows.append(row(f"table3_{key}_over_pgd/{eps}", f"{label} / PGD at eps {eps}",
                             ratio, "ratio", ref, f"LoFAST Table 3{scale_caveat(m)}",
                             brief=paper_row is not None or key == "lofast_M"))
    for key in ("max_lofast_M_over_pgd", "fig1_delta21_M_over_pgd_max", "fig3_ratio_max",
                "fig4_lofast_M_over_pgd_max"):
        if key in m:
            rows.append(row(key, key.replace("_", " "), m[key], "ratio"))
    return rows


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: the largest LoFAST(M) / PGD ratio of Table 3."""
    return numbers(ratio=m.get("max_lofast_M_over_pgd"))
