"""The bars of ours beside a paper stay drawable whatever the length of a row's label or of
its paper source (they used to squeeze the axes to nothing: a stderr block in the report)."""

import io
import warnings

import matplotlib

matplotlib.use("Agg")

from attncert.figures.headline import headline_frame, plot_headline  # noqa: E402

LONG = ("average radius of the prediction (global; every sentence, right or wrong: OLSA sec. "
        "5.1's rule)")
SOURCE = ("OLSA section 5 (3-layer OLSA, SST; softmax constant 0.25: unsound, ours 1/2; Shi et "
          "al.: 0.11); ours at the cpu scale: a smaller model and budget, not like for like")


def _row(run, label, ours, paper, source, unit="value"):
    return {"run": run, "label": label, "ours": ours, "paper": paper, "source": source,
            "unit": unit, "brief": True}


def test_long_labels_and_sources_keep_the_axes():
    rows = [_row(f"olsa-L3-g2{'-averaged' * i}", LONG, 1.2, 0.979, SOURCE) for i in range(2)]
    rows.append(_row("", "certified accuracy", 0.5, None, None, "fraction"))
    assert len(headline_frame(rows)) == 3
    fig = plot_headline(rows, "OLSA's SST radius beside ours")
    assert fig is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "constrained_layout not applied ..." is a UserWarning
        fig.savefig(io.BytesIO(), format="png", dpi=80, bbox_inches="tight")
    ax = fig.axes[0]
    assert ax.get_position().width > 0.3 and ax.get_position().height > 0.3
    assert all(len(line) <= 80 for t in ax.get_legend().get_texts()
               for line in t.get_text().splitlines())
    assert plot_headline(rows[2:], "nothing to draw") is None
