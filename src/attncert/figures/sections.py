"""The figures stage's report, section by section: each function takes the stage's
:class:`attncert.stages.figures.Result` and returns what its section shows, in order
(:data:`Part`: Markdown text, a figure with the PNG it is saved to, or a table), computed here
so that ``notebooks/10_figures.py`` only displays them (:func:`show_parts`). A stage whose
metrics are missing shows its note instead."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
from matplotlib.figure import Figure

from attncert.figures import frontier as frontier_figs
from attncert.figures import summary as figs

if TYPE_CHECKING:
    from attncert.stages.figures import Result

#: one displayed item: Markdown, a figure (with the PNG path it is saved to, or None), a table
Part = str | tuple[Figure, Path | None] | pd.DataFrame


def _noted(res: Result, stage: str) -> list[Part] | None:
    """The stage's note (its metrics are missing) as the section's only part, else None."""
    note = res.note(stage)
    return [note] if note else None


def _headline(rows: Sequence[dict], title: str) -> list[Part]:
    fig = figs.plot_headline(rows, title)
    return ([] if fig is None else [(fig, None)]) + [figs.headline_frame(rows)]


def overview(res: Result, scale: str) -> list[Part]:
    """The scale, the stage runs declared in dvc.yaml, and each stage's status."""
    return [f"**Scale** {scale}: {len(res.runs)} stage runs declared in dvc.yaml.",
            pd.DataFrame([{"stage": name, "status": e["status"],
                           "metrics read": len(e["metrics"]), "missing": len(e["missing"])}
                          for name, e in res.summary["stages"].items()])]


def tightness(res: Result) -> list[Part]:
    """LoFAST Table 3 and Figures 3-4: every bound over PGD on one attention layer."""
    if (noted := _noted(res, "tightness")) is not None:
        return noted
    m = res.metrics("tightness")["tightness"]
    tight = figs.tightness_frame(m)
    parts: list[Part] = [(figs.plot_tightness(tight),
                          res.key_figure(1, "tightness_of_every_bound"))]
    fig3, fig4 = figs.ablation_frames(m)
    if len(fig3) or len(fig4):
        parts.append((figs.plot_ablations(fig3, fig4, m.get("fig3_eps")), None))
    parts.append(tight.pivot_table(index="eps", columns=["source", "method"],
                                   values="ratio").round(4))
    parts.append(figs.headline_frame([r for r in res.rows("tightness")
                                      if r["key"].endswith("_max")]))
    return parts


def certified_grid(res: Result) -> list[Part]:
    """Certified accuracy vs eps of every grid point (LoFAST Figure 2's analog; it prints no
    numbers to set beside), then certified vs clean accuracy across the grid."""
    parts: list[Part] = list(_noted(res, "certify_vit") or [])
    points = res.metrics("certify_vit")
    if not points:
        return parts
    long = res.certified
    parts.append((figs.plot_certified_grid(long),
                  res.key_figure(2, "certified_accuracy_vs_eps")))
    parts.append(long[long.test != "logit"].pivot_table(
        index=["run", "variant"], columns="eps", values="accuracy").mul(100).round(1))
    parts.append((figs.plot_tradeoff(figs.tradeoff_frame(points)),
                  res.key_figure(3, "certified_vs_clean_accuracy")))
    return parts


def baselines(res: Result) -> list[Part]:
    """Each grid point beside the linear baseline and the frontier's rows."""
    if res.beside is not None and len(res.beside):
        return [res.beside.set_index(["point", "model"]).round(1)]
    return [res.note("certify_vit") or "(no grid point certified yet)"]


