"""Fake metrics of every stage in the stages' formats (the ``metrics_tree`` fixture) and the
independent readers the report tests check the summary against."""

import copy
import json
from pathlib import Path

from attncert.pipeline.params import read_yaml
from attncert.pipeline.runs import run_name
from attncert.report import rows as report
from attncert.stages.registry import validate

ROOT = Path(__file__).resolve().parents[1]
STAGES = report.read_stages(ROOT / "dvc.yaml")
RAW = read_yaml(ROOT / "params.yaml")
GRID = [("mnist", 1, 2, 0.5), ("mnist", 2, 2, 0.5)]


def _params():
    raw = copy.deepcopy(RAW)
    raw["vit_grid"].update(dataset=["mnist"], depth=[1, 2], heads=[2], gamma_vo=[0.5])
    return validate(raw)


def _write(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=True))


def _certify_metrics(name: str) -> dict:
    """A certify_vit metrics.json as attncert.certify.summarize + the notebook write it."""
    keys = [f"{v}_{t}" for v in ("lofast_M", "naive") for t in ("pairwise", "logit")]
    return {"run": name, "dataset": "mnist", "n": 50, "clean_acc": 0.82, "broken": 0,
            "forward_seconds_per_sample": 2.5e-4,
            "certified_acc": {k: {"0.1": 0.5 + i / 100, "1.58": 0.1 + i / 100}
                              for i, k in enumerate(keys)},
            "pgd_acc": {"0.1": 0.7, "1.58": 0.3},
            "median_radius": {k: 0.05 * (i + 1) for i, k in enumerate(keys)},
            "seconds_per_sample": {k: 1e-3 * (i + 1) for i, k in enumerate(keys)},
            "cost_vs_forward": {k: 4.0 * (i + 1) for i, k in enumerate(keys)},
            "attention": {"layers": ["blocks.0.attn"], "entropy": [0.99], "entropy_mean": 0.99,
                          "acc": 0.82, "acc_uniform": 0.8, "acc_identity": 0.7,
                          "uniform_gap": 2.0, "identity_gap": 12.0, "logit_max": 0.1,
                          "logit_cap": 0.177, "n": 50},
            "local_global_radius": 1.4}


def _text_model(family: str, test_acc: float, radii: dict, layers: int = 0) -> dict:
    """One model's entry of the text metrics (attncert.text.evaluate.evaluate_model, then
    attncert.stages.text)."""
    attention = ({"max_prob": [0.2] * layers, "uniform": 0.1, "max_prob_mean": 0.2,
                  "ratio": 2.0} if layers else
                 {"max_prob": [], "uniform": None, "max_prob_mean": None, "ratio": None})
    return {"family": family, "dev_acc": test_acc + 0.01, "test_acc": test_acc,
            "n_certified": 20, "n_attacked": 10, "avg_radius": radii,
            "avg_radius_correct": {k: v / test_acc for k, v in radii.items()},
            "avg_radius_invariant": {k: 1.5 * v for k, v in radii.items()},
            "gates": [[0.1, 0.2]] * layers if family == "olsa" else [],
            "alpha1": [4.0] * layers if family == "olsa" else [], "attention": attention,
            "b_att_mean": 0.1 if family == "olsa" and layers else None,
            "alpha1_mean": 4.0 if family == "olsa" and layers else None,
            "certified_acc": {"0.1": test_acc / 2, "0.5": test_acc / 4},
            "pgd_acc": {"0.1": test_acc - 0.1, "0.5": test_acc - 0.2}, "broken": 0,
            "cert_seconds_per_sentence": 0.001 if family != "none" else None,
            "train_seconds": 3.0,
            "epochs": 1, "gamma": 2.0}


