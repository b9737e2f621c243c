"""The study report: every stage's headline rows, and the report's commands.

    python -m attncert.report summary   # reports/metrics/summary.json from every stage's metrics
    python -m attncert.report readme    # README.md's results section, from summary.json
    python -m attncert.report html      # reports/html/: each executed notebook and index.html

Headline rows (:func:`headline_rows`) come from each stage module's ``headline_rows``
(:mod:`attncert.stages`, rows as :mod:`attncert.headline` describes them); a stage without a
reader is read generically. Where the metrics files are comes from dvc.yaml resolved with
params.yaml (:mod:`attncert.dvcfile`); the summary is the figures stage's
(:mod:`attncert.stages.figures`), README's section :mod:`attncert.readme`'s, the HTML export
:mod:`attncert.htmlexport`'s.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attncert import paper
from attncert.dvcfile import DVC_FILE, StageRun, read_stages, resolve, stage_runs
from attncert.headline import eps_match, row
from attncert.htmlexport import html_export
from attncert.params import PARAMS_FILE, load_params
from attncert.readme import README_FILE, update_readme
from attncert.stages import data as data_stage
from attncert.stages import tightness as tightness_stage

#: generic reader: at most this many numeric leaves of an unknown metrics file
GENERIC_MAX_ROWS = 200
GENERIC_BRIEF_ROWS = 8

__all__ = ["READERS", "headline_rows", "main",
           # dvc.yaml, resolved (attncert.dvcfile), for the report's callers
           "DVC_FILE", "PARAMS_FILE", "StageRun", "read_stages", "resolve", "stage_runs"]


# ------------------------------------------------------------------ headline rows
def _train_vit_rows(m: Mapping, item: Mapping) -> list[dict]:
    return [row(k, label, m[k], unit, brief=brief) for k, label, unit, brief in (
        ("clean_acc", "clean accuracy (trained)", "fraction", True),
        ("test_loss", "test loss", "value", False),
        ("epochs", "epochs", "count", False),
        ("train_seconds", "training seconds", "seconds", True),
        ("parameters", "parameters", "count", False)) if k in m]


def _lofast_table1(item: Mapping, eps: str) -> float | None:
    t1 = paper.LOFAST_TABLE1
    i = eps_match(eps, t1["eps"])
    if item.get("dataset") != "cifar10" or item.get("depth") not in t1["lofast"] or i is None:
        return None
    return t1["lofast"][item["depth"]][i] / 100


def _certvit_reference(dataset: str | None) -> tuple[Mapping, str] | None:
    """CertViT's Table 1 row for ``dataset`` (MNIST or CIFAR-10) and its name, if any."""
    return {"mnist": (paper.CERTVIT_MNIST, "CertViT Table 1 (MNIST)"),
            "cifar10": (paper.CERTVIT_CIFAR10, "CertViT Table 1 (CIFAR-10)")}.get(dataset or "")


def _at_certvit_eps(dataset: str | None, eps: str) -> tuple[Mapping, str] | None:
    ref = _certvit_reference(dataset)
    return ref if ref and eps_match(eps, [ref[0]["eps"]]) is not None else None


def _certify_vit_rows(m: Mapping, item: Mapping) -> list[dict]:
    rows = [row("clean_acc", "clean accuracy", m["clean_acc"], "fraction", brief=True)]
    for eps, acc in m.get("pgd_acc", {}).items():
        rows.append(row(f"pgd_acc/{eps}", f"L2 PGD accuracy at eps {eps}", acc, "fraction"))
    for key, accs in m.get("certified_acc", {}).items():
        headline = key == "lofast_M_pairwise"
        for eps, acc in accs.items():
            ref, src = (_lofast_table1(item, eps), "LoFAST Table 1") if headline else (None, None)
            claim = _at_certvit_eps(item.get("dataset"), eps) if headline else None
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


