"""The index page's key figures of the grid, read at the index's size: variants that certify the
same share one labelled mark, a figure is no wider than the index's column, and a browser shows
it at its own size (rendered in headless Chromium, not only found on the page)."""

import re
import struct
import subprocess
from pathlib import Path

import matplotlib
import pandas as pd
import pytest
from test_htmlexport import CHROMIUM, FLAGS

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from attncert.figures import EXPORT_DPI, save_png  # noqa: E402
from attncert.figures import grid as figs  # noqa: E402
from attncert.figures.summary import certified_frame  # noqa: E402
from attncert.report import htmlexport  # noqa: E402

VARIANTS = ("global", "lofast_M", "lofast_xi", "naive", "specformer")
EPS = ("0.02", "0.05", "0.1", "0.25", "0.5", "1.0", "1.58")


def _point(k: int) -> dict:
    """A grid point's certify metrics: LoFAST's two forms certify what the global bound does,
    the naive bound less, SpecFormer's nothing."""
    base = [0.9 - 0.12 * i - 0.01 * k for i in range(len(EPS))]
    acc = {"global": base, "lofast_M": base, "lofast_xi": base,
           "naive": [a / 2 for a in base], "specformer": [0.0] * len(EPS)}
    certified = {f"{v}_{t}": {e: max(0.0, a) for e, a in zip(EPS, acc[v], strict=True)}
                 for v in VARIANTS for t in ("pairwise", "logit")}
    return {"dataset": ("mnist", "cifar10")[k % 2], "clean_acc": 0.92 - 0.01 * k,
            "certified_acc": certified, "pgd_acc": {e: 0.95 - 0.1 * i for i, e in
                                                   enumerate(EPS)}}


@pytest.fixture(scope="module")
def points():
    return {f"p{k}-L3-H4": _point(k) for k in range(8)}


def test_coinciding_variants_share_one_labelled_mark():
    df = pd.DataFrame({"run": ["a"] * 6, "variant": ["x", "x", "y", "y", "z", "z"],
                       "eps": [0.1, 0.2] * 3, "accuracy": [1, 0, 1, 0, 1, 1]})
    merged = figs.merge_coinciding(df, ("run",), "eps", "accuracy")
    assert sorted(set(merged["variant"])) == ["x = y", "z"] and len(merged) == 4
    assert figs.spread([0.5, 0.1, 0.2, 0.3, 0.1]) == [0.1, 0.3, 0.5]
    assert figs.spread([0.1, 0.2]) == [0.1, 0.2]


def _save(fig, path: Path) -> tuple[int, int]:
    save_png(fig, path)
    plt.close(fig)
    return struct.unpack(">II", path.read_bytes()[16:24])


def _key_figures(points, folder: Path) -> dict[str, tuple[int, int]]:
    long = certified_frame(points)
    grid = figs.plot_certified_grid(long)
    labels = {t.get_text() for t in grid.legends[0].get_texts()} if grid.legends else set()
    assert "global = lofast_M = lofast_xi" in labels and "specformer" in labels
    trade = figs.plot_tradeoff(figs.tradeoff_frame(points))
    assert len(trade.axes) == 3  # a few eps spread over the grid's, not one panel each
    return {name: _save(fig, folder / f"{i:02d}_{name}.png")
            for i, (name, fig) in enumerate((("certified_accuracy_vs_eps", grid),
                                             ("certified_vs_clean_accuracy", trade)), 2)}


def test_key_figures_fit_the_index_column(points, tmp_path):
    """Eight grid points, seven eps: each figure at most the index's column wide (about
    1100 pixels at the export's dpi), so that the page need not shrink its text."""
    sizes = _key_figures(points, tmp_path)
    limit = figs.MAX_WIDTH_INCHES * EXPORT_DPI + 40  # the legend's bounding box may overhang
    for name, (width, height) in sizes.items():
        assert 400 < width <= limit and height > 200, (name, width, height)


#: after the load event, the body records the smallest shown / natural width of its images
_SCALE = ('<script>addEventListener("load", () => {const s = [...document.images].map('
          'x => x.clientWidth / x.naturalWidth); document.body.dataset.scale = '
          'Math.min(...s).toFixed(3) + "/" + s.length;});</script>')


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian package "
                    "'chromium'; .ci/run installs it where apt-get is available)")
def test_the_index_shows_its_key_figures_at_their_size(points, tmp_path):
    html_dir = tmp_path / "html"
    _key_figures(points, html_dir / htmlexport.KEY_FIGURES)
    page = htmlexport.index_html([], figures=htmlexport.key_figures(html_dir))
    index = html_dir / "index.html"
    index.write_text(page.replace("</body>", _SCALE + "</body>"))
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'profile'}",
                          "--window-size=1280,900", "--virtual-time-budget=10000",
                          "--dump-dom", index.as_uri()],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    found = re.search(r'data-scale="([\d.]+)/(\d+)"', dom)
    assert found and int(found.group(2)) == 2, "the index did not finish loading its figures"
    assert float(found.group(1)) >= 0.95, f"a key figure is shown at {found.group(1)} of its size"
