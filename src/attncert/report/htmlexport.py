"""The reports as HTML: every executed notebook as one self-contained page (figures embedded,
no external scripts) and an index with each report's headline numbers
(``python -m attncert.report html``)."""

from __future__ import annotations

import base64
import html
import json
import logging
import re
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from attncert.pipeline.dvcfile import NOTEBOOK_DIR, StageRun
from attncert.report import readme

__all__ = ["KEY_FIGURES", "external_refs", "notebook_html", "describe", "index_html",
           "html_export", "key_figures"]


#: lab's page without the scripts it pulls from CDNs (require.js, MathJax, mermaid, widgets):
#: CSS is inlined by lab itself and output images are data URIs, so a page is one file.
_OFFLINE_TEMPLATE = """{%- extends 'lab/index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
"""
_EXTERNAL = re.compile(
    r"<(script|link|img|iframe|source)\b[^>]*?\b(?:src|href)\s*=\s*[\"']?((?:https?:)?//[^\"'\s>]+)",
    re.IGNORECASE)


def external_refs(page: str) -> list[str]:
    """Every script/link/img/iframe/source tag of ``page`` that points off the page's host
    (http://, https:// or protocol-relative //)."""
    return [m.group(2) for m in _EXTERNAL.finditer(page)]


def _exporter(folder: str):
    from nbconvert import HTMLExporter

    base = Path(folder) / "attncert_offline"
    base.mkdir(exist_ok=True)
    (base / "index.html.j2").write_text(_OFFLINE_TEMPLATE)
    (base / "conf.json").write_text(json.dumps({"base_template": "lab"}))
    exporter = HTMLExporter(template_name="attncert_offline", extra_template_basedirs=[folder],
                            embed_images=True, exclude_anchor_links=True)
    # nbconvert gives every figure without alt text a generic one, and says so once per page
    # (matplotlib's PNGs have none): a known notice, not a problem of the page
    if not any(isinstance(f, _NoAltTextNotice) for f in exporter.log.filters):
        exporter.log.addFilter(_NoAltTextNotice())
    return exporter


class _NoAltTextNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Alternative text is missing")


def notebook_html(path: str | Path, exporter=None) -> str:
    """One executed notebook as a self-contained HTML page (no external script/link/img)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    if exporter is None:
        with tempfile.TemporaryDirectory() as d:
            return notebook_html(path, _exporter(d))
    page, _ = exporter.from_notebook_node(
        nb, resources={"metadata": {"name": describe(nb) or Path(path).stem,
                                    "path": str(Path(path).parent)}})
    refs = external_refs(page)
    if refs:
        raise RuntimeError(f"{path}: the HTML export references {refs[0]}")
    return page


def describe(nb) -> str:
    """The notebook's title: the first line of its first markdown cell, without '#'."""
    for cell in nb.cells:
        if cell.cell_type == "markdown" and cell.source.strip():
            return cell.source.strip().splitlines()[0].lstrip("#").strip()
    return ""


def _html_name(notebook: str) -> str:
    p = Path(notebook)
    try:
        rel = p.relative_to(NOTEBOOK_DIR)
    except ValueError:
        rel = Path(p.name)
    return rel.with_suffix(".html").as_posix()


#: the index page's figures: PNGs the figures notebook saves under ``<html_dir>/KEY_FIGURES``
#: (``<order>_<name>.png``), shown first, in file-name order, embedded
KEY_FIGURES = "key_figures"


def key_figures(out_dir: str | Path) -> list[tuple[str, str]]:
    """(caption, PNG data URI) of every key figure in ``out_dir/KEY_FIGURES``, in name order;
    the caption is the file name after its order prefix, underscores as spaces."""
    folder = Path(out_dir) / KEY_FIGURES
    out = []
    for png in sorted(folder.glob("*.png")) if folder.is_dir() else []:
        caption = png.stem.split("_", 1)[-1].replace("_", " ")
        out.append((caption, "data:image/png;base64,"
                    + base64.b64encode(png.read_bytes()).decode("ascii")))
    return out


