"""Every stage's headline rows (the report's commands are :mod:`attncert.report.__main__`).

Headline rows (:func:`headline_rows`) come from each stage module's ``headline_rows``
(:mod:`attncert.stages`, rows as :mod:`attncert.report.headline` describes them); a stage without a
reader is read generically. Where the metrics files are comes from dvc.yaml resolved with
params.yaml (:mod:`attncert.pipeline.dvcfile`); the summary is the figures stage's
(:mod:`attncert.stages.figures`), README's section :mod:`attncert.report.readme`'s, the HTML export
:mod:`attncert.report.htmlexport`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from attncert.pipeline.dvcfile import DVC_FILE, StageRun, read_stages, resolve, stage_runs
from attncert.pipeline.params import PARAMS_FILE
from attncert.report.headline import row
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

__all__ = ["NUMBER_READERS", "READERS", "headline_numbers", "headline_rows",
           # dvc.yaml, resolved (attncert.pipeline.dvcfile), for the report's callers
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


#: stage name -> its DVC headline (:data:`attncert.report.headline.NUMBERS`): the stage module's
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
