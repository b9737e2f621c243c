"""The HTML export: every executed notebook as one self-contained page and the index, rendered
in headless Chromium where it is installed."""

import base64
import io
import re
import shutil
import struct
import subprocess
from pathlib import Path

import nbformat
import pytest

from attncert.pipeline import dvcfile
from attncert.report import htmlexport
from attncert.report import rows as report

ROOT = Path(__file__).resolve().parents[1]


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
