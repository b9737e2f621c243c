"""The figures stage: the study's summary and its exports, from every stage's saved metrics.

Nothing is recomputed: the metrics files are the ones dvc.yaml declares, resolved with
params.yaml (:mod:`attncert.pipeline.dvcfile`); each stage's headline rows come from its own reader
(:func:`attncert.report.rows.headline_rows`). A stage whose metrics are missing is "not run".
:func:`run` writes summary.json (a DVC metric), the certified-accuracy table (a DVC plot) and
the HTML export of every executed notebook (:mod:`attncert.report.htmlexport`); README's results
section is rendered from summary.json by :mod:`attncert.report.readme`.

This stage has no headline rows of its own: its metrics file is the summary of the others'.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from attncert.certvit.steps import BASELINE
from attncert.figures import summary as figs
from attncert.pipeline.context import Context
from attncert.pipeline.dvcfile import (
    StageRun,
    collect,
    read_stages,
    stage_items,
    stage_metrics,
    stage_runs,
)
from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.jobs import Job, Model, Note
from attncert.pipeline.params import StudyParams, param, unique
from attncert.report import rows as report
from attncert.report.htmlexport import KEY_FIGURES, html_export

#: this stage: it writes the summary, its own metrics are not summarised
FIGURES_STAGE = "figures"


class MissingMetricsError(FileNotFoundError):
    """A stage listed as required has not written its metrics."""


if TYPE_CHECKING:  # the whole params file, for annotations only
    from attncert.pipeline.params import StudyParams as AllParams

#: this module's params.yaml section
SECTION = "figures"


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data: one job, nothing on a GPU."""
    return [Job(SECTION, "", "figures", Model("none"),
                (Note("tables and figures from saved metrics (CPU)"),))]


@dataclass(frozen=True)
class Params:
    """params.yaml ``figures``: the comparison figures, the study's summary and the HTML
    export."""

    required: list[str] = param(unique, doc="stages whose metrics must exist; any other "
                                            "stage without metrics is reported 'not run'")
    summary: str = param(doc="headline numbers of every stage (JSON, a DVC metric)")
    certified_csv: str = param(doc="certified accuracy vs eps, every grid point (a DVC plot)")
    html_dir: str = param(doc="every executed notebook as HTML, with index.html")


def summary(params: AllParams, stages: Mapping[str, Any], root: str | Path = ".",
            required: Sequence[str] = ()) -> dict[str, Any]:
    """Headline numbers of every stage declared in ``stages`` (dvc.yaml), from its metrics.

    Returns ``{"scale", "order", "stages": {name: {"status", "metrics", "missing", "runs",
    "rows"}}, "headline"}`` (``order``: the stages in dvc.yaml's order; ``headline``:
    :func:`headline_metrics`):
    status "ok" (every metrics file there), "partial" (some grid points missing) or
    "not run"; ``metrics``/``missing`` list the paths read / absent; ``runs`` the grid points
    of a matrix stage (None otherwise); ``rows`` the headline rows, with ``run`` for matrix
    stages. A stage in ``required`` with a missing file raises :class:`MissingMetricsError`.
    """
    unknown = sorted(set(required) - set(stages))
    if unknown:
        raise ValueError(f"required stage {unknown[0]!r} is not declared in dvc.yaml")
    loaded = collect([r for r in stage_runs(stages, params) if r.stage != FIGURES_STAGE], root)
    out: dict[str, Any] = {}
    for r, files in loaded:
        entry = out.setdefault(r.stage, {"status": "ok", "metrics": [], "missing": [],
                                         "runs": [] if r.run else None, "rows": []})
        if r.run:
            entry["runs"].append(r.run)
        for path, m in files.items():
            if m is None:
                entry["missing"].append(path)
                continue
            entry["metrics"].append(path)
            rows = report.headline_rows(r.stage, m, r.item)
            entry["rows"] += [{"run": r.run, **row} if r.run else row for row in rows]
    for name, entry in out.items():
        if entry["missing"]:
            entry["status"] = "partial" if entry["metrics"] else "not run"
            if name in required:
                raise MissingMetricsError(f"{name}: required metrics missing: "
                                          f"{entry['missing'][0]}")
    return {"scale": params["base"].scale, "order": list(out), "stages": out,
            "headline": headline_metrics(out)}


def headline_metrics(stages: Mapping[str, Any]) -> dict[str, Any]:
    """The brief rows' numbers as nested mappings, what ``dvc metrics show`` prints of the
    summary: ``{stage: {key: ours}}``, ``{stage: {run: {key: ours}}}`` for a matrix stage
    (rows without a number of ours are left out)."""
    out: dict[str, Any] = {}
    for name, entry in stages.items():
        for r in entry["rows"]:
            if not r["brief"] or not isinstance(r["ours"], int | float) \
                    or isinstance(r["ours"], bool):
                continue
            into = out.setdefault(name, {})
            if r.get("run"):
                into = into.setdefault(r["run"], {})
            into[r["key"]] = r["ours"]
    return out


