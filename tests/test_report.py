"""attncert.report.rows: the summary's numbers are the metrics files' numbers, README's results
section is regenerated in place, the HTML export is self-contained (checked in headless
Chromium where it is installed)."""

import base64
import copy
import io
import json
import re
import shutil
import struct
import subprocess
from pathlib import Path

import nbformat
import pandas as pd
import pytest

from attncert.figures import summary as summary_figs
from attncert.pipeline import dvcfile
from attncert.pipeline.context import make_context
from attncert.pipeline.params import read_yaml
from attncert.pipeline.runs import run_name
from attncert.report import htmlexport, paper
from attncert.report import readme as results_md
from attncert.report import rows as report
from attncert.stages import figures as figures_stage
from attncert.stages.registry import validate
from attncert.tightness import PAPER_TABLE3

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
            "cert_seconds_per_batch": 0.01, "cert_batch_size": 20, "train_seconds": 3.0,
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


@pytest.fixture
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


def test_summary_numbers_are_the_metrics_files_numbers(metrics_tree):
    params, root = metrics_tree
    data = figures_stage.summary(params, STAGES, root)
    assert data["order"][:4] == ["data", "tightness", "train_vit", "certify_vit"]
    assert figures_stage.FIGURES_STAGE not in data["stages"]
    checked = 0
    for name, entry in data["stages"].items():
        for row in entry["rows"]:
            assert row["ours"] == _file_value(name, _metrics_of(root, entry, row), row["key"])
            checked += 1
    assert checked > 100
    rows = {r["key"]: r for r in data["stages"]["tightness"]["rows"]}
    i = PAPER_TABLE3["eps"].index(0.05)
    # Table 3's LoFAST row is sec. 5.1's bound, the xi form: beside our LoFAST(xi), not (M)
    assert rows["table3_lofast_xi_over_pgd/0.05"]["paper"] == pytest.approx(
        PAPER_TABLE3["LoFAST"][i] / PAPER_TABLE3["PGD"][i])
    assert rows["table3_lofast_M_over_pgd/0.05"]["paper"] is None
    assert rows["table3_lofast_xi_over_pgd/0.2"]["paper"] is None   # not an eps of Table 3
    assert rows["table3_specformer_over_pgd/0.05"]["paper"] == pytest.approx(90.600 / 0.1427)
    from attncert.stages import tightness as tightness_stage

    cpu = {r["key"]: r for r in tightness_stage.headline_rows(
        {"scale": "cpu", "table3_lofast_xi_over_pgd": {"0.05": 2.0}}, {})}
    assert "not like for like" in cpu["table3_lofast_xi_over_pgd/0.05"]["source"]
    spec = {r["key"]: r for r in data["stages"]["specformer"]["rows"]}
    # SpecFormer's Table 1 is of its ViT-S fine-tuned on CIFAR-10, not a ViT trained from scratch
    assert spec["robustness/cifar10/standard/vanilla/FGSM 2/255"]["paper"] is None
    from attncert.stages import specformer as specformer_stage

    vit_s = {r["key"]: r for r in specformer_stage.headline_rows(
        {"robustness": {f"{specformer_stage.TABLE1_RUN}/standard/vanilla/FGSM 2/255": 0.5}},
        {})}
    assert vit_s[f"robustness/{specformer_stage.TABLE1_RUN}/standard/vanilla/FGSM 2/255"][
        "paper"] == pytest.approx(0.4556)
    assert spec["certified/with MSVP/lofast_M/0.1"]["ours"] == 0.25
    cert = data["stages"]["certify_vit"]
    assert cert["status"] == "partial" and cert["runs"] == [run_name(*g) for g in GRID]
    assert cert["missing"] == [f"results/vit/{run_name(*GRID[1])}/metrics.json"]
    # the grid (LoFAST Figure 2's models) carries no other paper's number: only the MNIST
    # anchors at eps 1.58, labelled as other models and training
    anchors = [r for r in cert["rows"] if r["paper"] is not None]
    assert [(r["key"], r["paper"]) for r in anchors] == [
        ("certified_acc/lofast_M_pairwise/1.58", 0.628)]
    assert "not like for like" in anchors[0]["source"] and "54.5%" in anchors[0]["source"]
    gap = next(r for r in cert["rows"] if r["key"].endswith("attention/uniform_gap"))
    assert gap["ours"] == 2.0 and gap["brief"]
    assert data["stages"]["train_vit"]["status"] == "ok"
    assert data["stages"]["certvit"] == {"status": "not run", "metrics": [],
                                         "missing": [params["certvit"].metrics], "runs": None,
                                         "rows": []}
    assert json.loads(json.dumps(data)) == data   # plain JSON


