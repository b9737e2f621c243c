"""The data stage: every dataset of the study, fetched, subset and saved for the others.

Local mirror first, then the real download (:mod:`attncert.data`); images are saved as uint8
tensors with per-channel mean/std (models normalise inside, so eps stays in pixel space), text
as raw sentences and labels. A 20-image sample or an optional dataset without a route is
skipped and recorded, never fatal.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attncert import data
from attncert.pipeline.context import Context
from attncert.pipeline.io import write_json
from attncert.pipeline.jobs import Job, Model, Note
from attncert.pipeline.params import (
    DATASETS,
    SAMPLE_SETS,
    StudyParams,
    nonneg,
    one_of,
    param,
    positive,
    unique,
)
from attncert.report.headline import row

#: this module's params.yaml section
SECTION = "data"


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data: one job, nothing on a GPU."""
    return [Job(SECTION, "", "data", Model("none"),
                (Note("downloads and conversion on the CPU"),))]


@dataclass(frozen=True)
class Params:
    """params.yaml ``data``."""

    mirror: str = param(doc="local mirror root in torchvision's <root>/<Dataset>/raw layout")
    raw_dir: str = param()
    processed_dir: str = param()
    datasets: list[str] = param(one_of(*DATASETS), unique)
    optional: list[str] = param(one_of(*DATASETS), unique,
                                doc="datasets skipped and recorded (never fatal) without a route")
    samples: list[str] = param(one_of(*SAMPLE_SETS), unique)
    download: bool = param()
    max_train: int = param(nonneg, doc="0 keeps the full split")
    max_test: int = param(nonneg, doc="0 keeps the full split")
    subset_seed: int = param(nonneg)
    imagenet_val_images: int = param(nonneg, doc="seeded subset of the user's ImageNet "
                                                 "validation images kept (0 = all 50000)")
    grid_per_class: int = param(positive)
    metrics: str = param()


def run(p: Params, ctx: Context) -> list[dict[str, Any]]:
    """Prepare every dataset; write the metrics file (one row per dataset); return the rows.
    Reads no other section (``ctx`` is empty)."""
    summary = data.prepare(p.datasets, p.samples, p.mirror, p.raw_dir, p.processed_dir,
                           p.download, p.max_train, p.max_test, p.subset_seed,
                           optional=p.optional, imagenet_val_images=p.imagenet_val_images)
    write_json(p.metrics, {r["dataset"]: r for r in summary})
    return summary


def prepared(p: Params, summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The processed datasets of ``summary`` that were not skipped, loaded for display."""
    return [data.load_processed(r["dataset"], p.processed_dir) for r in summary
            if "skipped" not in r]


def skipped(summary: list[dict[str, Any]]) -> dict[str, str]:
    """``{dataset: reason}`` of every skipped sample and optional dataset."""
    return {r["dataset"]: r["skipped"] for r in summary if "skipped" in r}


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """The train/test sizes of every prepared dataset."""
    rows = []
    for name, info in m.items():
        if not isinstance(info, Mapping):
            continue
        for split in ("n_train", "n_test"):
            if split in info:
                rows.append(row(f"{name}/{split}", f"{name} {split[2:]} examples", info[split],
                                "count"))
    return rows
