"""The specformer stage: SpecFormer (MSVP) and the Lipschitz-attention baselines, trained,
attacked, timed and compared (docs/math.md sections 1, 3, 7, 8).

The plan: every method of :mod:`attncert.specformer.methods` on every dataset and source,
standard and (for ``adv_methods``) PGD adversarial training, each model attacked with the same
attacks on the first ``n_test`` test images; the largest singular value per layer of the
standard-trained models (SpecFormer Figure 2a); the cost of a training step relative to
vanilla (its Table 3); and what the penalty buys in certified terms: LayerNorm models are
refused by the certifier, so a Lipschitz ViT trained without and with MSVP is certified with
LoFAST(M) and SpecFormer's bound. Reusable methods (configs, attacks, timing) live in
:mod:`attncert.specformer.methods`, the study's code (recipes, a unit's runs, Table 5, the
certified pair) in :mod:`attncert.specformer.study`, the section's schema in
:mod:`attncert.specformer.params`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from attncert.data import load_processed
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
from attncert.specformer import methods as sf
from attncert.specformer import plan
from attncert.specformer.params import CERT_VARIANTS, Params
from attncert.specformer.study import (
    certified_pair,
    check_certified,
    lambda_ablation,
    main_runs,
    overview,
    table5_rows,
)

#: this module's params.yaml section
SECTION = "specformer"


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.specformer.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return plan.jobs(params)


@dataclass
class Result:
    """What the stage's notebook shows (every table is also in a file or the metrics)."""

    overview: str            # markdown: scale, device, data, sources, runs, attacks
    trained: pd.DataFrame    # one row per run: checkpoint status, epochs, seconds, test acc
    robustness: pd.DataFrame  # robust_accuracy rows with dataset, training, method
    comparison: pd.DataFrame  # SpecFormer's Table 1/2 layout, its numbers beside ours
    runs: list[str]          # run labels (dataset or dataset@model)
    attention: pd.DataFrame  # per run: accuracy with uniform / identity attention, entropy
    sigma: pd.DataFrame      # largest singular value per layer, map, method and run
    ratios: pd.DataFrame     # step time per method and its ratio to vanilla
    msvp_ratio: float | None
    refusal: str             # the certifier's message for a LayerNorm model
    cert_sigma: pd.DataFrame  # the certified pair's singular values
    certified: pd.DataFrame  # the certified pair: certified accuracy per variant and eps
    metrics: dict[str, Any]

    def sigma_pair(self, run: str) -> pd.DataFrame:
        """One run's singular values, vanilla and SpecFormer only (SpecFormer Figure 2a)."""
        s = self.sigma
        return s[(s["dataset"] == run) & s["method"].isin(["vanilla", "specformer"])]

    def sigma_table(self) -> pd.DataFrame:
        """Largest singular value per run, method and layer (rows) and map (columns)."""
        return self.sigma.pivot_table(index=["dataset", "method", "depth"], columns="map",
                                      values="sigma").round(3)

    def cert_sigma_table(self) -> pd.DataFrame:
        """The certified pair's singular values per member and layer (rows) and map."""
        return self.cert_sigma.pivot_table(index=["method", "depth"], columns="map",
                                           values="sigma").round(4)


#: the certified pair's unit; Table 5's are ``lambda<i>`` (DVC's matrix key of the i-th
#: ``msvp_lambda_ablation`` entry) and the main runs' are the datasets' names
CERTIFIED = "certified"


def units(p: Params) -> list[str]:
    """The stage's independent units of work, each one DVC stage (``dvc.yaml``) that a GPU of
    ``scripts/repro-gpus`` takes on its own: one per dataset (every source, training and method
    on it, attacked; the first dataset's also times a training step and checks the certifier's
    refusal), one per Table 5 lambda (``lambda<i>``), and the certified pair. :func:`run`
    gathers them."""
    return [*p.datasets, *(f"lambda{i}" for i in range(len(p.msvp_lambda_ablation))),
            CERTIFIED]


