"""The study report: every stage's headline numbers, README's results section, the HTML export.

    python -m attncert.report summary   # reports/metrics/summary.json from every stage's metrics
    python -m attncert.report readme    # README.md's results section, from summary.json
    python -m attncert.report html      # reports/html/: each executed notebook and index.html

Where things are comes from dvc.yaml resolved with params.yaml, never from globbing: a stage's
metrics files are its declared ``metrics`` (``${...}`` templates filled from params; a matrix
stage expanded over its grid, each point named by :func:`attncert.runs.run_name`), its report
is the notebook ``nbrun`` writes. A stage whose metrics file is missing is "not run".

Headline rows (:func:`headline_rows`) come from each stage module's ``headline_rows``
(:mod:`attncert.stages`, rows as :mod:`attncert.headline` describes them); the summary also
carries the brief rows as nested mappings (``headline``), since ``dvc metrics show`` skips
lists.
"""

from __future__ import annotations

import argparse
import html
import itertools
import json
import math
import re
import shlex
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attncert import paper
from attncert.headline import UNITS, eps_match, row
from attncert.stages import data as data_stage
from attncert.stages import tightness as tightness_stage
from attncert.params import PARAMS_FILE, Params, load_params, read_yaml

DVC_FILE = "dvc.yaml"
README_FILE = "README.md"
#: executed notebooks live under here (dvc.yaml's nbrun outputs); the HTML tree mirrors it
NOTEBOOK_DIR = "reports/notebooks"
#: the stage that writes the summary (its own metrics are not summarised)
FIGURES_STAGE = "figures"
README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"
#: generic reader: at most this many numeric leaves of an unknown metrics file
GENERIC_MAX_ROWS = 200
GENERIC_BRIEF_ROWS = 8

__all__ = ["StageRun", "stage_runs", "collect", "headline_rows", "summary", "headline_metrics",
           "render_results", "replace_section", "update_readme", "notebook_html",
           "external_refs", "html_export", "index_html", "main"]


class MissingMetricsError(FileNotFoundError):
    """A stage listed as required has not written its metrics."""


# ------------------------------------------------------------------ dvc.yaml, resolved
@dataclass(frozen=True)
class StageRun:
    """One stage, or one grid point of a matrix stage, as dvc.yaml declares it."""

    stage: str
    run: str | None            # the grid point's name (matrix stages), else None
    item: Mapping[str, Any]    # the matrix item ({} for a plain stage)
    notebook: str | None       # nbrun's executed notebook
    metrics: tuple[str, ...]   # declared metrics files


_TEMPLATE = re.compile(r"\$\{([^}]+)\}")


def _lookup(ref: str, params: Params, item: Mapping[str, Any]) -> Any:
    section, _, key = ref.strip().partition(".")
    if section == "item":
        return item[key]
    return getattr(params[section], key)


def resolve(text: str, params: Params, item: Mapping[str, Any] | None = None) -> str:
    """Fill ``${section.key}`` and ``${item.key}`` templates as DVC does."""
    return _TEMPLATE.sub(lambda m: str(_lookup(m.group(1), params, item or {})), text)


def _matrix_items(matrix: Mapping[str, Any], params: Params) -> list[dict[str, Any]]:
    keys = list(matrix)
    values = []
    for k in keys:
        v = matrix[k]
        whole = _TEMPLATE.fullmatch(v.strip()) if isinstance(v, str) else None
        values.append(_lookup(whole.group(1), params, {}) if whole else v)
    return [dict(zip(keys, combo, strict=True)) for combo in itertools.product(*values)]


def _point_name(item: Mapping[str, Any]) -> str:
    if set(item) == {"dataset", "depth", "heads", "gamma_vo"}:
        from attncert.runs import run_name

        return run_name(**item)
    return "-".join(map(str, item.values()))


def _paths(entries: Iterable[Any] | None) -> list[str]:
    out: list[str] = []
    for e in entries or []:
        out.extend(e.keys() if isinstance(e, Mapping) else [e])
    return out


def _nbrun_output(cmd: str) -> str | None:
    argv = shlex.split(cmd)
    if "attncert.nbrun" not in argv:
        return None
    i = argv.index("attncert.nbrun")
    return argv[i + 2] if len(argv) > i + 2 else None


def read_stages(path: str | Path = DVC_FILE) -> dict[str, Any]:
    """dvc.yaml's ``stages`` mapping."""
    return read_yaml(path)["stages"]