def write_summary(path: str | Path, data: Mapping[str, Any]) -> None:
    write_json(path, data)


def stage_note(data: Mapping[str, Any], stage: str) -> str | None:
    """A one-line note when ``stage`` has nothing to show (not declared, or not run)."""
    entry = data["stages"].get(stage)
    if entry is None:
        return f"**{stage}**: stage not declared in dvc.yaml (not run)."
    if entry["status"] == "not run":
        return f"**{stage}**: stage not run (no `{entry['missing'][0]}`)."
    return None


@dataclass(frozen=True)
class Result:
    """What the notebook shows: every stage run of dvc.yaml, its metrics as read, the summary,
    the certified-accuracy curves of the grid (the CSV's rows) and the pages written."""

    runs: list[StageRun]
    loaded: list[tuple[StageRun, dict]]
    summary: dict[str, Any]
    certified: pd.DataFrame
    pages: list[Path]
    html_dir: str = ""
    beside: pd.DataFrame | None = None  # each grid point beside the baseline and the frontier

    def metrics(self, stage: str) -> dict[str, dict]:
        """{run name (or stage name): metrics} of ``stage``'s runs that wrote them."""
        return stage_metrics(self.loaded, stage)

    def items(self, stage: str) -> dict[str, Mapping[str, Any]]:
        """{grid point name: matrix item} of a matrix stage."""
        return stage_items(self.runs, stage)

    def note(self, stage: str) -> str | None:
        """A one-line note when ``stage`` has nothing to show."""
        return stage_note(self.summary, stage)

    def key_figure(self, order: int, name: str) -> Path:
        """Where the notebook saves a figure the index page opens on
        (:data:`attncert.report.htmlexport.KEY_FIGURES`)."""
        return Path(self.html_dir) / KEY_FIGURES / f"{order:02d}_{name}.png"

    def rows(self, stage: str) -> list[dict]:
        """``stage``'s headline rows in the summary."""
        return self.summary["stages"][stage]["rows"]


def run(p: Params, ctx: Context) -> Result:
    """Read every stage's metrics as ``ctx.dvc_file`` declares them (resolved with the study's
    params, ``ctx.study``); write summary.json, the certified-accuracy CSV and the HTML export of
    every executed notebook (this stage's own page is written after its notebook finishes, by
    ``python -m attncert.report html``)."""
    params = ctx.study
    if params is None:
        raise ValueError("the figures stage needs the whole params file (setup(..., study=))")
    stages = read_stages(ctx.dvc_file)
    runs = stage_runs(stages, params)
    loaded = collect(runs)
    result = summary(params, stages, required=p.required)
    write_summary(p.summary, result)
    certified = figs.certified_frame(stage_metrics(loaded, "certify_vit"))
    with atomic_path(p.certified_csv) as tmp:
        figs.certified_csv_frame(certified).to_csv(tmp, index=False)
    for stale in (Path(p.html_dir) / KEY_FIGURES).glob("*.png"):  # the notebook draws anew
        stale.unlink()
    pages = html_export(runs, p.html_dir, result)
    return Result(runs, loaded, result, certified, pages, p.html_dir,
                  beside_baselines(params, loaded))


def beside_baselines(params: AllParams, loaded: Sequence[tuple[StageRun, dict]]
                     ) -> pd.DataFrame:
    """Each grid point's certified accuracy beside the linear baseline's on the same test images
    (the certvit stage's, where it certified that dataset) and the frontier's validation rows
    (:func:`attncert.figures.summary.beside_baselines`), from the saved results."""
    points = stage_metrics(loaded, "certify_vit")
    results = Path(params["certify_vit"].results_dir)
    samples = {run: pd.read_csv(results / run / "samples.csv") for run in points
               if (results / run / "samples.csv").is_file()}
    cv = stage_metrics(loaded, "certvit").get("certvit")
    cv_samples = Path(params["certvit"].results_dir) / "samples.csv"
    baseline = None
    if cv and cv.get("linear_baseline") and cv_samples.is_file():
        rows = pd.read_csv(cv_samples)
        baseline = {"dataset": params["certvit"].dataset, "metrics": cv["linear_baseline"],
                    "samples": rows[rows["mode"] == BASELINE]}
        if baseline["samples"].empty:  # written before the baseline had per-point rows
            baseline = None
    frontier = stage_metrics(loaded, "frontier").get("frontier")
    return figs.beside_baselines(points, samples, baseline, frontier)