def unit_file(p: Params, unit: str) -> Path:
    """Where :func:`_run_unit` writes the unit's record (JSON)."""
    return Path(p.results_dir) / "units" / f"{unit}.json"


def unit_ckpt(p: Params, unit: str) -> Path:
    """The unit's checkpoint folder (one sub-folder per run: an interrupted unit resumes)."""
    return Path(p.results_dir) / "ckpt" / unit


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)


def run(p: Params, ctx: Context) -> SplitRun[Result]:
    """``ctx.item``: one unit of :func:`units` (:func:`_run_unit`: its record); ``None``: the
    gathering stage (:func:`_gather`: what the notebook shows). Both return a
    :class:`attncert.pipeline.records.SplitRun` (the record or metrics as written; the gathering
    stage's :class:`Result`)."""
    if ctx.item is None:
        return gathered(p.metrics, _gather(p, ctx))
    return SplitRun(ctx.item, _run_unit(p, ctx, ctx.item))


def _run_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """Train, attack (and for the first dataset time and check) one unit of :func:`units` on
    ``ctx.device``; write its record to :func:`unit_file` and return it. Checkpoints go under
    :func:`unit_ckpt` (an interrupted unit resumes)."""
    if unit not in units(p):
        raise ValueError(f"specformer unit {unit!r}: not one of {units(p)}")
    base, device = ctx.require_base(), ctx.device
    seed, precision = base.seed, ctx.precision
    dataset = unit if unit in p.datasets else p.datasets[0]
    data = sf.subset_train(load_processed(dataset, ctx.processed_dir), p.max_train, seed)
    record: dict[str, Any] = {
        "unit": unit, "key": unit_key("specformer", p, base), "device": str(device),
        "data": f"{dataset}: {len(data['train']['y'])} training / {len(data['test']['y'])} "
                f"test images ({data['source']})",
        "notes": {}, "trained": [], "robustness": [], "attention": [], "sigma": [], "times": [],
        "refusal": None, "ablation": None, "certified": [], "cert_sigma": [],
        "audit": {}}
    specs = sf.attack_specs(p.std_eps_255, p.adv_eval_eps_255, p.attack_steps, p.attack_eps)
    unit_ckpt(p, unit).mkdir(parents=True, exist_ok=True)  # a DVC output, even when unused
    if unit in p.datasets:
        main_runs(p, data, dataset, specs, unit_ckpt(p, unit), device, precision, seed,
                  record)
    elif unit == CERTIFIED:
        pair = certified_pair(p, data, dataset, seed, unit_ckpt(p, unit), device, precision)
        record.update(certified=pair["certified"], cert_sigma=pair["sigma"], audit=pair["audit"])
    else:
        record["ablation"] = lambda_ablation(p, data, dataset, int(unit.removeprefix("lambda")),
                                             specs, unit_ckpt(p, unit), device, precision,
                                             seed)
    write_json(unit_file(p, unit), record)
    if unit == CERTIFIED:  # a broken certificate fails the unit once its record is written
        check_certified(record["audit"], str(unit_file(p, unit)))
    return record


def read_unit(p: Params, base: BaseParams, unit: str) -> dict[str, Any]:
    """The record :func:`_run_unit` wrote for ``unit``; ValueError when it is missing or was
    computed from other params (run the unit's DVC stage first)."""
    return read_record(unit_file(p, unit), unit_key("specformer", p, base),
                       f"the specformer unit {unit!r}", unit_stage(p, unit))


def unit_stage(p: Params, unit: str) -> str:
    """The DVC stage that runs ``unit`` of :func:`units` (dvc.yaml)."""
    if unit == CERTIFIED:
        return "specformer_certified"
    return f"specformer_runs@{unit}" if unit in p.datasets else f"specformer_table5@{unit}"