def test_figures_run_writes_the_summary_the_certified_table_and_the_index(metrics_tree,
                                                                           monkeypatch):
    """The stage's run, from dvc.yaml and params.yaml in the working directory: summary.json
    is the summary of the metrics on disk, the CSV holds the grid point that was certified,
    index.html lists every report."""
    params, root = metrics_tree
    raw = copy.deepcopy(RAW)
    raw["vit_grid"].update(dataset=["mnist"], depth=[1, 2], heads=[2], gamma_vo=[0.5])
    (root / "params.yaml").write_text(json.dumps(raw))   # JSON is YAML 1.2
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    monkeypatch.chdir(root)
    p = params["figures"]
    res = figures_stage.run(p, make_context(study=params))
    written = json.loads((root / p.summary).read_text())
    assert written == res.summary == figures_stage.summary(params, STAGES, root)
    csv = (root / p.certified_csv).read_text().splitlines()
    assert csv[0] == "run,variant,eps,accuracy" and len(csv) > 1
    assert {line.split(",")[0] for line in csv[1:]} == {run_name(*GRID[0])}
    assert res.pages == [Path(p.html_dir) / "index.html"]
    index = (root / p.html_dir / "index.html").read_text()
    assert index.count("not run") + index.count("no executed notebook") == len(res.runs)
    assert res.note("certvit") and res.note("tightness") is None
    assert set(res.metrics("certify_vit")) == {run_name(*GRID[0])}
    assert res.rows("tightness") == written["stages"]["tightness"]["rows"]


def test_text_rows_put_olsas_sst_radius_beside_every_3_layer_olsa():
    m = _text_metrics()
    rows = {r["key"]: r for r in report.headline_rows("text", m)}
    olsa3 = rows["models/olsa-L3-g2/avg_radius_invariant/global"]  # OLSA's averaging rule
    assert olsa3["ours"] == pytest.approx(0.63) and olsa3["paper"] == paper.OLSA_AVG_RADIUS["sst"]
    assert rows["models/olsa-L3-g2/avg_radius/global"]["paper"] is None  # ours: 0 where wrong
    assert olsa3["brief"] and olsa3["source"].startswith("OLSA section 5")
    assert f"{paper.OLSA_SHI_AVG_RADIUS['sst']:g}" in olsa3["source"]
    assert "1/4" not in olsa3["source"] and "0.25: unsound" in olsa3["source"]  # labelled
    correct = rows["models/olsa-L3-g2/avg_radius_correct/global"]
    assert correct["ours"] == pytest.approx(0.42 / 0.64) and correct["brief"]
    assert correct["paper"] is None   # OLSA's rule counts every sentence's prediction
    assert rows["attention_vs_depth0/olsa-L3-g2/d_test_acc"]["ours"] == pytest.approx(0.01)
    assert rows["attention_vs_depth0/olsa-L3-g2/d_avg_radius"]["ours"] == pytest.approx(-0.08)
    assert rows["models/olsa-L3-g2/attention/ratio"]["ours"] == 2.0
    assert rows["models/olsa-L3-g2/b_att_mean"]["ours"] == pytest.approx(0.1)
    assert rows["models/olsa-L3-g2/alpha1_mean"]["ours"] == 4.0
    assert "models/olsa-L0-g2/attention/ratio" not in rows   # depth 0: no attention
    for other in ("olsa-L0-g2", "olsa-L1-g2", "kim-l2-L3-g2", "frozen-olsa"):   # not the paper's
        assert rows[f"models/{other}/avg_radius_invariant/global"]["paper"] is None
    # the standard transformer has no certificate; the paper's numbers are never "ours"
    assert not [k for k in rows if k.startswith(("models/vanilla-L3/avg", "paper"))]
    assert rows["models/vanilla-L3/test_acc"]["brief"]
    lofast = {k: r["brief"] for k, r in rows.items() if "lofast-L1-H2-vo0.5/avg_radius" in k}
    assert lofast == {"models/lofast-L1-H2-vo0.5/avg_radius/lofast_M": True,   # the largest
                      "models/lofast-L1-H2-vo0.5/avg_radius/global": False,
                      "models/lofast-L1-H2-vo0.5/avg_radius_correct/lofast_M": True,
                      "models/lofast-L1-H2-vo0.5/avg_radius_correct/global": False,
                      "models/lofast-L1-H2-vo0.5/avg_radius_invariant/lofast_M": True,
                      "models/lofast-L1-H2-vo0.5/avg_radius_invariant/global": False}
    assert rows["models/olsa-L1-g2/certified_acc/0.5"]["unit"] == "fraction"
    assert rows["models/olsa-L1-g2/cert_seconds_per_batch"]["unit"] == "seconds"
    brief = [r for r in rows.values() if r["brief"]]
    # accuracy per model; three radii per certified model (0 where wrong, correct only,
    # OLSA's rule); two differences to depth 0 and the attention ratio per OLSA-family model
    # with attention; three counts
    assert len(brief) == len(m["models"]) + 3 * 6 + 2 * 3 + 4 + 3
    assert rows["n_attacked"]["ours"] == 10 and rows["broken"]["brief"]
    dev = report.headline_rows("text", m | {"reported_split": "dev"})
    assert next(r for r in dev if r["key"] == "models/olsa-L3-g2/test_acc")["label"] \
        == "olsa-L3-g2 dev accuracy"