def stage_runs(stages: Mapping[str, Any], params: Params) -> list[StageRun]:
    """Every stage and every grid point, in dvc.yaml's order, with paths resolved."""
    out = []
    for name, spec in stages.items():
        items = _matrix_items(spec["matrix"], params) if "matrix" in spec else [{}]
        for item in items:
            nb = _nbrun_output(resolve(spec.get("cmd", ""), params, item))
            out.append(StageRun(
                stage=name, run=_point_name(item) if item else None, item=item, notebook=nb,
                metrics=tuple(resolve(p, params, item) for p in _paths(spec.get("metrics")))))
    return out


def collect(runs: Sequence[StageRun], root: str | Path = ".") -> list[tuple[StageRun, dict]]:
    """(run, {metrics path: parsed JSON or None when missing}) for every run."""
    root = Path(root)
    loaded = []
    for r in runs:
        files = {}
        for p in r.metrics:
            f = root / p
            files[p] = json.loads(f.read_text()) if f.is_file() else None
        loaded.append((r, files))
    return loaded


def stage_metrics(loaded: Sequence[tuple[StageRun, dict]], stage: str) -> dict[str, dict]:
    """{run name (or stage name): metrics} of one stage's runs whose first metrics file exists.

    For the figures: every grid point of a matrix stage, in grid order."""
    out = {}
    for r, files in loaded:
        if r.stage == stage and r.metrics and files[r.metrics[0]] is not None:
            out[r.run or r.stage] = files[r.metrics[0]]
    return out



def stage_items(runs: Sequence[StageRun], stage: str) -> dict[str, Mapping[str, Any]]:
    """{grid point name: matrix item} of a matrix stage."""
    return {r.run: r.item for r in runs if r.stage == stage and r.run}


def stage_note(data: Mapping[str, Any], stage: str) -> str | None:
    """A one-line note when ``stage`` has nothing to show (not declared, or not run)."""
    entry = data["stages"].get(stage)
    if entry is None:
        return f"**{stage}**: stage not declared in dvc.yaml (not run)."
    if entry["status"] == "not run":
        return f"**{stage}**: stage not run (no `{entry['missing'][0]}`)."
    return None


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


def summary(params: Params, stages: Mapping[str, Any], root: str | Path = ".",
            required: Sequence[str] = ()) -> dict[str, Any]:
    """Headline numbers of every stage declared in ``stages`` (dvc.yaml), from its metrics.

    Returns ``{"scale", "order", "stages": {name: {"status", "metrics", "missing", "runs",
    "rows"}}, "headline"}`` (``order``: the stages in dvc.yaml's order; ``headline``:
    :func:`headline_metrics`):
    status "ok" (every metrics file there), "partial" (some grid points missing) or
    "not run"; ``metrics``/``missing`` list the paths read / absent; ``runs`` the grid points
    of a matrix stage (None otherwise); ``rows`` the headline rows, with ``run`` for matrix
    stages. A stage in ``required`` with a missing file raises :class:`MissingMetricsError`.
    """
    unknown = sorted(set(required) - set(stages))
    if unknown:
        raise ValueError(f"required stage {unknown[0]!r} is not declared in dvc.yaml")
    loaded = collect([r for r in stage_runs(stages, params) if r.stage != FIGURES_STAGE], root)
    out: dict[str, Any] = {}
    for r, files in loaded:
        entry = out.setdefault(r.stage, {"status": "ok", "metrics": [], "missing": [],
                                         "runs": [] if r.run else None, "rows": []})
        if r.run:
            entry["runs"].append(r.run)
        for path, m in files.items():
            if m is None:
                entry["missing"].append(path)
                continue
            entry["metrics"].append(path)
            rows = headline_rows(r.stage, m, r.item)
            entry["rows"] += [{"run": r.run, **row} if r.run else row for row in rows]
    for name, entry in out.items():
        if entry["missing"]:
            entry["status"] = "partial" if entry["metrics"] else "not run"
            if name in required:
                raise MissingMetricsError(f"{name}: required metrics missing: "
                                          f"{entry['missing'][0]}")
    return {"scale": params["base"].scale, "order": list(out), "stages": out,
            "headline": headline_metrics(out)}


def headline_metrics(stages: Mapping[str, Any]) -> dict[str, Any]:
    """The brief rows' numbers as nested mappings, what ``dvc metrics show`` prints of the
    summary: ``{stage: {key: ours}}``, ``{stage: {run: {key: ours}}}`` for a matrix stage
    (rows without a number of ours are left out)."""
    out: dict[str, Any] = {}
    for name, entry in stages.items():
        for r in entry["rows"]:
            if not r["brief"] or not isinstance(r["ours"], int | float) \
                    or isinstance(r["ours"], bool):
                continue
            into = out.setdefault(name, {})
            if r.get("run"):
                into = into.setdefault(r["run"], {})
            into[r["key"]] = r["ours"]
    return out


