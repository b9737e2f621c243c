"""The text stage's tables: OLSA beside its depth-0 control (:func:`versus_depth0`), the
paper numbers beside a model (:func:`paper_reference`), the other datasets' table."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import pandas as pd

from attncert.figures import text as figs
from attncert.report import paper
from attncert.text.jobs import STUDY, UNITS, dataset_jobs, text_datasets

if TYPE_CHECKING:  # the stage's section, for annotations only
    from attncert.text.params import Params

#: model names as :func:`dataset_jobs` builds them: "olsa-L<depth>-g<gamma>" is OLSA (with
#: "-averaged": OLSA's own residual); the attention sweep's "-alpha1-<a>" is not
OLSA_NAME = re.compile(r"olsa-L(\d+)-g[0-9.]+(-averaged)?$")
#: the depth of OLSA's headline model (OLSA section 5: a 3-layer OLSA on SST and Yelp)
OLSA_PAPER_DEPTH = 3


def paper_reference(dataset: str, model: str, olsa_depth: int | None) -> tuple[float, str] | None:
    """OLSA's abstract number for a model of the stage on ``dataset`` (average radius, its
    own embedding space), or None: the 3-layer OLSA on Yelp, the OLSA head over frozen BERT-base
    on QQP (SST-2's 3-layer OLSA: :func:`attncert.stages.text.headline_rows`)."""
    if dataset == "yelp_polarity" and olsa_depth == OLSA_PAPER_DEPTH:
        return (paper.OLSA_AVG_RADIUS["yelp"],
                f"OLSA abstract ({OLSA_PAPER_DEPTH}-layer OLSA, Yelp; softmax constant "
                f"{paper.OLSA_SOFTMAX_LIPSCHITZ:g}: unsound, ours 1/2; Shi et al.: "
                f"{paper.OLSA_SHI_AVG_RADIUS['yelp']:g})")
    if dataset == "qqp" and model == "frozen-olsa":
        return (paper.OLSA_FROZEN_BERT_QQP["olsa"],
                "OLSA abstract (OLSA head over frozen BERT-base, QQP, BERT's embedding space; "
                f"Shi et al.: {paper.OLSA_FROZEN_BERT_QQP['shi']:g})")
    return None



def datasets_table(entries: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """One row per model of every dataset beyond SST-2: accuracy on the reported split, the
    average radius (the three rules; best variant), certified accuracy per eps, broken
    certificates, OLSA's number beside where it reports one; one row per unavailable
    dataset saying why."""
    rows = []
    for dataset, e in entries.items():
        if "unavailable" in e:
            rows.append({"dataset": dataset, "model": "-", "status": f"unavailable: "
                                                                      f"{e['unavailable']}"})
            continue
        for name, r in e["models"].items():
            match = OLSA_NAME.match(name)
            ref = paper_reference(dataset, name, int(match.group(1)) if match else None)
            best = max(r["avg_radius"], key=r["avg_radius"].get)
            rows.append({"dataset": dataset, "model": name, "status": "run",
                         "split": e["reported_split"], "test_acc": r["test_acc"],
                         "avg_radius": r["avg_radius"][best],
                         "avg_radius_correct": r["avg_radius_correct"][best],
                         "avg_radius_invariant": r["avg_radius_invariant"][best],
                         **{f"cert@{k}": v for k, v in r["certified_acc"].items()},
                         "broken": r["broken"],
                         "paper_avg_radius": ref[0] if ref else None})
    return pd.DataFrame(rows)



def versus_depth0(olsa_rows: pd.DataFrame, depth0: str, reported: str
                   ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(every OLSA-family model against the depth-0 baseline: differences in test accuracy
    and average radius (both rules); the attention models among them; the verdict line)."""
    versus = olsa_rows.assign(
        d_test_acc=olsa_rows["test_acc"] - olsa_rows.loc[depth0, "test_acc"],
        d_avg_radius=olsa_rows["avg_radius"] - olsa_rows.loc[depth0, "avg_radius"],
        d_avg_radius_correct=(olsa_rows["avg_radius_correct"]
                              - olsa_rows.loc[depth0, "avg_radius_correct"]))[
        ["test_acc", "d_test_acc", "avg_radius", "d_avg_radius", "avg_radius_correct",
         "d_avg_radius_correct", "attn_ratio", "b_att", "alpha1"]]
    attention_models = versus.drop(index=[depth0, "frozen-olsa"], errors="ignore")
    best_acc, best_radius = (attention_models["d_test_acc"].idxmax(),
                             attention_models["d_avg_radius"].idxmax())
    verdict = (
        f"Over the depth-0 baseline ({versus.loc[depth0, 'test_acc']:.3f} {reported} accuracy, "
        f"average radius {versus.loc[depth0, 'avg_radius']:.3f}), the best attention model in "
        f"accuracy is {best_acc} ({attention_models.loc[best_acc, 'd_test_acc']:+.3f}) and in "
        f"average radius {best_radius} "
        f"({attention_models.loc[best_radius, 'd_avg_radius']:+.3f}).")
    return versus, attention_models, verdict


def study_tables(p: Params, table: pd.DataFrame, curves: pd.DataFrame, reported: str):
    """The SST-2 study's tables and figures from its models' rows (``table``,
    :func:`attncert.text.evaluate.attention_table`) and certified-accuracy curves: (the
    depth-0 control's name, OLSA versus it, the attention models' differences, the verdict,
    the paper beside ours, the gamma ablation, {file name: figure})."""
    deep, shallow = max(p.olsa.depths), min(p.olsa.depths)
    depth0 = f"olsa-L0-g{p.gamma:g}"
    olsa_rows = table[table["family"] == "olsa"].set_index("model")
    versus, attention_models, verdict = versus_depth0(olsa_rows, depth0, reported)
    paper_vs_ours = pd.DataFrame([
        {"source": "OLSA paper, 3-layer OLSA (softmax constant 1/4: unsound)",
         "avg_radius_invariant": paper.OLSA_AVG_RADIUS["sst"]},
        {"source": "OLSA paper, Shi et al.",
         "avg_radius_invariant": paper.OLSA_SHI_AVG_RADIUS["sst"]},
        *[{"source": f"ours, {name} (constant 1/2)",
           "avg_radius_invariant": olsa_rows.loc[name, "avg_radius_invariant"],
           "avg_radius": olsa_rows.loc[name, "avg_radius"],
           "avg_radius_correct": olsa_rows.loc[name, "avg_radius_correct"],
           "test_acc": olsa_rows.loc[name, "test_acc"]}
          for name in (f"olsa-L{d}-g{p.gamma:g}"
                       for d in (0, *p.olsa.depths, *p.olsa.deep_depths))]])
    ablation = olsa_rows.loc[[f"olsa-L{shallow}-g{g:g}" for g in sorted({*p.gamma_ablation,
                                                                         p.gamma})],
                             ["dev_acc", "test_acc", "avg_radius", "avg_radius_correct"]]
    sweep = olsa_rows.loc[[depth0, f"olsa-L{deep}-g{p.gamma:g}",
                           *[n for n in olsa_rows.index if "-alpha1-" in n or
                             n.endswith("-averaged")]]].reset_index()
    certified = curves[curves["variant"] != "none"]  # the standard transformer: no certificate
    figures = {
        "lofast_certified.png": figs.plot_certified_vs_eps(
            curves[curves["model"].str.startswith("lofast")], "LoFAST small-BERT grid on SST-2"),
        "olsa_certified.png": figs.plot_certified_vs_eps(
            certified[~certified["model"].str.startswith("lofast")],
            "OLSA, Kim-L2 and frozen-encoder OLSA on SST-2"),
        "accuracy_radius.png": figs.plot_accuracy_vs_radius(table),
        "attention_sweep.png": figs.plot_attention_tradeoff(sweep)}
    return depth0, versus, attention_models, verdict, paper_vs_ours, ablation, figures


@dataclass
class Result:
    """What the notebook shows. ``data``: the SST-2 source, split sizes, reported split,
    vocabulary size, certified and attacked counts, device; ``audits``: {model: audit rows}
    for :func:`attncert.soundness.require_sound`; ``figures``: {file name: figure}, saved."""

    data: dict[str, Any]
    jobs: pd.DataFrame
    table: pd.DataFrame
    audit: pd.DataFrame
    audits: dict[str, list[dict[str, Any]]]
    versus: pd.DataFrame
    verdict: str
    paper_vs_ours: pd.DataFrame
    ablation: pd.DataFrame
    figures: dict[str, Any]
    datasets: dict[str, dict[str, Any]]  # Yelp, QQP: their metrics entry or why unavailable
    datasets_table: pd.DataFrame  # :func:`datasets_table`
    seconds: float


def merge_records(p: Params, records: Mapping[str, Mapping[str, Any]]):
    """Every unit's record merged in :func:`attncert.text.jobs.dataset_jobs` order, whichever
    unit ran a job: (SST-2's data, results, curves, audits (every dataset's), the other datasets'
    entries, the jobs' rows, the frozen head's training sentences)."""
    study = [records[u] for u in UNITS if u.startswith(f"{STUDY}-")]
    data = study[0]["data"]
    order = list(dataset_jobs(p, data["vocab"]))  # dataset_jobs() order, whichever unit ran a job
    results = {n: r for rec in study for n, r in rec["results"].items()}
    results = {n: results[n] for n in order}
    curves = sorted((c for rec in study for c in rec["curves"]),
                    key=lambda c: order.index(c["model"]))
    audits = {n: rows for rec in study for n, rows in rec["audits"].items()}
    audits = {n: audits[n] for n in order}
    others = {}
    for name in text_datasets(p):
        if name != STUDY:
            others[name] = records[name]["entry"]
            audits |= records[name]["audits"]
    frozen_train = max(rec["data"]["frozen_train"] for rec in study)
    todo_rows = sorted((j for rec in study for j in rec["jobs"]),
                       key=lambda j: order.index(j["model"]))
    return data, results, curves, audits, others, todo_rows, frozen_train