def test_crown_rows_follow_lofast_tables_1_and_2():
    """Per dataset: Table 1's paper values beside CIFAR-10's rows only, Table 2's beside
    CIFAR-10's and SVHN's (3 layers, eps 0.02 / 0.05), none beside another dataset's."""
    t1 = paper.LOFAST_TABLE1
    rows = {r["key"]: r for r in report.headline_rows("crown", _crown_metrics())}
    c, s = "datasets/cifar10/", "datasets/svhn/"
    assert rows[f"{c}table1/L3/LoFAST/acc_0.02"]["paper"] == t1["lofast"][3][0]
    assert rows[f"{c}table1/L3/LoFAST/acc_0.02"]["unit"] == "percent"
    assert rows[f"{c}table1/L3/LoFAST/acc_0.02"]["label"] == "cifar10 L3 LoFAST certified at " \
        "eps 0.02"
    assert rows[f"{c}table1/L3/CROWN/acc_0.02"]["paper"] == t1["crown"][3][0]
    assert rows[f"{c}table1/L3/CROWN/acc_0.05"]["ours"] is None   # every bound failed: "-"
    assert rows[f"{c}table1/L3/CROWN/acc_0.1"]["paper"] is None   # the paper's "-"
    assert rows[f"{c}table1/L3/LoFAST/seconds_per_sample"]["paper"] == t1["lofast_seconds"][3]
    assert rows[f"{c}table1/L3/CROWN/seconds_per_sample"]["paper"] == t1["crown_seconds"][3]
    assert rows[f"{s}table1/L3/LoFAST/acc_0.02"]["paper"] is None   # Table 1 is CIFAR-10's
    for ds in ("cifar10", "svhn"):
        t2 = paper.LOFAST_TABLE2[ds]
        k = f"datasets/{ds}/table2/L3/CROWN/"
        assert rows[f"{k}0.05/combined_acc"]["paper"] == t2["CROWN+LoFAST"][1][0]
        assert rows[f"{k}0.02/crown_seconds"]["paper"] == t2["CROWN"][0][1]
        assert rows[f"{k}0.1/combined_acc"]["paper"] is None   # not in Table 2
    assert paper.LOFAST_TABLE2["svhn"] != paper.LOFAST_TABLE2["cifar10"]
    assert rows[f"{c}crown_over_lofast_seconds/3"]["paper"] == pytest.approx(
        t1["crown_seconds"][3] / t1["lofast_seconds"][3])
    assert rows[f"{c}trained/L3/test_acc"]["ours"] == 80.5
    assert rows["broken"]["ours"] == 0 and rows[f"{s}n"]["ours"] == 3
    # another dataset: the paper's accuracies and seconds are not the same quantity
    other = report.headline_rows("crown", _crown_metrics("mnist"))
    assert {r["key"] for r in other if r["paper"] is not None} == set()  # nor the speed ratio
    # CROWN alone not measured (no sample of its own, crown_acc None): not Table 2's CROWN row
    part = _crown_part()
    part["table2"][0]["crown_acc"] = None
    skipped = {r["key"]: r for r in report.headline_rows("crown", {"datasets": {"cifar10": part}})}
    secs = skipped[f"{c}table2/L3/CROWN/0.02/crown_seconds"]
    assert secs["paper"] is None and "where LoFAST did not certify" in secs["label"]
    # measured on its own sample (the first 2 of 3 points): beside the paper, the sample named
    part = _crown_part()
    part["table2"][0]["crown_n"] = 2
    sample = {r["key"]: r for r in report.headline_rows("crown", {"datasets": {"cifar10": part}})}
    acc = sample[f"{c}table2/L3/CROWN/0.02/crown_acc"]
    assert acc["paper"] is not None and "(its first 2 points)" in acc["label"]