def frontier(res: Result) -> list[Part]:
    """Certified vs clean accuracy per training setting on the validation split; certified
    accuracy against the points lost with uniform attention (does the attention matter?)."""
    front = res.metrics("frontier").get("frontier")
    if not front:
        return [res.note("frontier") or "(the frontier stage has not run)"]
    table = pd.DataFrame(front["rows"])
    parts: list[Part] = [
        (frontier_figs.plot_frontier(table, front["eps"], front["select_eps"]),
         res.key_figure(4, "frontier_per_training_setting"))]
    if "uniform_gap" in table:
        parts.append((frontier_figs.plot_attention(table, front["select_eps"],
                                                   front["min_attention_gap"],
                                                   min(front["eps"])),
                      res.key_figure(5, "certified_accuracy_vs_attention_gap")))
    sel = front["selected"]
    parts.append(f"Selected on validation, attention counted (a setting must lose at least "
                 f"{front.get('min_attention_gap', 0):g} points with uniform attention on "
                 f"every dataset): `{sel}`" if sel else
                 "No certified setting's attention changes predictions (every one loses under "
                 f"{front.get('min_attention_gap', 0):g} points with uniform attention on some "
                 "dataset): none is selected with attention counted")
    parts.append(f"Selected with attention not counted: `{front.get('selected_any', sel)}`; the "
                 f"grid trains with `{front['grid_setting']}`.")
    if front.get("targets"):
        parts.append(pd.DataFrame(front["targets"]).set_index(["dataset", "setting"]).round(3))
    return parts


def cost(res: Result) -> list[Part]:
    """Certification seconds per sample: the grid's (mean and range), the crown stage's."""
    points, crown = res.metrics("certify_vit"), res.metrics("crown").get("crown")
    if not (points or crown):
        return []
    frame = figs.cost_frame(points, crown)
    return [(figs.plot_cost(frame), None),
            frame.groupby(["source", "method"])["seconds"].agg(["mean", "min", "max"])]


def specformer(res: Result) -> list[Part]:
    """SpecFormer Tables 1-3: robust accuracy per run and attack, the other headline rows."""
    if (noted := _noted(res, "specformer")) is not None:
        return noted
    spec = figs.specformer_frame(res.metrics("specformer")["specformer"])
    return [(figs.plot_specformer(spec), None),
            spec.pivot_table(index=["training", "method"],
                             columns=["source", "dataset", "attack"], values="accuracy").round(1),
            figs.headline_frame([r for r in res.rows("specformer")
                                 if not r["key"].startswith("robustness/")])]


def text(res: Result) -> list[Part]:
    """The text stage's certified accuracy vs eps (LoFAST Figure 5's analog) and its rows,
    OLSA's SST radius beside ours."""
    if (noted := _noted(res, "text")) is not None:
        return noted
    curves = figs.text_certified_frame(res.metrics("text")["text"])
    parts: list[Part] = []
    if not curves.empty:
        parts.append((figs.plot_text_certified(curves),
                      res.key_figure(6, "text_certified_accuracy")))
    rows = res.rows("text")
    fig = figs.plot_headline(rows, "OLSA's SST radius beside ours")
    if fig is not None:
        parts.append((fig, None))
    return parts + [figs.headline_frame(rows, brief_only=len(rows) > 40)]


def crown(res: Result) -> list[Part]:
    """LoFAST Tables 1-2: LoFAST vs CROWN, and LoFAST first with CROWN on the rest."""
    if (noted := _noted(res, "crown")) is not None:
        return noted
    return [(figs.plot_crown(figs.crown_frame(res.metrics("crown").get("crown"))),
             res.key_figure(7, "lofast_vs_crown")),
            figs.headline_frame(res.rows("crown"))]


def certvit(res: Result) -> list[Part]:
    """CertViT's Table 1 beside ours."""
    if (noted := _noted(res, "certvit")) is not None:
        return noted
    return _headline(res.rows("certvit"), "CertViT Table 1 beside ours")


def show_parts(parts: Sequence[Any]) -> None:
    """Display a section's parts in a notebook (figures once, saved where a path is given)."""
    from IPython.display import Markdown, display

    from attncert.figures import show

    for part in parts:
        if isinstance(part, str):
            display(Markdown(part))
        elif isinstance(part, tuple):
            show(*part)
        else:
            display(part)