def _text_metrics() -> dict:
    """The text stage's metrics file as attncert.stages.text writes it."""
    return {"scale": "smoke", "train_sentences": 64, "n_certified": 20, "eps": [0.1, 0.5],
            "reported_split": "test", "n_attacked": 10, "depth0": "olsa-L0-g2",
            "models": {"olsa-L0-g2": _text_model("olsa", 0.63, {"global": 0.5}),
                       "olsa-L1-g2": _text_model("olsa", 0.62, {"global": 0.31}, 1),
                       "olsa-L3-g2": _text_model("olsa", 0.64, {"global": 0.42}, 3),
                       "kim-l2-L3-g2": _text_model("olsa", 0.58, {"global": 0.21}, 3),
                       "vanilla-L3": _text_model("none", 0.7, {"none": 0.0}, 3),
                       "lofast-L1-H2-vo0.5": _text_model("lofast", 0.6,
                                                         {"lofast_M": 0.12, "global": 0.03}, 1),
                       "frozen-olsa": _text_model("olsa", 0.66, {"global": 0.05}, 1)},
            "attention_vs_depth0": {
                name: {"d_test_acc": acc - 0.63, "d_avg_radius": r - 0.5,
                       "d_avg_radius_correct": 0.0}
                for name, acc, r in (("olsa-L1-g2", 0.62, 0.31), ("olsa-L3-g2", 0.64, 0.42),
                                     ("kim-l2-L3-g2", 0.58, 0.21))},
            "paper": {"olsa_sst_avg_radius": 0.979, "olsa_softmax_lipschitz": 0.25,
                      "shi_sst_avg_radius": 0.11},
            "broken": 0, "seconds": 12.0}


def _crown_metrics(*datasets: str) -> dict:
    """The crown stage's metrics file as notebooks/09_crown.py writes it (accuracies in %)."""
    parts = {ds: _crown_part() for ds in datasets or ("cifar10", "svhn")}
    return {"datasets": parts, "eps": [0.02, 0.05, 0.1], "depths": [3], "broken": 0,
            "stage_seconds": 100.0}


def _crown_part() -> dict:
    """One dataset's entry of the crown metrics."""
    return {"n": 3, "crown_over_lofast_seconds": {"3": 120.0}, "broken": 0,
            "table1": [{"depth": 3, "method": "LoFAST", "seconds_per_sample": 0.05,
                        "acc_0.02": 66.7, "acc_0.05": 33.3, "acc_0.1": 0.0},
                       {"depth": 3, "method": "CROWN", "seconds_per_sample": 6.0,
                        "acc_0.02": 66.6, "acc_0.05": None, "acc_0.1": None}],
            "table2": [{"depth": 3, "eps": e, "method": "CROWN", "crown_acc": a,
                        "crown_seconds": 6.0 + i, "combined_acc": a + 10 * (i < 2),
                        "combined_seconds": 2.0 + i, "lofast_acc": a}
                       for i, (e, a) in enumerate(((0.02, 66.6), (0.05, 0.0), (0.1, 0.0)))],
            "crown_status": {"L3": {"ok": 5, "timeout": 4}},
            "trained": [{"depth": 3, "test_acc": 80.5, "train_seconds": 10.0}],
            "seconds": 50.0}