def test_summary_paths_come_from_params_and_run_name():
    params = _params()
    runs = [r for r in report.stage_runs(STAGES, params) if r.stage == "certify_vit"]
    assert [r.metrics for r in runs] == [
        (f"{params['certify_vit'].results_dir}/{run_name(*g)}/metrics.json",) for g in GRID]


def test_unknown_stage_is_read_generically_and_required_stages_must_exist(metrics_tree):
    params, root = metrics_tree
    stages = {**STAGES, "extra": {"cmd": "true",
                                  "outs": [{"reports/extra.json": {"type": "details"}}]}}
    _write(root / "reports/extra.json", {"radius": {"sst2": 0.9, "yelp": 1.7}, "note": "x",
                                         "per_sample": [1, 2]})
    rows = figures_stage.summary(params, stages, root)["stages"]["extra"]["rows"]
    assert {r["key"]: r["ours"] for r in rows} == {"radius/sst2": 0.9, "radius/yelp": 1.7}
    with pytest.raises(figures_stage.MissingMetricsError, match="certvit"):
        figures_stage.summary(params, STAGES, root, required=["certvit"])
    with pytest.raises(ValueError, match="not declared"):
        figures_stage.summary(params, STAGES, root, required=["nope"])


def test_readme_section_is_idempotent_and_only_touches_its_block(metrics_tree, tmp_path):
    params, root = metrics_tree
    summary_path = tmp_path / "summary.json"
    _write(summary_path, figures_stage.summary(params, STAGES, root))
    before, after = "# title\n\nintro\n\n## Results\n\n", "\n\n## Next\n\ntext\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"{before}{results_md.README_START}\nold\n{results_md.README_END}{after}")
    results = tmp_path / "results.md"
    results.write_text(f"# Results\n\n{results_md.README_START}\n{results_md.README_END}\n")
    assert results_md.update_readme(readme, summary_path, results)
    first = readme.read_text()
    # README: the first rows of each table; the results page: every brief row
    data = json.loads(summary_path.read_text())
    assert results.read_text().count("\n| ") > first.count("\n| ") or all(
        len([r for r in e["rows"] if r["brief"]]) <= results_md.README_ROWS
        for e in data["stages"].values())
    assert results_md.render_results(data, None) in results.read_text()
    assert first.startswith(before + results_md.README_START) and first.endswith(
        results_md.README_END + after)
    assert "\nold\n" not in first and "| run |" in first, first
    assert "| paper source |" in first  # the papers beside ours where a setting matches
    assert "**certvit**: not run" in first
    assert not results_md.update_readme(readme, summary_path, results)
    assert readme.read_text() == first
    with pytest.raises(ValueError, match="exactly one"):
        results_md.replace_section("no markers", "x")


def test_the_readme_keeps_the_first_rows_of_each_table(metrics_tree):
    """README's results: at most README_ROWS rows per table, the others counted and linked
    to docs/results.md; each kept row is the full page's row."""
    params, root = metrics_tree
    data = figures_stage.summary(params, STAGES, root)
    full, short = (_readme_tables(results_md.render_results(data, limit))
                   for limit in (None, 1))
    assert set(full) == set(short)
    for name, rows in full.items():
        assert short[name] == rows[:1]
    if any(len(rows) > 1 for rows in full.values()):
        assert "more rows in [docs/results.md]" in results_md.render_results(data, 1)