def _gather(p: Params, ctx: Context) -> Result:
    """Gather every unit's record (:func:`read_unit`): write the CSVs under ``results_dir`` and
    the metrics file; return what the notebook shows. Reads records only (no device)."""
    base = ctx.require_base()
    out = Path(p.results_dir)
    records = {u: read_unit(p, base, u) for u in units(p)}
    main = [records[d] for d in p.datasets]
    train_rows = [r for rec in main for r in rec["trained"]]
    rows = [r for rec in main for r in rec["robustness"]]
    labels = list(dict.fromkeys(r["dataset"] for r in train_rows))
    summary = overview(p, base, records)
    robustness = pd.DataFrame(rows)
    _write_csv(robustness, out / "robustness.csv")
    sigma = pd.DataFrame([r for rec in main for r in rec["sigma"]])
    _write_csv(sigma, out / "sigma.csv")
    attention = pd.DataFrame([r for rec in main for r in rec["attention"]])
    _write_csv(attention, out / "attention.csv")

    ablation = table5_rows(p, records, rows)  # SpecFormer Table 5
    _write_csv(pd.DataFrame(ablation), out / "msvp_ablation.csv")

    first = records[p.datasets[0]]
    times = pd.DataFrame(first["times"])
    _write_csv(times, out / "step_time.csv")
    all_ratios = {t: sf.step_time_ratios(times[times["training"] == t])
                  for t in dict.fromkeys(times["training"])}
    ratios = all_ratios["standard"]
    msvp_ratio = float(ratios.loc["specformer", "ratio"]) if "specformer" in p.methods else None
    refusal = first["refusal"]
    check_certified(records[CERTIFIED]["audit"], str(unit_file(p, CERTIFIED)))
    cert_rows = records[CERTIFIED]["certified"]
    certified = pd.DataFrame(cert_rows)
    _write_csv(certified, out / "certified.csv")

    metrics = {
        "scale": base.scale,
        "units": {u: r["device"] for u, r in records.items()},
        "training": train_rows,
        "robustness": {f"{r['dataset']}/{r['training']}/{r['method']}/{r['attack']}":
                       r["accuracy"] for r in rows},
        "step_time_ratio": ratios["ratio"].to_dict(),
        "step_time_ratio_adversarial": (all_ratios["adversarial"]["ratio"].to_dict()
                                        if "adversarial" in all_ratios else {}),
        "msvp_ablation": {f"{r['lambda']}/{r['training']}/{r['attack']}": r["accuracy"]
                          for r in ablation},
        "table5_run": sf.run_label(p.datasets[0], p.sources[0]),
        "msvp_step_ratio": msvp_ratio,
        "msvp_step_ratio_within_paper": None if msvp_ratio is None
        else msvp_ratio <= paper.SPECFORMER_STEP_RATIO,
        "attention": {f"{r['dataset']}/{r['training']}/{r['method']}":
                      {k: r[k] for k in ("uniform_gap", "identity_gap", "entropy_mean")}
                      for r in attention.to_dict("records")},
        "max_sigma": {f"{r['dataset']}/{r['method']}/L{r['depth']}/{r['map']}": r["sigma"]
                      for r in sigma.to_dict("records")},
        "layernorm_certificate": refusal,
        "certified": cert_rows,
        "certified_audit": records[CERTIFIED]["audit"],
    }
    write_json(p.metrics, metrics)
    return Result(overview=summary, trained=pd.DataFrame(train_rows), robustness=robustness,
                  comparison=sf.comparison_table(rows, paper.specformer_rows(labels)),
                  runs=labels, attention=attention, sigma=sigma, ratios=ratios,
                  msvp_ratio=msvp_ratio, refusal=refusal, certified=certified,
                  cert_sigma=pd.DataFrame(records[CERTIFIED]["cert_sigma"]), metrics=metrics)


