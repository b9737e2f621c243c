"""The record of the CertViT stage's steps (:mod:`attncert.stages.certvit`).

* :class:`StepLog`: accuracy, Lipschitz bound and seconds through the steps (pretrained,
  adapted, adapt-finetuned, constrained, finetuned), one log per constraining mode;
  :func:`mode_steps` puts the modes side by side;
* :func:`stage_metrics`: one mode's part of the stage's metrics file (:func:`baseline_metrics`:
  the linear baseline's); :func:`samples_frame`:
  the certificate of every point;
* :class:`Result`: everything the stage's report shows, filled step by step.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import pandas as pd
import torch
from torch import nn

from attncert.certvit.certificate import GlobalBound
from attncert.training.train import evaluate

__all__ = ["BASELINE", "Result", "StepLog", "baseline_metrics", "mode_steps",
           "samples_frame", "stage_metrics"]

#: the linear baseline's mode name in samples.csv and the reports
BASELINE = "linear baseline (pixels)"


def mode_steps(logs: Mapping[str, StepLog]):
    """pandas DataFrame: one row per step, for each mode its clean accuracy (%), the
    certificate's constant (features x pairwise head rows) and the features' bound."""
    frames = []
    for mode, log in logs.items():
        f = log.frame().set_index("step")
        frames.append(pd.DataFrame({
            (mode, "clean (%)"): 100 * f["clean_acc"],
            (mode, "bound (pairwise)"): f["lipschitz_pairwise"],
            (mode, "bound (features)"): f["lipschitz_features"]}))
    return pd.concat(frames, axis=1)


@dataclass
class StepLog:
    """Clean accuracy, Lipschitz bound (pixels -> logits, pixels -> features, and the
    certificate's pairwise constant) and seconds of each step of the stage, in order."""

    rows: list[dict] = field(default_factory=list)

    def add(self, step: str, model: nn.Module, test: Any, seconds: float,
            bound: GlobalBound | None = None, device: str | torch.device = "cpu",
            batch_size: int = 500, note: str = "") -> dict:
        """Evaluate ``model`` on ``test`` and record the step; returns its row."""
        if step in {r["step"] for r in self.rows}:
            raise ValueError(f"step {step!r} recorded twice")
        row = {"step": step, "clean_acc": evaluate(model, test, device, batch_size)["acc"],
               "lipschitz": bound.logits if bound else None,
               "lipschitz_features": bound.features if bound else None,
               "lipschitz_pairwise": bound.pairwise if bound else None,
               "seconds": float(seconds), "note": note}
        self.rows.append(row)
        return row

    def frame(self):
        """pandas DataFrame, one row per step."""
        return pd.DataFrame(self.rows,
                            columns=["step", "clean_acc", "lipschitz", "lipschitz_features",
                                     "lipschitz_pairwise", "seconds", "note"])

    def column(self, key: str) -> dict[str, Any]:
        return {r["step"]: r[key] for r in self.rows}


def stage_metrics(log: StepLog, bounds: Mapping[str, GlobalBound], report: Mapping[str, Any],
                  seconds: Mapping[str, float] | None = None,
                  reference: str = "adapt_finetuned") -> dict[str, Any]:
    """The stage's metrics: accuracy and seconds per step (plus the other timed parts in
    ``seconds``), the Lipschitz bounds and their reductions relative to ``reference`` (the
    model Douglas-Rachford starts from: reference bound / bound), and the certificate
    ``report`` of :func:`attncert.certvit.certify` (with its PGD audit)."""
    if reference not in bounds:
        raise ValueError(f"no bound labelled {reference!r}; have {sorted(bounds)}")
    ref = bounds[reference]
    timings = {**log.column("seconds"), **(seconds or {})}
    return {
        "clean_acc": log.column("clean_acc"),
        "seconds": timings,
        "total_seconds": sum(timings.values()),
        "lipschitz": {k: b.logits for k, b in bounds.items()},
        "lipschitz_features": {k: b.features for k, b in bounds.items()},
        "lipschitz_pairwise": {k: b.pairwise for k, b in bounds.items()},
        "lipschitz_reduction": {k: ref.logits / b.logits for k, b in bounds.items()
                                if k != reference},
        "lipschitz_features_reduction": {k: ref.features / b.features
                                         for k, b in bounds.items() if k != reference},
        "n_test": len(report["correct"]),
        "test_clean_acc": report["clean_acc"],
        "certified_acc": {str(e): a for e, a in report["certified_acc"].items()},
        **_attacked(report),
        "median_radius": median_radius(report),
        "seconds_per_sample": report["seconds_per_sample"],
    }


def median_radius(report: Mapping[str, Any]) -> float:
    """The median certified radius of a :func:`attncert.certvit.certify` report, a misclassified
    point counting 0 (its radius is the wrong prediction's: no certificate of the label)."""
    r = report["radius"]
    return float(torch.where(report["correct"], r, torch.zeros_like(r)).median())


def baseline_metrics(report: Mapping[str, Any], train_seconds: float) -> dict[str, Any]:
    """The linear baseline's part of the metrics file (:func:`attncert.certvit.certify_linear`'s
    report and its training seconds)."""
    return {"clean_acc": report["clean_acc"],
            "certified_acc": {str(e): a for e, a in report["certified_acc"].items()},
            **_attacked(report), "train_seconds": train_seconds}


def _attacked(report: Mapping[str, Any]) -> dict[str, Any]:
    """The audit's part of a metrics entry: how many points PGD attacked (the first ones),
    PGD accuracy and the certified accuracy on those points, broken certificates."""
    return {"n_attacked": int(report["n_attacked"]),
            "pgd_acc": {str(e): a for e, a in report["pgd_acc"].items()},
            "attacked_certified_acc": {str(e): a for e, a
                                       in report["attacked_certified_acc"].items()},
            "broken": int(report["broken"])}


def samples_frame(reports: Mapping[str, Mapping[str, Any]], y: torch.Tensor) -> pd.DataFrame:
    """One row per mode and certified point (the first ``len(y)`` test images): label,
    prediction, correct, certified radius (:func:`attncert.certvit.certify`'s reports)."""
    return pd.concat([pd.DataFrame({"mode": m, "index": range(len(y)),
                                    "label": y.cpu().numpy(),
                                    "prediction": rep["prediction"].numpy(),
                                    "correct": rep["correct"].numpy(),
                                    "radius": rep["radius"].numpy()})
                      for m, rep in reports.items()], ignore_index=True)


@dataclass
class Result:
    """What the notebook shows: the models' steps, bounds, certificates and metrics."""

    device: torch.device
    data: dict  # the processed dataset
    origin: str  # where the pre-trained model comes from
    pretrained: torch.nn.Module
    modes: list[str]
    logs: dict[str, StepLog]
    bounds: dict[str, dict]  # mode -> step -> GlobalBound
    diagnostics: pd.DataFrame | None = None  # Douglas-Rachford, one row per map and mode
    lipschitz: pd.DataFrame | None = None  # the bound per component, mode and step
    reports: dict[str, dict] | None = None  # mode -> attncert.certvit.certify's report
    baseline: dict | None = None  # the linear baseline's certify_linear report
    baseline_status: str = ""
    metrics: dict | None = None

    @property
    def headline(self) -> str:
        """The mode the headline numbers come from: the certifiable one when it runs."""
        return self.modes[-1]

    @property
    def test(self) -> dict:
        return {"x": self.data["test"]["x"], "y": self.data["test"]["y"]}

    def with_baseline(self) -> dict[str, dict]:
        """Every mode's certificate report and the linear baseline's."""
        return {**self.reports, BASELINE: self.baseline}

    def pairwise(self) -> pd.DataFrame:
        """The certificate's constant (features x max ||w_j - w_k||) per step and mode."""
        return pd.DataFrame({m: {k: b.pairwise for k, b in self.bounds[m].items()}
                             for m in self.modes})

    def bound_notes(self) -> list[str]:
        """Per mode (Markdown): how far constraining and the whole run lower the features'
        bound below the model Douglas-Rachford starts from, and the clean accuracy before
        constraining, constrained and after the fine-tune."""
        notes = []
        for m in self.modes:
            b, acc = self.bounds[m], self.logs[m].column("clean_acc")
            start = b["adapt_finetuned"].features
            notes.append(
                f"**{m}:** the bound falls {start / b['constrained'].features:.3g}x by "
                f"constraining and ends {start / b['final'].features:.3g}x below the model "
                f"Douglas-Rachford starts from (features); clean accuracy "
                f"{100 * acc['adapt_finetuned']:.1f}% before constraining, "
                f"{100 * acc['constrained']:.1f}% constrained, {100 * acc['finetuned']:.1f}% "
                "after the fine-tune.")
        return notes

    def baseline_note(self, cert_eps: list[float]) -> str:
        """The linear baseline's clean and certified accuracy (Markdown) and the eps at which
        the headline mode's ViT certifies more than it."""
        base, ours = self.baseline, self.reports[self.headline]
        above = [str(e) for e in cert_eps
                 if ours["certified_acc"][e] > base["certified_acc"][e]]
        return (f"**Trivial baseline** (a linear classifier on pixels, exact radius; "
                f"{self.baseline_status}): clean {100 * base['clean_acc']:.1f}%, certified "
                + ", ".join(f"{100 * base['certified_acc'][e]:.1f}% at {e}" for e in cert_eps)
                + f". The {self.headline} ViT is above it at eps "
                + (", ".join(above) or "none") + ".")

    def certified_table(self) -> pd.DataFrame:
        """Certified accuracy (%) on every certified image and on the attacked ones, and PGD
        accuracy on those, per eps (rows) for every mode and the baseline (column groups)."""
        n_cert = len(self.reports[self.headline]["correct"])
        n_att = self.reports[self.headline]["n_attacked"]
        return pd.concat({m: pd.DataFrame({
            f"certified, {n_cert} (%)": {e: 100 * a for e, a in r["certified_acc"].items()},
            f"certified, first {n_att} (%)": {e: 100 * a for e, a
                                              in r["attacked_certified_acc"].items()},
            f"PGD, first {n_att} (%)": {e: 100 * a for e, a in r["pgd_acc"].items()}})
            for m, r in self.with_baseline().items()}, axis=1).rename_axis("eps")

    def attention_table(self) -> pd.DataFrame:
        """Per mode, on the certified images: the attention rows' entropy / log n, clean
        accuracy (%) with the trained, uniform and identity attention and the points lost
        each way (:func:`attncert.diagnostics.attention_diagnostics`)."""
        return pd.DataFrame({m: {
            "entropy / log n": r["attention"]["entropy_mean"],
            "clean %": 100 * r["attention"]["acc"],
            "uniform %": 100 * r["attention"]["acc_uniform"],
            "identity %": 100 * r["attention"]["acc_identity"],
            "uniform gap": r["attention"]["uniform_gap"],
            "identity gap": r["attention"]["identity_gap"]}
            for m, r in self.reports.items()}).T.round(4)

    def audit_note(self, attack_steps: int, attack_restarts: int) -> str:
        """The soundness audit in one line (Markdown): the broken certificates counted over
        every mode and the baseline, and each mode's median certified radius."""
        broken = sum(int(r["broken"]) for r in self.with_baseline().values())
        eps = len(self.reports[self.headline]["pgd_acc"])
        return (f"**Soundness audit:** {broken} broken certificates over {eps} eps values in "
                f"{len(self.modes)} mode(s) and the baseline ({attack_steps} PGD steps, "
                f"{attack_restarts} restart(s)); median certified radius "
                + ", ".join(f"{m} {median_radius(self.reports[m]):.3g}"
                            for m in self.modes) + ".")