def write_summary(path: str | Path, data: Mapping[str, Any]) -> None:
    from attncert.io import write_json

    write_json(path, data)


# ------------------------------------------------------------------ README section
def fmt(value: Any, unit: str) -> str:
    """One number as the README and index.html show it (fractions as percentages; a missing
    or NaN value, e.g. a verifier that failed on every point, is the papers' dash)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if unit == "fraction":
        return f"{100 * value:.1f}%"
    if unit == "percent":
        return f"{value:.1f}%"
    if unit == "seconds":
        return f"{value:.3g} s"
    if unit == "count":
        return f"{value:,}" if isinstance(value, int) else f"{value:g}"
    return f"{value:.4g}"


def _cell(row: Mapping) -> str:
    ours = fmt(row["ours"], row["unit"])
    return ours if row["paper"] is None else f"{ours} (paper {fmt(row['paper'], row['unit'])})"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, body)]


def render_results(data: Mapping[str, Any]) -> str:
    """Markdown of summary.json's brief rows: a table per stage, the paper's numbers beside."""
    lines = [f"Scale `{data['scale']}`; generated from `reports/metrics/summary.json` by "
             "`python -m attncert.report readme`. Accuracies in %; `paper` is the paper's "
             "number for the same quantity (its own model and setting)."]
    for name in data.get("order", data["stages"]):
        entry = data["stages"][name]
        lines += ["", f"**{name}**: {entry['status']}"
                  + (f" (missing: `{entry['missing'][0]}`"
                     + (f" and {len(entry['missing']) - 1} more" if len(entry["missing"]) > 1
                        else "") + ")" if entry["missing"] else "")]
        rows = [r for r in entry["rows"] if r["brief"]]
        if not rows:
            continue
        lines.append("")
        if entry["runs"] is not None:
            labels = list(dict.fromkeys(r["label"] for r in rows))
            cells = {(r["run"], r["label"]): _cell(r) for r in rows}
            runs = [p for p in entry["runs"] if any(k[0] == p for k in cells)]
            lines += _table(["run", *labels],
                            [[p, *(cells.get((p, lab), "–") for lab in labels)] for p in runs])
        else:
            lines += _table(["quantity", "ours", "paper", "paper source"],
                            [[r["label"], fmt(r["ours"], r["unit"]), fmt(r["paper"], r["unit"]),
                              r["source"] or ""] for r in rows])
    return "\n".join(lines)


def replace_section(text: str, body: str, start: str = README_START,
                    end: str = README_END) -> str:
    """``text`` with everything between the two markers replaced by ``body``."""
    if text.count(start) != 1 or text.count(end) != 1:
        raise ValueError(f"expected exactly one {start} and one {end}")
    head, rest = text.split(start)
    if end not in rest:
        raise ValueError(f"{end} comes before {start}")
    _, tail = rest.split(end)
    return f"{head}{start}\n{body.strip()}\n{end}{tail}"


def update_readme(readme: str | Path, summary_path: str | Path) -> bool:
    """Rewrite README's results section from summary.json; True when the file changed."""
    readme = Path(readme)
    text = readme.read_text()
    new = replace_section(text, render_results(json.loads(Path(summary_path).read_text())))
    if new != text:
        readme.write_text(new)
    return new != text


# ------------------------------------------------------------------ HTML export
#: lab's page without the scripts it pulls from CDNs (require.js, MathJax, mermaid, widgets):
#: CSS is inlined by lab itself and output images are data URIs, so a page is one file.
_OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
_EXTERNAL = re.compile(
    r"<(script|link|img|iframe|source)\b[^>]*?\b(?:src|href)\s*=\s*[\"']?((?:https?:)?//[^\"'\s>]+)",
    re.IGNORECASE)


def external_refs(page: str) -> list[str]:
    """Every script/link/img/iframe/source tag of ``page`` that points off the page's host
    (http://, https:// or protocol-relative //)."""
    return [m.group(2) for m in _EXTERNAL.finditer(page)]


def _exporter(folder: str):
    from nbconvert import HTMLExporter

    base = Path(folder) / "attncert_offline"
    base.mkdir(exist_ok=True)
    (base / "index.html.j2").write_text(_OFFLINE_TEMPLATE)
    (base / "conf.json").write_text(json.dumps({"base_template": "lab"}))
    return HTMLExporter(template_name="attncert_offline", extra_template_basedirs=[folder],
                        embed_images=True, exclude_anchor_links=True)


