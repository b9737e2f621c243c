"""attncert.report.rows: the summary's numbers are the metrics files' numbers, every stage's
headline rows, the comparison figures drawn from saved metrics (README's results section:
test_readme.py; the HTML export: test_htmlexport.py)."""

import copy
import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from reportdata import (
    GRID,
    RAW,
    ROOT,
    STAGES,
    _crown_metrics,
    _crown_part,
    _file_value,
    _metrics_of,
    _params,
    _text_metrics,
    _write,
)

from attncert.figures import summary as summary_figs
from attncert.pipeline import dvcfile
from attncert.pipeline.context import make_context
from attncert.pipeline.runs import run_name
from attncert.report import paper
from attncert.report import rows as report
from attncert.stages import figures as figures_stage
from attncert.tightness import PAPER_TABLE3


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
    assert rows["models/olsa-L1-g2/cert_seconds_per_sentence"]["unit"] == "seconds"
    assert "models/vanilla-L3/cert_seconds_per_sentence" not in rows  # nothing certified
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
