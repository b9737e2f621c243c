"""README's results section: summary.json's brief rows as Markdown tables, written between
the results markers (``python -m attncert.report readme``)."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

README_FILE = "README.md"
README_START = "<!-- results:start -->"
README_END = "<!-- results:end -->"

__all__ = ["README_FILE", "README_START", "README_END", "fmt", "cell", "render_results",
           "replace_section", "update_readme"]


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


def cell(row: Mapping) -> str:
    """A row's number, with the paper's beside when it gives one."""
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
            cells = {(r["run"], r["label"]): cell(r) for r in rows}
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
