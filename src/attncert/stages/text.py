"""The text stage: sentiment transformers on SST-2, every one certified in the same space of
word embeddings of norm 2 (the frozen-encoder head in its encoder's output space).

One job per model: OLSA at depth 0 (no attention) and at every depth (``olsa.depths``, OLSA
Table 1; ``olsa.deep_depths`` on SST-2 only, its Table 9), the gamma ablation of the shallowest
OLSA (its Table 2), the attention sweep of the deepest (and OLSA's averaged residual when the
main runs use the gated one), Kim et al.'s L2 attention, a standard transformer of the same
size, LoFAST's small-BERT grid and an OLSA head over a frozen encoder. The jobs run in
independent units (:data:`UNITS`, each one DVC stage: several GPUs share the stage), each job
resumably in ``results_dir/ckpt/<unit>/<name>``; :func:`run` runs one or gathers them.
Every job gets the same read-out
(:func:`attncert.text.evaluate.evaluate_model`); the PGD audit's rows are checked by
:func:`attncert.soundness.require_sound` in each unit and again when they are gathered.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from attncert import soundness
from attncert.pipeline.context import Context
from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.jobs import Job
from attncert.pipeline.params import (
    BaseParams,
    StudyParams,
)
from attncert.pipeline.records import SplitRun, gathered, read_record, unit_key
from attncert.report import paper
from attncert.report.headline import numbers, row, scale_caveat
from attncert.text import plan
from attncert.text.evaluate import attention_table
from attncert.text.jobs import STUDY, UNITS, dataset_jobs, text_datasets, unit_jobs
from attncert.text.params import Params
from attncert.text.study import other_dataset, settings, sst2_unit
from attncert.text.tables import (
    OLSA_NAME,
    OLSA_PAPER_DEPTH,
    Result,
    datasets_table,
    merge_records,
    paper_reference,
    study_tables,
)
from attncert.text.tokenize import load_tokenizer

#: this module's params.yaml section
SECTION = "text"


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.text.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return plan.jobs(params)


# -- the plan --------------------------------------------------------------------------------




def units(p: Params) -> list[str]:
    """The stage's units (:data:`UNITS`: the same at every scale; a unit whose dataset the
    scale leaves out records it as unavailable), one DVC stage each."""
    return list(UNITS)


def unit_stage(p: Params, unit: str) -> str:
    """The DVC stage that runs ``unit`` of :func:`units` (dvc.yaml)."""
    return f"text_unit@{unit}"


def unit_file(p: Params, unit: str) -> Path:
    """Where :func:`_run_unit` writes the unit's record (JSON)."""
    return Path(p.results_dir) / "units" / f"{unit}.json"


def run(p: Params, ctx: Context) -> SplitRun[Result]:
    """``ctx.item``: one unit of :data:`UNITS` (:func:`_run_unit`: its record); ``None``: the
    gathering stage (:func:`_gather`: what the notebook shows). Both return a
    :class:`attncert.pipeline.records.SplitRun` (the record or metrics as written; the gathering
    stage's :class:`Result`)."""
    if ctx.item is None:
        return gathered(p.metrics, _gather(p, ctx))
    return SplitRun(ctx.item, _run_unit(p, ctx, ctx.item))


def _run_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """Train and evaluate the jobs of one unit of :data:`UNITS` on ``ctx.device``
    (checkpoints in ``results_dir/ckpt/<unit>/<model>``: an interrupted unit resumes); write
    its record to :func:`unit_file` and return it; then its soundness audit (a broken
    certificate raises :class:`attncert.soundness.UnsoundCertificateError`, the record kept
    for inspection)."""
    if unit not in UNITS:
        raise ValueError(f"text unit {unit!r}: not one of {UNITS}")
    base, dev_, processed_dir = ctx.require_base(), ctx.device, ctx.processed_dir
    t0 = time.perf_counter()
    torch.manual_seed(base.seed)
    folder = Path(p.results_dir) / "ckpt" / unit
    folder.mkdir(parents=True, exist_ok=True)  # a DVC output, even for a unit with no job
    common, evaluation = settings(p, base, dev_)
    tok = load_tokenizer(p.tokenizer)
    record: dict[str, Any] = {"unit": unit, "key": unit_key("text", p, base), "device": str(dev_),
                              "results": {}, "curves": [], "audits": {}, "jobs": [],
                              "data": None, "entry": None}
    if unit.startswith(f"{STUDY}-"):
        record |= sst2_unit(p, ctx, processed_dir, tok, common, evaluation, folder,
                            unit_jobs(p, tok.vocab_size, unit), str(dev_))
    elif unit in text_datasets(p):
        entry, fitted = other_dataset(
            p, ctx, unit, processed_dir, tok, common, evaluation, folder,
            lambda sep: dataset_jobs(p, tok.vocab_size, unit, sep))
        record["entry"] = entry
        if fitted is not None:
            record["audits"] = {f"{unit}/{m}": rows for m, rows in fitted.audits.items()}
    record["seconds"] = time.perf_counter() - t0
    write_json(unit_file(p, unit), record)
    soundness.require_sound(record["audits"], see=str(unit_file(p, unit)))
    return record


