"""The results sections: summary.json's brief rows as Markdown tables, written between the
results markers of docs/results.md (every brief row) and of README.md (the first rows of
each stage's table, :data:`README_ROWS`) by ``python -m attncert.report readme``."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

README_FILE = "README.md"
RESULTS_FILE = "docs/results.md"
#: rows of each stage's table in README.md (docs/results.md has them all)
README_ROWS = 3
README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"

__all__ = ["README_FILE", "RESULTS_FILE", "README_ROWS", "README_START", "README_END", "fmt",
           "cell", "render_results", "replace_section", "update_readme"]


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
        return f"{value:,.0f} s" if abs(value) >= 100 else f"{value:.3g} s"
    if unit == "count":
        return f"{value:,}" if isinstance(value, int) else f"{value:g}"
    if unit == "flag":
        return "yes" if value else "no"
    return f"{value:.6g}"  # a ratio of 1.00015 shows as such, not as 1


def cell(row: Mapping) -> str:
    """A row's number, with the paper's beside when it gives one."""
    ours = fmt(row["ours"], row["unit"])
    return ours if row["paper"] is None else f"{ours} (paper {fmt(row['paper'], row['unit'])})"


def _table(header: Sequence[str], body: Sequence[Sequence[str]]) -> list[str]:
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header), *map(line, body)]


def render_results(data: Mapping[str, Any], limit: int | None = None) -> str:
    """Markdown of summary.json's brief rows: a table per stage, the paper's numbers beside;
    ``limit``: at most that many rows per table, the count of the others named."""
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
            cells = {(r["run"], r["label"]): cell(r) for r in rows}
            runs = [p for p in entry["runs"] if any(k[0] == p for k in cells)]
            header = ["run", *labels]
            body = [[p, *(cells.get((p, lab), "–") for lab in labels)] for p in runs]
        else:
            header = ["quantity", "ours", "paper", "paper source"]
            body = [[r["label"], fmt(r["ours"], r["unit"]), fmt(r["paper"], r["unit"]),
                     r["source"] or ""] for r in rows]
        lines += _table(header, body[:limit])
        if limit is not None and len(body) > limit:
            lines += ["", f"({len(body) - limit} more rows in [docs/results.md]"
                          "(docs/results.md#results))"]
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


def update_readme(readme: str | Path, summary_path: str | Path,
                  results: str | Path | None = RESULTS_FILE) -> bool:
    """Rewrite the results sections from summary.json: README's (the first
    :data:`README_ROWS` rows of each table) and ``results``' (every brief row; None: none).
    True when a file changed."""
    data = json.loads(Path(summary_path).read_text())
    changed = False
    for path, limit in ((readme, README_ROWS), (results, None)):
        if path is None:
            continue
        path = Path(path)
        text = path.read_text()
        new = replace_section(text, render_results(data, limit))
        if new != text:
            path.write_text(new)
            changed = True
    return changed