def index_html(entries: Sequence[Mapping[str, Any]], title: str = "attncert reports",
               figures: Sequence[tuple[str, str]] = ()) -> str:
    """The index page: the study's key figures (``figures``: (caption, image URI), embedded),
    then one row per report (link or 'not run', description, headline numbers).

    ``entries``: {"stage", "run", "href" (None when not run), "description", "headline"
    (list of "label: value" strings)}."""
    esc = html.escape
    shown = [f'<figure><img alt="{esc(c)}" src="{uri}"><figcaption>{esc(c)}</figcaption>'
             f"</figure>" for c, uri in figures]
    rows = []
    for e in entries:
        name = esc(e["stage"] + (f" @ {e['run']}" if e.get("run") else ""))
        missing = "no executed notebook" if e.get("headline") else "not run"
        link = f'<a href="{esc(e["href"])}">{name}</a>' if e.get("href") else \
            f'{name} <span class="nr">{missing}</span>'
        nums = "<br>".join(esc(h) for h in e.get("headline", []))
        rows.append(f"<tr><td>{link}</td><td>{esc(e.get('description') or '')}</td>"
                    f"<td class=\"num\">{nums}</td></tr>")
    return "\n".join([
        "<!DOCTYPE html>", '<html lang="en">', "<head>", '<meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        "<style>body{font-family:sans-serif;margin:2em;max-width:75em}"
        "table{border-collapse:collapse;width:100%}td,th{border-bottom:1px solid #ccc;"
        "padding:.4em .6em;text-align:left;vertical-align:top}.num{font-size:.9em}"
        ".nr{color:#a00;font-size:.85em}figure{margin:0 0 1.5em}figure img{max-width:100%}"
        "figcaption{font-size:.9em}</style>",
        "</head>", "<body>", f"<h1>{esc(title)}</h1>",
        *(["<h2>Key figures</h2>", "<p>From the figures report (the papers' numbers beside "
           "ours only where the setting matches).</p>", *shown] if shown else []),
        "<h2>Reports</h2>",
        "<p>Each report is an executed notebook of the pipeline, exported with its figures "
        "embedded; numbers are the headline rows of reports/metrics/summary.json.</p>",
        "<table>", "<tr><th>report</th><th>what it is</th><th>headline</th></tr>", *rows,
        "</table>", "</body>", "</html>", ""])


def _headline(data: Mapping[str, Any] | None, stage: str, run: str | None,
              limit: int = 8) -> list[str]:
    entry = (data or {}).get("stages", {}).get(stage)
    if not entry:
        return []
    rows = [r for r in entry["rows"] if r["brief"] and r.get("run") == run]
    return [f"{r['label']}: {readme.cell(r)}" for r in rows[:limit]]


def html_export(runs: Sequence[StageRun], out_dir: str | Path, data: Mapping | None = None,
                root: str | Path = ".", force: bool = False) -> list[Path]:
    """Export every executed notebook of ``runs`` into ``out_dir`` and write index.html.

    A page newer than its notebook is kept unless ``force``. ``data``: the summary (headline
    numbers for the index). Returns the pages written."""
    import nbformat

    root, out_dir = Path(root), Path(root) / out_dir
    written, entries = [], []
    with tempfile.TemporaryDirectory() as d:
        exporter = None
        for r in runs:
            if r.notebook is None:
                continue
            nb_path = root / r.notebook
            entry = {"stage": r.stage, "run": r.run, "href": None, "description": "",
                     "headline": _headline(data, r.stage, r.run)}
            entries.append(entry)
            if not nb_path.is_file():
                continue
            page = out_dir / _html_name(r.notebook)
            entry["href"] = _html_name(r.notebook)
            entry["description"] = describe(nbformat.read(nb_path, as_version=4))
            if force or not page.is_file() or page.stat().st_mtime < nb_path.stat().st_mtime:
                exporter = exporter or _exporter(d)
                page.parent.mkdir(parents=True, exist_ok=True)
                page.write_text(notebook_html(nb_path, exporter))
                written.append(page)
    index = out_dir / "index.html"
    index.parent.mkdir(parents=True, exist_ok=True)
    index.write_text(index_html(entries, figures=key_figures(out_dir)))
    return [*written, index]
