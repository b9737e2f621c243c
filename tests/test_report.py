"""attncert.report: the summary's numbers are the metrics files' numbers, README's results
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
import pytest

from attncert import report
from attncert.params import read_yaml, validate
from attncert.runs import run_name
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
            "cost_vs_forward": {k: 4.0 * (i + 1) for i, k in enumerate(keys)}}


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
        "fig4_lofast_M_over_pgd_max": 1.21,
        **{f"table3_{k}_over_pgd": {"0.01": 1.05 + i, "0.05": 1.06 + i, "0.2": 1.07 + i}
           for i, k in enumerate(("lofast_M", "lofast_xi", "naive", "specformer"))}})
    for point in GRID:
        name = run_name(*point)
        _write(tmp_path / p["vit_grid"].runs_dir / name / "metrics.json", {
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
                       "median_radius": 0.1, "certified@0.1": 0.25}]})
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


def test_summary_numbers_are_the_metrics_files_numbers(metrics_tree):
    params, root = metrics_tree
    data = report.summary(params, STAGES, root)
    assert data["order"][:4] == ["data", "tightness", "train_vit", "certify_vit"]
    assert report.FIGURES_STAGE not in data["stages"]
    checked = 0
    for name, entry in data["stages"].items():
        for row in entry["rows"]:
            if name == "specformer" and row["key"].startswith("certified/"):
                continue
            path = next(p for p in entry["metrics"] if row.get("run") is None
                        or f"/{row['run']}/" in p)
            assert row["ours"] == _lookup(json.loads((root / path).read_text()), row["key"])
            checked += 1
    assert checked > 40
    rows = {r["key"]: r for r in data["stages"]["tightness"]["rows"]}
    i = PAPER_TABLE3["eps"].index(0.05)
    assert rows["table3_lofast_M_over_pgd/0.05"]["paper"] == pytest.approx(
        PAPER_TABLE3["LoFAST(M)"][i] / PAPER_TABLE3["PGD"][i])
    assert rows["table3_lofast_M_over_pgd/0.2"]["paper"] is None   # not an eps of Table 3
    spec = {r["key"]: r for r in data["stages"]["specformer"]["rows"]}
    assert spec["robustness/cifar10/standard/vanilla/FGSM 2/255"]["paper"] == pytest.approx(
        0.4556)
    assert spec["certified/with MSVP/lofast_M/0.1"]["ours"] == 0.25
    cert = data["stages"]["certify_vit"]
    assert cert["status"] == "partial" and cert["runs"] == [run_name(*g) for g in GRID]
    assert cert["missing"] == [f"results/vit/{run_name(*GRID[1])}/metrics.json"]
    claim = {r["key"]: r for r in cert["rows"]}["certified_acc/lofast_M_pairwise/1.58"]
    assert claim["paper"] == pytest.approx(0.545) and claim["source"].startswith("CertViT")
    assert data["stages"]["train_vit"]["status"] == "ok"
    assert data["stages"]["certvit"] == {"status": "not run", "metrics": [],
                                         "missing": [params["certvit"].metrics], "runs": None,
                                         "rows": []}
    assert json.loads(json.dumps(data)) == data   # plain JSON


def test_summary_paths_come_from_params_and_run_name():
    params = _params()
    runs = [r for r in report.stage_runs(STAGES, params) if r.stage == "certify_vit"]
    assert [r.metrics for r in runs] == [
        (f"{params['certify_vit'].results_dir}/{run_name(*g)}/metrics.json",) for g in GRID]


def test_unknown_stage_is_read_generically_and_required_stages_must_exist(metrics_tree):
    params, root = metrics_tree
    stages = {**STAGES, "extra": {"cmd": "true", "metrics": [{"reports/extra.json": None}]}}
    _write(root / "reports/extra.json", {"radius": {"sst2": 0.9, "yelp": 1.7}, "note": "x",
                                         "per_sample": [1, 2]})
    rows = report.summary(params, stages, root)["stages"]["extra"]["rows"]
    assert {r["key"]: r["ours"] for r in rows} == {"radius/sst2": 0.9, "radius/yelp": 1.7}
    with pytest.raises(report.MissingMetricsError, match="certvit"):
        report.summary(params, STAGES, root, required=["certvit"])
    with pytest.raises(ValueError, match="not declared"):
        report.summary(params, STAGES, root, required=["nope"])


def test_readme_section_is_idempotent_and_only_touches_its_block(metrics_tree, tmp_path):
    params, root = metrics_tree
    summary_path = tmp_path / "summary.json"
    _write(summary_path, report.summary(params, STAGES, root))
    before, after = "# title\n\nintro\n\n## Results\n\n", "\n\n## Next\n\ntext\n"
    readme = tmp_path / "README.md"
    readme.write_text(f"{before}{report.README_START}\nold\n{report.README_END}{after}")
    assert report.update_readme(readme, summary_path)
    first = readme.read_text()
    assert first.startswith(before + report.README_START) and first.endswith(
        report.README_END + after)
    assert "old" not in first and "| run |" in first and "(paper 54.5%)" in first
    assert "**certvit**: not run" in first
    assert not report.update_readme(readme, summary_path)
    assert readme.read_text() == first
    with pytest.raises(ValueError, match="exactly one"):
        report.replace_section("no markers", "x")


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
    page = report.notebook_html(nb)
    assert report.external_refs(page) == []
    assert not re.search(r"<(script|link|img)\b[^>]*(src|href)=\"?(https?:)?//", page, re.I)
    sources = _img_sources(page)
    assert sources and all(s.startswith("data:image/png;base64,") for s in sources)
    assert report.external_refs('<script src="https://cdn.x/require.js"></script>') == [
        "https://cdn.x/require.js"]


def _tiny_reports(root: Path) -> list:
    runs = []
    for stage, title in (("data", "01 · Tiny data"), ("tightness", "02 · Tiny tightness")):
        nb = f"{report.NOTEBOOK_DIR}/{title[:2]}_{stage}.ipynb"
        _executed_notebook(root / nb, title)
        runs.append(report.StageRun(stage, None, {}, nb, ()))
    runs.append(report.StageRun("specformer", None, {}, f"{report.NOTEBOOK_DIR}/05_x.ipynb", ()))
    return runs


def test_index_links_every_report(tmp_path):
    pages = report.html_export(_tiny_reports(tmp_path), "reports/html", None, tmp_path)
    assert [p.name for p in pages] == ["01_data.html", "02_tightness.html", "index.html"]
    index = (tmp_path / "reports/html/index.html").read_text()
    assert 'href="01_data.html"' in index and "01 · Tiny data" in index
    assert "specformer <span class=\"nr\">not run</span>" in index
    assert report.external_refs(index) == []
    # pages newer than their notebooks are kept
    assert report.html_export(_tiny_reports(tmp_path), "reports/html", None, tmp_path)[-1:] == [
        tmp_path / "reports/html/index.html"]


CHROMIUM = shutil.which("chromium")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package "
                    "'chromium'; .ci/run installs it where apt-get is available)")
def test_reports_render_in_headless_chromium(tmp_path):
    report.html_export(_tiny_reports(tmp_path), "reports/html", None, tmp_path)
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
    dom = chromium("--dump-dom", (html_dir / "02_tightness.html").as_uri()).stdout
    assert "02 · Tiny tightness" in dom
    sources = _img_sources(dom)
    assert sources, "the report's figure is in the rendered DOM"
    for src in sources:
        assert src.startswith("data:image/png;base64,")
        width, height = _png_size(src)
        assert width > 0 and height > 0
