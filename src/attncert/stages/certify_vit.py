"""The certify_vit stage: every bound variant and certificate test on one trained grid point.

The first ``n_test`` test images, in float64: certified radii per variant and test
(:func:`attncert.certify.certify_table`), then L2 PGD at every eps on every correct point
(:func:`attncert.certify.audit`): the empirical robust accuracy and the soundness audit. The
point's results folder receives ``samples.csv`` (one row per test point), ``metrics.json``
(:func:`attncert.certify.summarize`) and ``certified.png``; a broken certificate then fails the
stage (:func:`attncert.soundness.require_sound`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import pandas as pd
import torch

from attncert import certify, paper, soundness
from attncert.data import as_float, load_processed
from attncert.figures import vit as figs
from attncert.headline import eps_match, row
from attncert.io import atomic_path, write_json
from attncert.models import ViTConfig
from attncert.models.vit import load_vit
from attncert.params import BaseParams, one_of, one_of_numbers, param, positive, unique
from attncert.runs import GridPoint


@dataclass(frozen=True)
class Params:
    """params.yaml ``certify_vit``."""

    n_test: int = param(positive, doc="first n test images (the same points for every variant)")
    cert_batch_size: int = param(positive)
    variants: list[str] = param(one_of(*certify.VARIANTS), unique)
    tests: list[str] = param(one_of(*certify.TESTS), unique)
    cert_softmax_lipschitz: float = param(one_of_numbers(0.5, 1.0))
    max_radius: float = param(positive)
    cert_eps: list[float] = param(positive, unique)
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    results_dir: str = param()


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


def certvit_reference(dataset: str) -> dict[str, Any] | None:
    """CertViT's MNIST claim, labelled for the certified-accuracy figure (MNIST only)."""
    if dataset != "mnist":
        return None
    c = paper.CERTVIT_MNIST
    return {**c, "label": f"CertViT claim: {c['certified']}% at eps {c['eps']} "
                          f"(its eps is not pixel-space)"}


def run(p: Params, base: BaseParams, point: GridPoint, processed_dir: str,
        device: torch.device) -> Certified:
    """Certify, attack and audit the point's model; write its results (a broken certificate
    raises :class:`attncert.soundness.UnsoundCertificateError` after they are written)."""
    out_dir = Path(p.results_dir) / point.name
    model = load_vit(point.run_dir / "model.pt", device).double()
    data = load_processed(point.dataset, processed_dir)
    n = min(p.n_test, len(data["test"]["y"]))
    x = as_float(data["test"]["x"][:n]).double().to(device)
    y = data["test"]["y"][:n].to(device)
    table = certify.certify_table(model, x, y, p.variants, p.tests, p.cert_softmax_lipschitz,
                                  p.max_radius, p.cert_batch_size)
    radii = {f"{v}_{t}": torch.tensor(table[f"radius_{v}_{t}"].to_numpy())
             for v in p.variants for t in p.tests}
    torch.manual_seed(base.seed)
    rows, attacked = certify.audit(model, x, y, radii, p.cert_eps, p.attack_steps,
                                   p.attack_restarts, base.seed, p.cert_batch_size,
                                   progress=True)
    for e, success in zip(p.cert_eps, attacked, strict=True):
        table[f"pgd_adversarial_at_{e}"] = success.numpy()
    summary = certify.summarize(table, rows, p.cert_eps, p.variants, p.tests)
    samples = out_dir / "samples.csv"
    with atomic_path(samples) as tmp:
        table.to_csv(tmp, index=False)
    write_json(out_dir / "metrics.json", {"run": point.name, "dataset": point.dataset, **summary})
    soundness.require_sound({point.name: rows},
                            {k: (accs, summary["pgd_acc"])
                             for k, accs in summary["certified_acc"].items()},
                            see=str(samples))
    long = certify.long_certified_accuracy(summary)
    fig = figs.plot_certified(long, f"{point.name}: certified accuracy",
                              certvit_reference(point.dataset))
    with atomic_path(out_dir / "certified.png") as tmp:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    plt.close(fig)  # shown once, by the notebook
    return Certified(point.name, point.dataset, n, model.config, table, pd.DataFrame(rows),
                     summary, long, fig, samples)