def metrics_tree(tmp_path):
    """Fake metrics of every stage in the stages' formats; the second grid point of
    certify_vit and the certvit stage are missing."""
    p = _params()
    _write(tmp_path / p["data"].metrics, {
        "mnist": {"dataset": "mnist", "kind": "image", "n_train": 2000, "n_test": 500,
                  "mean": [0.13], "std": [0.31], "shape": "1x28x28", "source": "mirror"}})
    _write(tmp_path / p["tightness"].metrics, {
        "layer": "seeded random layer", "max_lofast_M_over_pgd": 1.07,
        "fig1_delta21_M_over_pgd_max": 18.4, "fig3_ratio_max": 1.07,
        "fig4_lofast_M_over_pgd_max": 1.21, "fig3_eps": 0.1,
        "fig3_ratio": {t: {"0.1": 1.01, "1": 1.05} for t in ("W^Q", "W^V", "X")},
        "fig4_input_norm": {"0.5": 0.5, "2": 2.0},
        "fig4_ratio_to_pgd": {"LoFAST(M)": {"0.5": 1.01, "2": 1.2},
                              "naive": {"0.5": 1.5, "2": 3.0}},
        **{f"table3_{k}_over_pgd": {"0.01": 1.05 + i, "0.05": 1.06 + i, "0.2": 1.07 + i}
           for i, k in enumerate(("lofast_M", "lofast_xi", "naive", "specformer"))}})
    for point in GRID:
        name = run_name(*point)
        _write(tmp_path / p["vit_grid"].results_dir / name / "metrics.json", {
            "clean_acc": 0.34, "dataset": "mnist", "epochs": 1, "parameters": 7626,
            "run": name, "test_loss": 2.25, "train_seconds": 0.5})
    _write(tmp_path / p["certify_vit"].results_dir / run_name(*GRID[0]) / "metrics.json",
           _certify_metrics(run_name(*GRID[0])))
    _write(tmp_path / p["specformer"].metrics, {
        "scale": "smoke", "training": [],
        "robustness": {"cifar10/standard/vanilla/clean": 0.8,
                       "cifar10/standard/vanilla/FGSM 2/255": 0.4,
                       "cifar10/adversarial/specformer/PGD-2 2/255": 0.3},
        "step_time_ratio": {"vanilla": 1.0, "specformer": 1.3}, "msvp_step_ratio": 1.3,
        "msvp_step_ratio_within_paper": True, "max_sigma": {}, "layernorm_certificate": "x",
        "certified": [{"model": "with MSVP", "variant": "lofast_M", "clean_acc": 0.5,
                       "median_radius": 0.1, "certified@0.1": 0.25, "uniform_gap": 1.5,
                       "identity_gap": 3.0, "attn_entropy": 0.9}]})
    _write(tmp_path / p["text"].metrics, _text_metrics())
    _write(tmp_path / p["crown"].metrics, _crown_metrics())
    return p, tmp_path


def _lookup(m, key: str):
    """The value at a row key: path segments, where a key of the file may itself hold '/'."""
    if key in m:
        return m[key]
    parts = key.split("/")
    for i in range(len(parts) - 1, 0, -1):
        head = "/".join(parts[:i])
        if head in m:
            return _lookup(m[head], "/".join(parts[i:]))
    raise KeyError(key)


def _record(records: list, **match):
    """The one record of a list of records (a table the stage wrote) with these values."""
    found = [r for r in records if all(r[k] == v for k, v in match.items())]
    assert len(found) == 1, (match, records)
    return found[0]


def _file_value(stage: str, m, key: str):
    """The number a row's key names in the metrics file ``m``, read independently of the
    report: rows of tables written as lists of records are found by their columns."""
    parts = key.split("/")
    if stage == "specformer" and parts[0] == "certified":
        rec = _record(m["certified"], model=parts[1], variant=parts[2])
        return rec[parts[3]] if parts[3] in rec else rec[f"certified@{parts[3]}"]
    if stage == "crown" and parts[0] == "datasets" and parts[2] in ("trained", "table1",
                                                                    "table2"):
        m, parts = m["datasets"][parts[1]], parts[2:]
        depth = int(parts[1].removeprefix("L"))
        if parts[0] == "trained":
            return _record(m["trained"], depth=depth)[parts[2]]
        if parts[0] == "table1":
            return _record(m["table1"], depth=depth, method=parts[2])[parts[3]]
        rec = _record([r for r in m["table2"] if f"{r['eps']:g}" == parts[3]], depth=depth,
                      method=parts[2])
        return rec[parts[4]]
    return _lookup(m, key)


def _metrics_of(root: Path, entry: dict, row: dict):
    """The parsed metrics file a summary row was read from (its grid point's, if any)."""
    path = next(p for p in entry["metrics"] if row.get("run") is None or f"/{row['run']}/" in p)
    return json.loads((root / path).read_text())