def _readme_tables(text: str) -> dict[str, list[dict[str, str]]]:
    """The results section's tables, parsed back: {stage: [{column: cell}]}."""
    tables, stage, header = {}, None, None
    for line in text.splitlines():
        heading = re.fullmatch(r"\*\*(\w+)\*\*: .*", line)
        if heading:
            stage, header = heading.group(1), None
            tables[stage] = []
        elif stage and line.startswith("|") and not line.startswith("|---"):
            cells = [c.strip().replace("\\|", "|")
                     for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if header is None:
                header = cells
            else:
                tables[stage].append(dict(zip(header, cells, strict=True)))
    return tables


def test_readme_numbers_are_the_metrics_files_numbers(metrics_tree):
    """Every number of the README's results section, parsed back from the markdown, is the
    metrics file's number (formatted), and the paper's number beside it is paper.py's."""
    params, root = metrics_tree
    data = figures_stage.summary(params, STAGES, root)
    tables = _readme_tables(results_md.render_results(data))
    assert set(tables) == set(data["stages"])
    shown = 0
    for name, entry in data["stages"].items():
        brief = [r for r in entry["rows"] if r["brief"]]
        if entry["runs"] is None:
            cells = {t["quantity"]: t for t in tables[name]}
            assert len(cells) == len(tables[name]) == len(brief)
        else:
            cells = {(t["run"], label): v for t in tables[name] for label, v in t.items()
                     if label != "run" and v != "–"}
            assert len(cells) == len(brief)
        for row in brief:
            ours = results_md.fmt(_file_value(name, _metrics_of(root, entry, row), row["key"]),
                              row["unit"])
            theirs = results_md.fmt(row["paper"], row["unit"])
            if entry["runs"] is None:
                cell = cells[row["label"]]
                assert (cell["ours"], cell["paper"]) == (ours, theirs), row["key"]
                assert cell["paper source"] == (row["source"] or "")
            else:
                cell = cells[(row["run"], row["label"])]
                assert cell == (ours if row["paper"] is None else f"{ours} (paper {theirs})")
            shown += 1
    assert shown > 30
    crown = {t["quantity"]: t for t in tables["crown"]}
    assert crown["cifar10 L3 LoFAST certified at eps 0.02"]["paper"] == "29.1%"   # LoFAST Table 1
    assert crown["svhn L3 LoFAST certified at eps 0.02"]["paper"] == "–"   # CIFAR-10 only
    text = {t["quantity"]: t for t in tables["text"]}
    assert text["olsa-L3-g2 average certified radius (global; 0 if wrong)"]["paper"] == "–"
    olsas_rule = ("olsa-L3-g2 average radius of the prediction (global; every sentence, right or "
                  "wrong: OLSA sec. 5.1's rule)")
    assert text[olsas_rule]["paper"] == "0.979"


def test_notebook_tables_are_the_metrics_files_numbers(metrics_tree):
    """The figures notebook's headline tables (accuracies in %) carry the files' numbers."""
    from attncert.figures import summary as figs

    params, root = metrics_tree
    data = figures_stage.summary(params, STAGES, root)
    for name, entry in data["stages"].items():
        table = figs.headline_frame(entry["rows"])
        assert len(table) == len(entry["rows"])
        for row, ours in zip(entry["rows"], table["ours"], strict=True):
            value = _file_value(name, _metrics_of(root, entry, row), row["key"])
            scale = 100 if row["unit"] == "fraction" else 1
            assert (ours is None or ours != ours) if value is None else (
                ours == pytest.approx(scale * value)), (name, row["key"])


def test_comparison_figures_draw_from_saved_metrics_with_the_papers_beside(metrics_tree):
    """Every figure of the figures notebook, drawn from the fake metrics (no recomputation),
    with the papers' numbers as labelled rows where a paper gives them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attncert.figures import summary as figs

    params, root = metrics_tree
    runs = report.stage_runs(STAGES, params)
    loaded = dvcfile.collect(runs, root)
    data = figures_stage.summary(params, STAGES, root)
    m = {stage: dvcfile.stage_metrics(loaded, stage) for stage in STAGES}
    points = m["certify_vit"]
    crown = figs.crown_frame(m["crown"]["crown"])
    assert {"ours (cifar10)", "ours (svhn)", "paper: LoFAST Table 1 (cifar10)",
            "paper: LoFAST Table 2 (svhn)"} <= set(crown["source"])
    assert crown["accuracy"].notna().all()   # a "-" is no point, not a 0
    cost = figs.cost_frame(points, m["crown"]["crown"])
    assert {"LoFAST L=3 (crown stage, cifar10)", "CROWN L=3 (crown stage, svhn)"} <= set(
        cost["method"])
    # LoFAST Table 1's seconds only beside the crown stage's CIFAR-10 depths (its 128-d ViTs)
    theirs = cost[cost["source"].str.startswith("paper")]
    assert sorted(theirs["method"]) == ["CROWN L=3 (crown stage, cifar10)",
                                        "LoFAST L=3 (crown stage, cifar10)"]
    assert figs.cost_frame(points, _crown_metrics("svhn"))["source"].eq(figs.OURS).all()
    text = figs.text_certified_frame(m["text"]["text"])
    # every certified model of _text_metrics (six: all but the standard transformer) x 2 eps
    assert "vanilla-L3" not in set(text["model"]) and len(text) == 2 * 6
    fig3, fig4 = figs.ablation_frames(m["tightness"]["tightness"])
    assert len(fig3) == 6 and len(fig4) == 4
    figures = [
        figs.plot_tightness(figs.tightness_frame(m["tightness"]["tightness"])),
        figs.plot_ablations(fig3, fig4, m["tightness"]["tightness"]["fig3_eps"]),
        figs.plot_certified_grid(figs.certified_frame(points)),
        figs.plot_tradeoff(figs.tradeoff_frame(points)),
        figs.plot_cost(cost),
        figs.plot_specformer(figs.specformer_frame(m["specformer"]["specformer"])),
        figs.plot_text_certified(text),
        figs.plot_crown(crown),
        *(figs.plot_headline(data["stages"][s]["rows"], s) for s in ("text", "crown"))]
    for fig in figures:
        assert fig is not None and fig.axes
        plt.close(fig)


def test_dvc_metrics_show_prints_every_stages_headline_numbers(metrics_tree):
    """summary.json's numbers reach `dvc metrics show` (which drops lists): every brief row
    with a number is under headline.<stage>[.<run>].<key> and equals the metrics file's."""
    from dvc.repo.metrics.show import _extract_metrics  # what `dvc metrics show` reads
    from dvc.utils.flatten import flatten

    params, root = metrics_tree
    data = figures_stage.summary(params, STAGES, root)
    shown = flatten(_extract_metrics(json.loads(json.dumps(data)), "summary.json"))
    expected = {".".join(["headline", name, *([r["run"]] if r.get("run") else []), r["key"]]):
                _file_value(name, _metrics_of(root, entry, r), r["key"])
                for name, entry in data["stages"].items() for r in entry["rows"]
                if r["brief"] and r["ours"] is not None}
    assert {k: v for k, v in shown.items() if k.startswith("headline.")} == expected
    ran = {name for name, e in data["stages"].items() if e["metrics"]}
    assert {k.split(".")[1] for k in expected} == ran - {"data"}   # data: counts only, not brief


def _png(width: int = 40, height: int = 30) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(width / 10, height / 10), dpi=10)
    ax.plot([0, 1], [1, 0])
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _executed_notebook(path: Path, title: str) -> None:
    """A small executed notebook (outputs written in, no kernel): a heading, a figure."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# {title}\n\nA tiny report, $x^2$."),
                nbformat.v4.new_code_cell("show(fig)", execution_count=1, outputs=[
                    nbformat.v4.new_output("display_data", data={
                        "image/png": _png(), "text/plain": "<Figure>"})])]
    path.parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, path)


def _img_sources(page: str) -> list[str]:
    return re.findall(r"<img\b[^>]*\bsrc=\"([^\"]+)\"", page)


def _png_size(uri: str) -> tuple[int, int]:
    raw = base64.b64decode(uri.split(",", 1)[1])
    assert raw[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", raw[16:24])


def test_html_export_is_self_contained(tmp_path):
    nb = tmp_path / "01_tiny.ipynb"
    _executed_notebook(nb, "01 · Tiny")
    page = htmlexport.notebook_html(nb)
    assert htmlexport.external_refs(page) == []
    assert not re.search(r"<(script|link|img)\b[^>]*(src|href)=\"?(https?:)?//", page, re.I)
    sources = _img_sources(page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert htmlexport.external_refs('<script src="https://cdn.x/require.js"></script>') == [
        "https://cdn.x/require.js"]


def _key_figure(root: Path, name: str) -> None:
    """A PNG the figures notebook would save for the index page."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(3, 2))
    ax.plot([0, 1], [1, 0])
    path = root / "reports/html" / htmlexport.KEY_FIGURES / name
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)