def certvit_comparison(c: Certified) -> pd.DataFrame | None:
    """CertViT's MNIST row (clean, PGD, certified at its eps, in percent) beside ours; None
    unless the point is MNIST and its eps is among ``cert_eps``."""
    e_cv = str(paper.CERTVIT_MNIST["eps"])
    if c.dataset != "mnist" or e_cv not in c.summary["pgd_acc"]:
        return None
    ours = {"clean": 100 * c.summary["clean_acc"], "pgd": 100 * c.summary["pgd_acc"][e_cv]}
    ours.update({f"certified {k}": 100 * v[e_cv]
                 for k, v in c.summary["certified_acc"].items()})
    cv = paper.CERTVIT_MNIST
    return pd.DataFrame({"CertViT (paper, ViT)": pd.Series({
        "clean": cv["clean"], "pgd": cv["pgd"], "certified (its test)": cv["certified"]}),
        f"ours ({c.name})": pd.Series(ours)}).round(1)


def _lofast_table1(item: Mapping, eps: str) -> float | None:
    t1 = paper.LOFAST_TABLE1
    i = eps_match(eps, t1["eps"])
    if item.get("dataset") != "cifar10" or item.get("depth") not in t1["lofast"] or i is None:
        return None
    return t1["lofast"][item["depth"]][i] / 100


def _certvit_claim(dataset: str | None, eps: str) -> tuple[Mapping, str] | None:
    """CertViT's Table 1 row for ``dataset`` (MNIST or CIFAR-10) and its name, if ``eps`` is
    its eps."""
    ref = {"mnist": (paper.CERTVIT_MNIST, "CertViT Table 1 (MNIST)"),
           "cifar10": (paper.CERTVIT_CIFAR10, "CertViT Table 1 (CIFAR-10)")}.get(dataset or "")
    return ref if ref and eps_match(eps, [ref[0]["eps"]]) is not None else None


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Clean, PGD and certified accuracy per eps (LoFAST(M) pairwise beside LoFAST Table 1
    or CertViT's claim), seconds per sample, cost per forward pass, broken certificates."""
    rows = [row("clean_acc", "clean accuracy", m["clean_acc"], "fraction", brief=True)]
    for eps, acc in m.get("pgd_acc", {}).items():
        rows.append(row(f"pgd_acc/{eps}", f"L2 PGD accuracy at eps {eps}", acc, "fraction"))
    for key, accs in m.get("certified_acc", {}).items():
        headline = key == "lofast_M_pairwise"
        for eps, acc in accs.items():
            ref, src = (_lofast_table1(item, eps), "LoFAST Table 1") if headline else (None, None)
            claim = _certvit_claim(item.get("dataset"), eps) if headline else None
            if ref is None and claim is not None:
                ref, src = claim[0]["certified"] / 100, claim[1]
            rows.append(row(f"certified_acc/{key}/{eps}", f"certified {key} at eps {eps}", acc,
                             "fraction", ref, src, brief=headline))
    depth_ref = paper.LOFAST_TABLE1["lofast_seconds"].get(item.get("depth"))
    for key, s in m.get("seconds_per_sample", {}).items():
        ref = depth_ref if key == "lofast_M_pairwise" and item.get("dataset") == "cifar10" else None
        rows.append(row(f"seconds_per_sample/{key}", f"seconds per sample {key}", s, "seconds",
                         ref, "LoFAST Table 1", brief=key == "lofast_M_pairwise"))
    for key, c in m.get("cost_vs_forward", {}).items():
        rows.append(row(f"cost_vs_forward/{key}", f"cost / forward pass {key}", c, "ratio"))
    if "broken" in m:
        rows.append(row("broken", "broken certificates", m["broken"], "count"))
    return rows