def read_unit(p: Params, base: BaseParams, unit: str) -> dict[str, Any]:
    """The record :func:`_run_unit` wrote for ``unit``; ValueError when it is missing or was
    computed from other params (run the unit's DVC stage first)."""
    return read_record(unit_file(p, unit), unit_key("text", p, base),
                       f"the text unit {unit!r}", unit_stage(p, unit))


def _gather(p: Params, ctx: Context) -> Result:
    """Gather every unit's record (:func:`read_unit`): write ``results_dir`` (models.csv,
    curves.csv, datasets.csv, the figures) and the metrics file; return what the notebook
    shows. Reads records only (no device, no data)."""
    base = ctx.require_base()
    import matplotlib.pyplot as plt

    t_stage = time.perf_counter()
    out = Path(p.results_dir)
    records = {u: read_unit(p, base, u) for u in UNITS}
    data, results, curves, audits, others, todo_rows, frozen_train = merge_records(
        p, records)
    reported, n_cert = data["reported"], data["n_certified"]
    curves = pd.DataFrame(curves)
    table = attention_table(results)
    depth0, versus, attention_models, verdict, paper_vs_ours, ablation, figures = (
        study_tables(p, table, curves, reported))

    out.mkdir(parents=True, exist_ok=True)
    for file, fig in figures.items():
        with atomic_path(out / file) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)  # saved; the notebook shows it where it belongs, not here
    with atomic_path(out / "models.csv") as tmp:
        table.to_csv(tmp, index=False)
    with atomic_path(out / "curves.csv") as tmp:
        curves.to_csv(tmp, index=False)
    other_table = datasets_table(others)
    with atomic_path(out / "datasets.csv") as tmp:
        other_table.to_csv(tmp, index=False)
    n_attack = data["n_attacked"]
    seconds = sum(r["seconds"] for r in records.values()) + time.perf_counter() - t_stage
    write_json(p.metrics, {
        "scale": base.scale, "train_sentences": data["train"],
        "frozen_train_sentences": frozen_train,
        "reported_split": reported, "units": {u: r["device"] for u, r in records.items()},
        "n_certified": n_cert, "n_attacked": n_attack, "eps": p.cert_eps,
        "depth0": depth0, "models": results,
        "attention_vs_depth0": {
            name: {"d_test_acc": r["d_test_acc"], "d_avg_radius": r["d_avg_radius"],
                   "d_avg_radius_correct": r["d_avg_radius_correct"]}
            for name, r in attention_models.iterrows()},
        "paper": {"olsa_sst_avg_radius": paper.OLSA_AVG_RADIUS["sst"],
                  "olsa_softmax_lipschitz": paper.OLSA_SOFTMAX_LIPSCHITZ,
                  "shi_sst_avg_radius": paper.OLSA_SHI_AVG_RADIUS["sst"]},
        "datasets": others,
        "broken": int(table["broken"].sum()) + sum(e.get("broken", 0) for e in others.values()),
        "seconds": seconds})
    audit = pd.DataFrame([{"model": name, **r} for name, rows in audits.items() for r in rows])
    soundness.require_sound(audits, see=str(p.metrics))  # every unit's audit, once more
    return Result(
        data=data, jobs=pd.DataFrame(todo_rows),
        table=table, audit=audit, audits=audits, versus=versus, verdict=verdict,
        paper_vs_ours=paper_vs_ours, ablation=ablation, figures=figures,
        datasets=others, datasets_table=other_table, seconds=seconds)