#: the run SpecFormer's Table 5 CIFAR-10 numbers are of: its ViT-S fine-tuned on CIFAR-10
#: (ours: the hub's ViT-S/16, 12 x 384 where its is 8 x 768: fidelity.yaml)
TABLE1_RUN = sf.run_label("cifar10", "WinKawaks/vit-small-patch16-224")
#: Table 5's column names as our attack labels (standard: 2/255; adversarial: 8/255)
TABLE5_ATTACKS = {"standard": {"clean": "clean", "FGSM 2/255": "fgsm", "PGD-2 2/255": "pgd2"},
                  "adversarial": {"clean": "at_clean", "CW-20 8/255": "cw20",
                                  "PGD-20 8/255": "pgd20"}}


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Robust accuracy per run and attack (SpecFormer Tables 1-2 beside the runs of the hub
    checkpoints that stand for its ViT-S and DeiT-Ti:
    :func:`attncert.report.paper.specformer_reference`), the lambda ablation (Table 5 beside
    where its triple and run match), the step-time ratios of both trainings (Table 3) and the
    certified pair's certified accuracy."""
    rows = []
    for key, acc in m.get("robustness", {}).items():
        dataset, training, method, attack = key.split("/", 3)
        ref = paper.specformer_reference(dataset, training, method, attack)
        rows.append(row(f"robustness/{key}", f"{dataset} {training} {method}: {attack}", acc,
                        "fraction", None if ref is None else ref[0] / 100,
                        None if ref is None else ref[1],
                        brief=training == "standard" and method in ("vanilla", "specformer")))
    table5 = m.get("table5_run") == TABLE1_RUN
    stand_in = paper.SPECFORMER_STAND_INS.get(str(m.get("table5_run", "")).partition("@")[2])
    table5_source = ("SpecFormer Table 5 (CIFAR-10; its model not stated, read as Table 1's "
                     f"ViT-S{'; ' + stand_in[1] if stand_in else ''}){scale_caveat(m)}")
    for key, acc in m.get("msvp_ablation", {}).items():
        lam, training, attack = key.split("/", 2)
        column = TABLE5_ATTACKS.get(training, {}).get(attack)
        ref = (paper.SPECFORMER_TABLE5.get(lam, {}).get(column) if table5 and column
               else None)
        rows.append(row(f"msvp_ablation/{key}", f"MSVP lambda ({lam}), {training}: {attack}",
                        acc, "fraction", None if ref is None else ref / 100,
                        table5_source))
    for training, key, ref in (("standard", "step_time_ratio", paper.SPECFORMER_TABLE3),
                               ("adversarial", "step_time_ratio_adversarial",
                                paper.SPECFORMER_TABLE3)):
        for method, ratio in (m.get(key) or {}).items():
            if method == "vanilla":
                continue
            rows.append(row(f"{key}/{method}", f"{method} step time / vanilla ({training})",
                            ratio, "ratio", ref[training].get(method),
                            f"SpecFormer Table 3 ({training} training; its model and "
                            f"hardware not stated){scale_caveat(m)}",
                            brief=method == "specformer"))
    for r in m.get("certified", []):
        for k, v in r.items():
            if k.startswith("certified@"):
                rows.append(row(f"certified/{r['model']}/{r['variant']}/{k[10:]}",
                                f"{r['model']} certified {r['variant']} at eps {k[10:]}", v,
                                "fraction"))
        if "broken" in r:
            rows.append(row(f"certified/{r['model']}/{r['variant']}/broken",
                            f"{r['model']} {r['variant']}: certificates broken by PGD",
                            r["broken"], "count"))
        if "uniform_gap" in r and r["variant"] == CERT_VARIANTS[0]:  # the model's, once
            rows.append(row(f"certified/{r['model']}/{r['variant']}/uniform_gap",
                            f"{r['model']}: points lost with uniform attention",
                            r["uniform_gap"], "value", brief=True))
    return rows


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: the first run's standard SpecFormer model, clean and under PGD-2 at
    l_inf ``std_eps_255`` (SpecFormer Table 1's attack; not an l2 eps)."""
    rob = m.get("robustness", {})
    run = next((k.split("/")[0] for k in rob), None)
    base = f"{run}/standard/specformer"
    pgd = next((v for k, v in rob.items() if k.startswith(f"{base}/PGD-2 ")), None)
    return numbers(clean=rob.get(f"{base}/clean"), pgd=pgd)