def _specformer_rows(m: Mapping, item: Mapping) -> list[dict]:
    rows = []
    for key, acc in m.get("robustness", {}).items():
        dataset, training, method, attack = key.split("/", 3)
        ref = None
        if dataset == "cifar10" and training == "standard":
            ref = paper.SPECFORMER_TABLE1.get(method, {}).get(attack)
        rows.append(row(f"robustness/{key}", f"{dataset} {training} {method}: {attack}", acc,
                         "fraction", None if ref is None else ref / 100, "SpecFormer Table 1",
                         brief=training == "standard" and method in ("vanilla", "specformer")))
    if m.get("msvp_step_ratio") is not None:
        rows.append(row("msvp_step_ratio", "MSVP step time / vanilla", m["msvp_step_ratio"],
                         "ratio", paper.SPECFORMER_STEP_RATIO, "SpecFormer Table 3", brief=True))
    for r in m.get("certified", []):
        for k, v in r.items():
            if k.startswith("certified@"):
                rows.append(row(f"certified/{r['model']}/{r['variant']}/{k[10:]}",
                                 f"{r['model']} certified {r['variant']} at eps {k[10:]}", v,
                                 "fraction"))
    return rows


def _certvit_rows(m: Mapping, item: Mapping) -> list[dict]:
    reference = _certvit_reference(m.get("dataset"))
    ref, src = reference if reference else ({}, None)

    def paper_value(key: str, scale: float = 1.0) -> float | None:
        return ref[key] / scale if key in ref else None

    rows = [row("test_clean_acc", "clean accuracy (certified model)", m.get("test_clean_acc"),
                 "fraction", paper_value("clean", 100), src, brief=True)]
    for what, label, key in (("pgd_acc", "L2 PGD accuracy", "pgd"),
                             ("certified_acc", "certified accuracy", "certified")):
        for eps, acc in m.get(what, {}).items():
            at_paper_eps = _at_certvit_eps(m.get("dataset"), eps) is not None
            rows.append(row(f"{what}/{eps}", f"{label} at eps {eps}", acc, "fraction",
                             paper_value(key, 100) if at_paper_eps else None, src,
                             brief=at_paper_eps))
    # the certificate's constant (features x pairwise head rows) when recorded, else pixels ->
    # logits (metrics written before the pairwise constant existed)
    key = "lipschitz_pairwise" if "lipschitz_pairwise" in m else "lipschitz"
    final = m.get(key, {}).get("final")
    if final is not None:
        rows.append(row(f"{key}/final", "Lipschitz bound of the final model", final, "value",
                         paper_value("lipschitz"), src, brief=True))
    for mode, mm in m.get("modes", {}).items():
        if mode == m.get("headline_mode"):
            continue
        rows.append(row(f"modes/{mode}/test_clean_acc", f"{mode} mode: clean accuracy",
                         mm.get("test_clean_acc"), "fraction", brief=True))
        for eps, acc in mm.get("certified_acc", {}).items():
            rows.append(row(f"modes/{mode}/certified_acc/{eps}",
                             f"{mode} mode: certified accuracy at eps {eps}", acc, "fraction",
                             brief=_at_certvit_eps(m.get("dataset"), eps) is not None))
        bound = mm.get("lipschitz_pairwise", {}).get("final")
        if bound is not None:
            rows.append(row(f"modes/{mode}/lipschitz_pairwise/final",
                             f"{mode} mode: Lipschitz bound of the final model", bound, "value",
                             brief=True))
    base = m.get("linear_baseline")
    if base:  # the trivial baseline beside the ViTs: a linear classifier on pixels
        rows.append(row("linear_baseline/clean_acc", "linear baseline (pixels): clean accuracy",
                         base.get("clean_acc"), "fraction", brief=True))
        for eps, acc in base.get("certified_acc", {}).items():
            rows.append(row(f"linear_baseline/certified_acc/{eps}",
                             f"linear baseline (pixels): certified accuracy at eps {eps}", acc,
                             "fraction", brief=_at_certvit_eps(m.get("dataset"), eps) is not None))
        rows.append(row("linear_baseline/broken", "linear baseline (pixels): broken "
                         "certificates", base.get("broken"), "count"))
    units = {"broken": "count", "n_test": "count", "median_radius": "value",
             "total_seconds": "seconds"}
    for key, unit in units.items():
        if isinstance(m.get(key), int | float):
            rows.append(row(key, key.replace("_", " "), m[key], unit))
    return rows


#: text model names as notebooks/06_text.py builds them: "olsa-L<depth>-g<gamma>" is OLSA
#: (with "-averaged": OLSA's own residual); the attention sweep's "-alpha1-<a>" is not
_OLSA_NAME = re.compile(r"olsa-L(\d+)-g[0-9.]+(-averaged)?$")
#: the depth of OLSA's headline model (OLSA section 5: a 3-layer OLSA on SST and Yelp)
OLSA_PAPER_DEPTH = 3