# -- headline rows ---------------------------------------------------------------------------


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Per SST-2 model: accuracy on the reported split, average certified radius per bound
    variant with three rules (0 for misclassified sentences, ours; correctly classified only;
    every sentence's prediction radius, OLSA sec. 5.1's rule, beside which stands OLSA's SST
    radius, its unsound softmax constant 1/4, for every 3-layer OLSA),
    the differences to the depth-0 baseline, the residual gates, alpha1, the attention's max
    probability against 1/n, certified accuracy per eps, certification cost."""
    ref, shi = paper.OLSA_AVG_RADIUS["sst"], paper.OLSA_SHI_AVG_RADIUS["sst"]
    unlike = scale_caveat(m)  # below the paper scale: not like for like
    src = (f"OLSA section 5 ({OLSA_PAPER_DEPTH}-layer OLSA, SST; softmax constant "
           f"{paper.OLSA_SOFTMAX_LIPSCHITZ:g}: unsound, ours 1/2; Shi et al.: {shi:g}){unlike}")
    split = m.get("reported_split", "test")
    rows = []
    versus = m.get("attention_vs_depth0", {})
    for name, r in m.get("models", {}).items():
        base = f"models/{name}"
        rows.append(row(f"{base}/test_acc", f"{name} {split} accuracy", r["test_acc"],
                         "fraction", brief=True))
        if r.get("family") == "none":   # no certificate: radius and certified accuracy are 0
            continue
        match = OLSA_NAME.match(name) if r["family"] == "olsa" else None
        olsa_ref = ref if match and int(match.group(1)) == OLSA_PAPER_DEPTH else None
        radii, correct = r.get("avg_radius", {}), r.get("avg_radius_correct", {})
        best = max(radii, key=radii.get) if radii else None
        for variant, radius in radii.items():
            rows.append(row(f"{base}/avg_radius/{variant}",
                             f"{name} average certified radius ({variant}; 0 if wrong)",
                             radius, "value", brief=variant == best))
        for variant, radius in r.get("avg_radius_invariant", {}).items():  # OLSA's rule
            rows.append(row(f"{base}/avg_radius_invariant/{variant}",
                             f"{name} average radius of the prediction ({variant}; every "
                             "sentence, right or wrong: OLSA sec. 5.1's rule)",
                             radius, "value", olsa_ref, src, brief=variant == best))
        for variant, radius in correct.items():
            rows.append(row(f"{base}/avg_radius_correct/{variant}",
                             f"{name} average certified radius ({variant}; correct only)",
                             radius, "value", brief=variant == best))
        for key, label in (("d_test_acc", f"{split} accuracy"),
                           ("d_avg_radius", "average radius")):
            if key in versus.get(name, {}):
                rows.append(row(f"attention_vs_depth0/{name}/{key}",
                                 f"{name} minus depth 0: {label}", versus[name][key],
                                 "value", brief=True))
        if r.get("b_att_mean") is not None:
            rows.append(row(f"{base}/b_att_mean", f"{name} attention gate b (mean over layers)",
                             r["b_att_mean"], "value"))
        if r.get("alpha1_mean") is not None:
            rows.append(row(f"{base}/alpha1_mean", f"{name} alpha1 (mean over layers)",
                             r["alpha1_mean"], "value"))
        att = r.get("attention") or {}
        if att.get("ratio") is not None:
            rows.append(row(f"{base}/attention/ratio",
                             f"{name} attention max probability / uniform (1/n)",
                             att["ratio"], "ratio", brief=r["family"] == "olsa"))
        ablation = r.get("attention_ablation") or {}
        if ablation.get("uniform_gap") is not None:
            rows.append(row(f"{base}/attention_ablation/uniform_gap",
                             f"{name} points lost with uniform attention",
                             ablation["uniform_gap"], "value", brief=True))
        for eps, acc in r.get("certified_acc", {}).items():
            rows.append(row(f"{base}/certified_acc/{eps}", f"{name} certified at eps {eps}",
                             acc, "fraction"))
        if r.get("cert_seconds_per_sentence") is not None:
            rows.append(row(f"{base}/cert_seconds_per_sentence",
                             f"{name} certification seconds per sentence",
                             r["cert_seconds_per_sentence"], "seconds"))
    for dataset, e in m.get("datasets", {}).items():
        for name, r in e.get("models", {}).items():  # none when the dataset is unavailable
            base = f"datasets/{dataset}/models/{name}"
            where = f"{dataset} {name}"
            rows.append(row(f"{base}/test_acc", f"{where} {e['reported_split']} accuracy",
                             r["test_acc"], "fraction", brief=True))
            match = OLSA_NAME.match(name)
            ref = paper_reference(dataset, name, int(match.group(1)) if match else None)
            ref = (ref[0], ref[1] + unlike) if ref else None
            for variant, radius in r.get("avg_radius", {}).items():
                rows.append(row(f"{base}/avg_radius/{variant}",
                                 f"{where} average certified radius ({variant}; 0 if wrong)",
                                 radius, "value", brief=True))
            for variant, radius in r.get("avg_radius_invariant", {}).items():  # OLSA's rule
                rows.append(row(f"{base}/avg_radius_invariant/{variant}",
                                 f"{where} average radius of the prediction ({variant}; every "
                                 "sentence: OLSA sec. 5.1's rule)", radius, "value",
                                 *(ref or (None, None)), brief=True))
    for key, label in (("n_certified", f"certified {split} sentences"),
                       ("n_attacked", "attacked sentences (PGD audit)"),
                       ("broken", "broken certificates")):
        if key in m:
            rows.append(row(key, label, m[key], "count", brief=True))
    return rows


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: SST-2's deepest OLSA (accuracy on the reported split, average
    certified radius of its best variant, points lost with uniform attention), broken
    certificates of every model."""
    olsa = {int(match.group(1)): r for name, r in m.get("models", {}).items()
            if (match := OLSA_NAME.match(name)) and not match.group(2)}
    deep = olsa[max(olsa)] if olsa else {}
    radii = deep.get("avg_radius") or {}
    return numbers(clean=deep.get("test_acc"), radius=max(radii.values()) if radii else None,
                   broken=m.get("broken"),
                   attn_uniform_gap=(deep.get("attention_ablation") or {}).get("uniform_gap"))
