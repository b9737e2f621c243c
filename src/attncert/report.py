"""The study report: every stage's headline rows, and the report's commands.

    python -m attncert.report summary   # reports/metrics/summary.json from every stage's metrics
    python -m attncert.report readme    # README.md's results section, from summary.json
    python -m attncert.report html      # reports/html/: each executed notebook and index.html

Headline rows (:func:`headline_rows`) come from each stage module's ``headline_rows``
(:mod:`attncert.stages`, rows as :mod:`attncert.headline` describes them); a stage without a
reader is read generically. Where the metrics files are comes from dvc.yaml resolved with
params.yaml (:mod:`attncert.dvcfile`); the summary is the figures stage's
(:mod:`attncert.stages.figures`), README's section :mod:`attncert.readme`'s, the HTML export
:mod:`attncert.htmlexport`'s.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from attncert.dvcfile import DVC_FILE, StageRun, read_stages, resolve, stage_runs
from attncert.headline import row
from attncert.htmlexport import html_export
from attncert.params import PARAMS_FILE, load_params
from attncert.readme import README_FILE, update_readme
from attncert.stages import certify_vit as certify_vit_stage
from attncert.stages import certvit as certvit_stage
from attncert.stages import crown as crown_stage
from attncert.stages import data as data_stage
from attncert.stages import frontier as frontier_stage
from attncert.stages import specformer as specformer_stage
from attncert.stages import text as text_stage
from attncert.stages import tightness as tightness_stage
from attncert.stages import train_vit as train_vit_stage

#: generic reader: at most this many numeric leaves of an unknown metrics file
GENERIC_MAX_ROWS = 200
GENERIC_BRIEF_ROWS = 8

__all__ = ["NUMBER_READERS", "READERS", "headline_numbers", "headline_rows", "main",
           # dvc.yaml, resolved (attncert.dvcfile), for the report's callers
           "DVC_FILE", "PARAMS_FILE", "StageRun", "read_stages", "resolve", "stage_runs"]


# ------------------------------------------------------------------ headline rows
def _generic_rows(m: Any, item: Mapping, prefix: str = "", depth: int = 0) -> list[dict]:
    """Every numeric leaf of a metrics file (dicts up to 3 levels; lists are skipped)."""
    rows: list[dict] = []
    if isinstance(m, Mapping) and depth < 3:
        for k, v in m.items():
            rows += _generic_rows(v, item, f"{prefix}{k}/" if prefix or k else "", depth + 1)
    elif isinstance(m, int | float) and not isinstance(m, bool):
        key = prefix.rstrip("/")
        rows.append(row(key, key.replace("/", " "), m, "value"))
    if depth == 0:
        rows = rows[:GENERIC_MAX_ROWS]
        for r in rows[:GENERIC_BRIEF_ROWS]:
            r["brief"] = True
    return rows


#: stage name -> reader of its (first) metrics file: the stage module's ``headline_rows``
#: (:mod:`attncert.stages`); other stages get :func:`_generic_rows`
READERS: dict[str, Callable[[Mapping, Mapping], list[dict]]] = {
    "data": data_stage.headline_rows,
    "tightness": tightness_stage.headline_rows,
    "train_vit": train_vit_stage.headline_rows,
    "certify_vit": certify_vit_stage.headline_rows,
    "frontier": frontier_stage.headline_rows,
    "specformer": specformer_stage.headline_rows,
    "certvit": certvit_stage.headline_rows,
    "text": text_stage.headline_rows,
    "crown": crown_stage.headline_rows,
}


def headline_rows(stage: str, metrics: Mapping, item: Mapping | None = None) -> list[dict]:
    """The headline rows of one metrics file of ``stage`` (``item``: the grid point)."""
    return READERS.get(stage, _generic_rows)(metrics, item or {})


#: stage name -> its DVC headline (:data:`attncert.headline.NUMBERS`): the stage module's
#: ``headline_numbers``
NUMBER_READERS: dict[str, Callable[[Mapping, Mapping], dict[str, float]]] = {
    name: module.headline_numbers for name, module in (
        ("tightness", tightness_stage), ("train_vit", train_vit_stage),
        ("certify_vit", certify_vit_stage), ("frontier", frontier_stage),
        ("specformer", specformer_stage),
        ("certvit", certvit_stage), ("text", text_stage), ("crown", crown_stage))}


def headline_numbers(stage: str, metrics: Mapping, item: Mapping | None = None
                     ) -> dict[str, float]:
    """The few numbers of ``stage``'s metrics that ``dvc metrics show`` prints ({} for a
    stage without any: data, the unit stages, figures)."""
    reader = NUMBER_READERS.get(stage)
    return {} if reader is None else reader(metrics, item or {})


# ------------------------------------------------------------------ CLI
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.report",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("command", choices=("summary", "readme", "html"))
    ap.add_argument("--params", default=PARAMS_FILE)
    ap.add_argument("--dvc", default=DVC_FILE)
    ap.add_argument("--readme", default=README_FILE)
    ap.add_argument("--force", action="store_true", help="html: export every page again")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    fig = params["figures"]
    if args.command == "readme":
        changed = update_readme(args.readme, fig.summary)
        print(f"{args.readme}: results section {'updated' if changed else 'unchanged'}")
        return 0
    stages = read_stages(args.dvc)
    if args.command == "summary":
        # the figures stage builds the summary from this module's rows
        from attncert.stages import figures as figures_stage

        figures_stage.write_summary(fig.summary, figures_stage.summary(
            params, stages, required=fig.required))
        print(f"wrote {fig.summary}")
        return 0
    data = json.loads(Path(fig.summary).read_text()) if Path(fig.summary).is_file() else None
    pages = html_export(stage_runs(stages, params), fig.html_dir, data, force=args.force)
    print(f"{fig.html_dir}: {len(pages)} page(s) written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