def _tiny_reports(root: Path) -> list:
    _key_figure(root, "02_certified_accuracy_vs_eps.png")
    _key_figure(root, "01_tightness_of_every_bound.png")
    runs = []
    for stage, title in (("data", "01 · Tiny data"), ("tightness", "02 · Tiny tightness")):
        nb = f"{dvcfile.NOTEBOOK_DIR}/{title[:2]}_{stage}.ipynb"
        _executed_notebook(root / nb, title)
        runs.append(report.StageRun(stage, None, {}, nb, ()))
    runs.append(report.StageRun("specformer", None, {}, f"{dvcfile.NOTEBOOK_DIR}/05_x.ipynb", ()))
    return runs


def test_index_links_every_report(tmp_path):
    pages = htmlexport.html_export(_tiny_reports(tmp_path), "reports/html", None, tmp_path)
    assert [p.name for p in pages] == ["01_data.html", "02_tightness.html", "index.html"]
    index = (tmp_path / "reports/html/index.html").read_text()
    assert 'href="01_data.html"' in index and "01 · Tiny data" in index
    assert "specformer <span class=\"nr\">not run</span>" in index
    assert htmlexport.external_refs(index) == []
    # the index opens on the key figures, embedded, in their order, before the reports
    captions = re.findall(r"<figcaption>([^<]+)</figcaption>", index)
    assert captions == ["tightness of every bound", "certified accuracy vs eps"]
    assert index.index("<figure>") < index.index("<table>")
    assert all(src.startswith("data:image/png;base64,") for src in _img_sources(index))
    # pages newer than their notebooks are kept
    assert htmlexport.html_export(_tiny_reports(tmp_path), "reports/html", None, tmp_path)[-1:] == [
        tmp_path / "reports/html/index.html"]


CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


#: appended to a copy of a page: after the load event (every image decoded or failed), the
#: body records how many images the browser rendered ("loaded/total")
_PROBE = ('<script>addEventListener("load", () => {const i = [...document.images]; '
          'document.body.dataset.figures = i.filter(x => x.complete && x.naturalWidth > 0)'
          '.length + "/" + i.length;});</script>')


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package "
                    "'chromium'; .ci/run installs it where apt-get is available)")
def test_reports_render_in_headless_chromium(tmp_path):
    htmlexport.html_export(_tiny_reports(tmp_path), "reports/html", None, tmp_path)
    html_dir = tmp_path / "reports/html"

    def chromium(*args: str) -> subprocess.CompletedProcess:
        profile = tmp_path / f"profile{len(list(tmp_path.glob('profile*')))}"
        return subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=120, check=True)

    shot = tmp_path / "index.png"
    chromium(f"--screenshot={shot}", "--window-size=1200,900", (html_dir / "index.html").as_uri())
    assert shot.is_file() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _png_size("x," + base64.b64encode(shot.read_bytes()).decode()) == (1200, 900)
    artefacts = ROOT / ".tmp" / "test_report"
    artefacts.mkdir(parents=True, exist_ok=True)
    shutil.copy(shot, artefacts / "index.png")
    index = chromium("--dump-dom", (html_dir / "index.html").as_uri()).stdout
    links = re.findall(r'<a href="([^"]+)"', index)
    assert links == ["01_data.html", "02_tightness.html"]   # every report that ran
    for link in ["index.html", *links]:   # every figure of the index and of every report
        page = (html_dir / link).read_text()
        probe = html_dir / f"probe_{link}"
        probe.write_text(page.replace("</body>", _PROBE + "</body>"))
        dom = chromium("--virtual-time-budget=10000", "--dump-dom", probe.as_uri()).stdout
        assert "Tiny" in dom
        assert "<td></td><td></td><td" not in dom, f"{link}: an empty table row"
        loaded = re.search(r'data-figures="(\d+)/(\d+)"', dom)
        assert loaded, f"{link}: the page did not finish loading"
        assert int(loaded.group(2)) > 0 and loaded.group(1) == loaded.group(2), (
            f"{link}: {loaded.group(1)} of {loaded.group(2)} figures rendered")
        for src in _img_sources(dom):
            assert src.startswith("data:image/png;base64,")
            width, height = _png_size(src)
            assert width > 0 and height > 0


def test_fmt_shows_a_failed_value_as_a_dash():
    from attncert.report.readme import fmt

    assert fmt(float("nan"), "percent") == fmt(None, "fraction") == "–"
    assert fmt(80.0, "percent") == "80.0%"
    # numbers at a precision that shows them: a ratio just above 1, long times, flags
    assert fmt(1.00015, "ratio") == "1.00015" and fmt(1.00015, "value") == "1.00015"
    assert fmt(1104.6, "seconds") == "1,105 s" and fmt(3.14159, "seconds") == "3.14 s"
    assert (fmt(1, "flag"), fmt(False, "flag")) == ("yes", "no")