def notebook_html(path: str | Path, exporter=None) -> str:
    """One executed notebook as a self-contained HTML page (no external script/link/img)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    if exporter is None:
        with tempfile.TemporaryDirectory() as d:
            return notebook_html(path, _exporter(d))
    page, _ = exporter.from_notebook_node(
        nb, resources={"metadata": {"name": describe(nb) or Path(path).stem,
                                    "path": str(Path(path).parent)}})
    refs = external_refs(page)
    if refs:
        raise RuntimeError(f"{path}: the HTML export references {refs[0]}")
    return page


def describe(nb) -> str:
    """The notebook's title: the first line of its first markdown cell, without '#'."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            return cell.source.strip().splitlines()[0].lstrip("#").strip()
    return ""


def _html_name(notebook: str) -> str:
    p = Path(notebook)
    try:
        rel = p.relative_to(NOTEBOOK_DIR)
    except ValueError:
        rel = Path(p.name)
    return rel.with_suffix(".html").as_posix()


def index_html(entries: Sequence[Mapping[str, Any]], title: str = "attncert reports") -> str:
    """The index page: one row per report (link or 'not run', description, headline numbers).

    ``entries``: {"stage", "run", "href" (None when not run), "description", "headline"
    (list of "label: value" strings)}."""
    esc = html.escape
    rows = []
    for e in entries:
        name = esc(e["stage"] + (f" @ {e['run']}" if e.get("run") else ""))
        missing = "no executed notebook" if e.get("headline") else "not run"
        link = f'<a href="{esc(e["href"])}">{name}</a>' if e.get("href") else \
            f'{name} <span class="nr">{missing}</span>'
        nums = "<br>".join(esc(h) for h in e.get("headline", []))
        rows.append(f"<tr><td>{link}</td><td>{esc(e.get('description') or '')}</td>"
                    f"<td class=\"num\">{nums}</td></tr>")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:75em}"
        "table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ccc;"
        "padding:.4em .6em;text-align:left;vertical-align:top}.num{font-size:.9em}"
        ".nr{color:#a00;font-size:.85em}</style>", "</head>", "<body>",
        f"<h1>{esc(title)}</h1>",
        "<p>Each report is an executed notebook of the pipeline, exported with its figures "
        "embedded; numbers are the headline rows of reports/metrics/summary.json.</p>",
        "<table>", "<tr><th>report</th><th>what it is</th><th>headline</th></tr>", *rows,
        "</table>", "</body>", "</html>", ""])


def _headline(data: Mapping[str, Any] | None, stage: str, run: str | None,
              limit: int = 8) -> list[str]:
    entry = (data or {}).get("stages", {}).get(stage)
    if not entry:
        return []
    rows = [r for r in entry["rows"] if r["brief"] and r.get("run") == run]
    return [f"{r['label']}: {_cell(r)}" for r in rows[:limit]]


def html_export(runs: Sequence[StageRun], out_dir: str | Path, data: Mapping | None = None,
                root: str | Path = ".", force: bool = False) -> list[Path]:
    """Export every executed notebook of ``runs`` into ``out_dir`` and write index.html.

    A page newer than its notebook is kept unless ``force``. ``data``: the summary (headline
    numbers for the index). Returns the pages written."""
    import nbformat

    root, out_dir = Path(root), Path(root) / out_dir
    written, entries = [], []
    with tempfile.TemporaryDirectory() as d:
        exporter = None
        for r in runs:
            if r.notebook is None:
                continue
            nb_path = root / r.notebook
            entry = {"stage": r.stage, "run": r.run, "href": None, "description": "",
                     "headline": _headline(data, r.stage, r.run)}
            entries.append(entry)
            if not nb_path.is_file():
                continue
            page = out_dir / _html_name(r.notebook)
            entry["href"] = _html_name(r.notebook)
            entry["description"] = describe(nbformat.read(nb_path, as_version=4))
            if force or not page.is_file() or page.stat().st_mtime < nb_path.stat().st_mtime:
                exporter = exporter or _exporter(d)
                page.parent.mkdir(parents=True, exist_ok=True)
                page.write_text(notebook_html(nb_path, exporter))
                written.append(page)
    index = out_dir / "index.html"
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(index_html(entries))
    return [*written, index]


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
        write_summary(fig.summary, summary(params, stages, required=fig.required))
        print(f"wrote {fig.summary}")
        return 0
    data = json.loads(Path(fig.summary).read_text()) if Path(fig.summary).is_file() else None
    pages = html_export(stage_runs(stages, params), fig.html_dir, data, force=args.force)
    print(f"{fig.html_dir}: {len(pages)} page(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
