"""README's and docs/results.md's results sections: regenerated in place from the summary, the
numbers the metrics files' numbers, shown at a precision that shows them."""

import json
import re

import pytest
from reportdata import (
    STAGES,
    _file_value,
    _metrics_of,
    _write,
)

from attncert.report import readme as results_md
from attncert.stages import figures as figures_stage


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


def test_fmt_shows_a_failed_value_as_a_dash():
    from attncert.report.readme import fmt

    assert fmt(float("nan"), "percent") == fmt(None, "fraction") == "–"
    assert fmt(80.0, "percent") == "80.0%"
    # numbers at a precision that shows them: a ratio just above 1, long times, flags
    assert fmt(1.00015, "ratio") == "1.00015" and fmt(1.00015, "value") == "1.00015"
    assert fmt(1104.6, "seconds") == "1,105 s" and fmt(3.14159, "seconds") == "3.14 s"
    assert (fmt(1, "flag"), fmt(False, "flag")) == ("yes", "no")