def test_certvit_rows_headline_pairwise_bound_and_the_paper_mode_beside():
    # 0.4867: CertViT's MNIST eps (1.58 on its normalised input) in pixels
    m = {"dataset": "mnist", "test_clean_acc": 0.8, "headline_mode": "spectral",
         "certified_acc": {"0.5": 0.5, "0.4867": 0.1}, "pgd_acc": {"0.5": 0.7, "0.4867": 0.2},
         "lipschitz": {"final": 5.0}, "lipschitz_pairwise": {"final": 2.5}, "broken": 0,
         "modes": {"paper": {"test_clean_acc": 0.7, "certified_acc": {"0.4867": 0.0},
                             "lipschitz_pairwise": {"final": 1e6}},
                   "spectral": {"test_clean_acc": 0.8}}}
    rows = {r["key"]: r for r in report.headline_rows("certvit", m)}
    assert rows["lipschitz_pairwise/final"]["ours"] == 2.5  # the certificate's constant
    # the section's own model is not CertViT Table 1's: no paper number beside it
    assert rows["lipschitz_pairwise/final"]["paper"] is None
    assert rows["modes/paper/certified_acc/0.4867"]["brief"]
    assert rows["modes/paper/lipschitz_pairwise/final"]["ours"] == 1e6
    assert not any(k.startswith("modes/spectral") for k in rows)
    assert not any(k.startswith("linear_baseline") for k in rows)
    m["linear_baseline"] = {"clean_acc": 0.9, "certified_acc": {"0.5": 0.76, "0.4867": 0.13},
                            "broken": 0}
    rows = {r["key"]: r for r in report.headline_rows("certvit", m)}
    assert rows["linear_baseline/certified_acc/0.4867"]["ours"] == 0.13
    assert rows["linear_baseline/certified_acc/0.4867"]["brief"]
    assert not rows["linear_baseline/certified_acc/0.5"]["brief"]
    assert rows["linear_baseline/clean_acc"]["brief"]
    del m["lipschitz_pairwise"]  # metrics written before the pairwise constant existed
    rows = {r["key"]: r for r in report.headline_rows("certvit", m)}
    assert rows["lipschitz/final"]["ours"] == 5.0


def test_grid_points_sit_beside_the_baseline_on_the_same_images_and_the_frontier():
    """The linear baseline is certified on the grid point's first n test images (n the smaller
    count), each row carries its split and counts, the frontier's rows are labelled
    validation; a dataset the baseline did not certify gets no baseline row."""
    m = {"dataset": "mnist", "n": 4, "clean_acc": 0.75, "n_attacked": 4,
         "certified_acc": {"lofast_M_pairwise": {"0.5": 0.5, "1.0": 0.25}},
         "pgd_acc": {"0.5": 0.75, "1.0": 0.5}}
    grid = pd.DataFrame({"index": range(4), "correct": [True, True, True, False],
                         "radius_lofast_M_pairwise": [0.6, 1.2, 0.1, 2.0]})
    base = pd.DataFrame({"mode": "linear", "index": [2, 1, 0], "correct": [True, False, True],
                         "radius": [0.7, 3.0, 0.4]})
    baseline = {"dataset": "mnist", "samples": base, "n_attacked": 3,
                "metrics": {"n_attacked": 3, "pgd_acc": {"0.5": 0.5, "1.0": 0.25, "2.0": 0.0}}}
    frontier = {"selected": "lofast-0.5", "rows": [
        {"dataset": "mnist", "setting": s, "kind": s.split("-")[0], "clean": c,
         "certified@0.5": 50.0, "pgd@0.5": 60.0, "n_val": 10, "n_attacked": 10}
        for s, c in (("lmt-0.2", 99.0), ("lofast-0.5", 95.0), ("linear-0.5", 90.0))]
        + [{"dataset": "fashion_mnist", "setting": "lofast-0.5", "kind": "lofast",
            "clean": 80.0, "certified@0.5": 40.0, "pgd@0.5": 50.0, "n_val": 10,
            "n_attacked": 10}]}
    t = summary_figs.beside_baselines({"p": m, "q": {**m, "dataset": "svhn"}},
                                      {"p": grid, "q": grid}, baseline, frontier)
    p = t[t.point == "p"].set_index("model")
    assert list(p.index) == ["ViT (lofast_M_pairwise)", "linear baseline (certvit stage)",
                             "frontier lofast-0.5", "frontier linear-0.5"]
    vit, lin = p.loc["ViT (lofast_M_pairwise)"], p.loc["linear baseline (certvit stage)"]
    assert vit["n"] == lin["n"] == 3 and vit["split"] == lin["split"] == "test"
    assert vit["clean"] == 100.0 and vit["certified@0.5"] == pytest.approx(100 * 2 / 3)
    assert vit["certified@1"] == pytest.approx(100 / 3) and vit["pgd@0.5"] == 75.0
    assert lin["clean"] == pytest.approx(100 * 2 / 3)   # images 0 and 2 of the sorted index
    assert lin["certified@0.5"] == pytest.approx(100 / 3) and lin["certified@1"] == 0.0
    assert lin["n_attacked"] == 3 and "pgd@2" not in t   # only the grid's eps
    assert p.loc["frontier lofast-0.5", "split"] == "validation"
    assert p.loc["frontier lofast-0.5", "clean"] == 95.0
    assert pd.isna(p.loc["frontier lofast-0.5", "certified@1"])   # not measured there
    q = t[t.point == "q"]
    assert list(q.model) == ["ViT (lofast_M_pairwise)"] and q.n.iloc[0] == 4