def _text_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Per SST-2 model: accuracy on the reported split, average certified radius per bound
    variant with both rules (0 for misclassified sentences, OLSA's; correctly classified
    only), OLSA's SST radius (its unsound softmax constant 1/4) beside every 3-layer OLSA,
    the differences to the depth-0 baseline, the residual gates, alpha1, the attention's max
    probability against 1/n, certified accuracy per eps, certification cost."""
    ref, shi = paper.OLSA_AVG_RADIUS["sst"], paper.OLSA_SHI_AVG_RADIUS["sst"]
    src = (f"OLSA section 5 ({OLSA_PAPER_DEPTH}-layer OLSA, SST; softmax constant "
           f"{paper.OLSA_SOFTMAX_LIPSCHITZ:g}: unsound, ours 1/2; Shi et al.: {shi:g})")
    split = m.get("reported_split", "test")
    rows = []
    versus = m.get("attention_vs_depth0", {})
    for name, r in m.get("models", {}).items():
        base = f"models/{name}"
        rows.append(row(f"{base}/test_acc", f"{name} {split} accuracy", r["test_acc"],
                         "fraction", brief=True))
        if r.get("family") == "none":   # no certificate: radius and certified accuracy are 0
            continue
        match = _OLSA_NAME.match(name) if r["family"] == "olsa" else None
        olsa_ref = ref if match and int(match.group(1)) == OLSA_PAPER_DEPTH else None
        radii, correct = r.get("avg_radius", {}), r.get("avg_radius_correct", {})
        best = max(radii, key=radii.get) if radii else None
        for variant, radius in radii.items():
            rows.append(row(f"{base}/avg_radius/{variant}",
                             f"{name} average certified radius ({variant}; 0 if wrong)",
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
        for eps, acc in r.get("certified_acc", {}).items():
            rows.append(row(f"{base}/certified_acc/{eps}", f"{name} certified at eps {eps}",
                             acc, "fraction"))
        if "cert_seconds_per_batch" in r:
            rows.append(row(f"{base}/cert_seconds_per_batch",
                             f"{name} certification seconds per batch of "
                             f"{r.get('cert_batch_size', '?')}", r["cert_seconds_per_batch"],
                             "seconds"))
    for key, label in (("n_certified", f"certified {split} sentences"),
                       ("n_attacked", "attacked sentences (PGD audit)"),
                       ("broken", "broken certificates")):
        if key in m:
            rows.append(row(key, label, m[key], "count", brief=True))
    return rows


def _crown_rows(m: Mapping, item: Mapping) -> list[dict]:
    """LoFAST Tables 1-2 as the crown stage writes them (accuracies in %), per depth: certified
    accuracy and seconds per sample of LoFAST and CROWN, LoFAST first with CROWN on the rest,
    the CROWN / LoFAST speed ratio; LoFAST's numbers beside where the dataset is the paper's."""
    t1, t2 = paper.LOFAST_TABLE1, paper.LOFAST_TABLE2.get(m.get("dataset"), {})
    cifar = m.get("dataset") == "cifar10"
    crown_src = "LoFAST Table 1 (alpha,beta-CROWN)"
    rows = [row(f"trained/L{t['depth']}/test_acc", f"L{t['depth']} clean accuracy",
                 t["test_acc"], "percent") for t in m.get("trained", [])]
    for rec in m.get("table1", []):
        d, method = rec["depth"], rec["method"]
        lofast = method == "LoFAST"
        for k in (k for k in rec if k.startswith("acc_")):
            i = eps_match(k[4:], t1["eps"])
            per_depth = t1["lofast" if lofast else "crown"].get(d) if cifar else None
            ref = per_depth[i] if per_depth and i is not None else None
            rows.append(row(f"table1/L{d}/{method}/{k}", f"L{d} {method} certified at eps "
                             f"{k[4:]}", rec[k], "percent", ref,
                             "LoFAST Table 1" if lofast else crown_src, brief=True))
        secs = t1["lofast_seconds" if lofast else "crown_seconds"].get(d) if cifar else None
        rows.append(row(f"table1/L{d}/{method}/seconds_per_sample",
                         f"L{d} {method} seconds per sample", rec["seconds_per_sample"],
                         "seconds", secs, "LoFAST Table 1" if lofast else crown_src, brief=True))
    for rec in m.get("table2", []):
        d, eps = rec["depth"], f"{rec['eps']:g}"
        i = eps_match(eps, paper.LOFAST_TABLE_EPS[:2]) if d == 3 else None
        for key, label, ref_key, unit, j in (
                ("crown_acc", f"{rec['method']} alone", "CROWN", "percent", 0),
                ("crown_seconds", f"{rec['method']} alone seconds", "CROWN", "seconds", 1),
                ("combined_acc", f"LoFAST + {rec['method']}", "CROWN+LoFAST", "percent", 0),
                ("combined_seconds", f"LoFAST + {rec['method']} seconds", "CROWN+LoFAST",
                 "seconds", 1)):
            ref = t2[ref_key][i][j] if t2 and i is not None else None
            rows.append(row(f"table2/L{d}/{rec['method']}/{eps}/{key}",
                             f"L{d} {label} at eps {eps}", rec[key], unit, ref,
                             "LoFAST Table 2", brief=key == "combined_acc"))
    for d, ratio in m.get("crown_over_lofast_seconds", {}).items():
        lo, cr = t1["lofast_seconds"].get(int(d)), t1["crown_seconds"].get(int(d))
        rows.append(row(f"crown_over_lofast_seconds/{d}", f"L{d} CROWN / LoFAST seconds",
                         ratio, "ratio", cr / lo if lo and cr else None,
                         "LoFAST Table 1 (alpha,beta-CROWN / LoFAST seconds, CIFAR-10)",
                         brief=True))
    for key, label in (("n", "certified test points"), ("broken", "broken certificates")):
        if key in m:
            rows.append(row(key, label, m[key], "count"))
    return rows


def _generic_rows(m: Any, item: Mapping, prefix: str = "", depth: int = 0) -> list[dict]:
    """Every numeric leaf of a metrics file (dicts up to 3 levels; lists are skipped)."""
    rows: list[dict] = []
    if isinstance(m, Mapping) and depth < 3:
        for k, v in m.items():
            rows += _generic_rows(v, item, f"{prefix}{k}/" if prefix or k else "", depth + 1)
    elif isinstance(m, int | float) and not isinstance(m, bool):
        key = prefix.rstrip("/")
        rows.append(row(key, key.replace("/", " "), m, "value"))
    if depth == 0:
        rows = rows[:GENERIC_MAX_ROWS]
        for r in rows[:GENERIC_BRIEF_ROWS]:
            r["brief"] = True
    return rows


#: stage name -> reader of its (first) metrics file: the stage module's ``headline_rows``
#: (:mod:`attncert.stages`); other stages get :func:`_generic_rows`
READERS: dict[str, Callable[[Mapping, Mapping], list[dict]]] = {
    "data": data_stage.headline_rows,
    "tightness": tightness_stage.headline_rows,
    "train_vit": _train_vit_rows,
    "certify_vit": _certify_vit_rows,
    "specformer": _specformer_rows,
    "certvit": _certvit_rows,
    "text": _text_rows,
    "crown": _crown_rows,
}


def headline_rows(stage: str, metrics: Mapping, item: Mapping | None = None) -> list[dict]:
    """The headline rows of one metrics file of ``stage`` (``item``: the grid point)."""
    return READERS.get(stage, _generic_rows)(metrics, item or {})


# ------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.report",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("summary", "readme", "html"))
    ap.add_argument("--params", default=PARAMS_FILE)
    ap.add_argument("--dvc", default=DVC_FILE)
    ap.add_argument("--readme", default=README_FILE)
    ap.add_argument("--force", action="store_true", help="html: export every page again")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    fig = params["figures"]
    if args.command == "readme":
        changed = update_readme(args.readme, fig.summary)
        print(f"{args.readme}: results section {'updated' if changed else 'unchanged'}")
        return 0
    stages = read_stages(args.dvc)
    if args.command == "summary":
        # the figures stage builds the summary from this module's rows
        from attncert.stages import figures as figures_stage

        figures_stage.write_summary(fig.summary, figures_stage.summary(
            params, stages, required=fig.required))
        print(f"wrote {fig.summary}")
        return 0
    data = json.loads(Path(fig.summary).read_text()) if Path(fig.summary).is_file() else None
    pages = html_export(stage_runs(stages, params), fig.html_dir, data, force=args.force)
    print(f"{fig.html_dir}: {len(pages)} page(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
