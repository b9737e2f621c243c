"""The data stage: fetch every requested dataset, process and save it, record skipped optional
datasets and samples, and one summary row each."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from attncert.data.common import (
    DataUnavailable,
    resolve_mirror,
)
from attncert.data.hub_text import HUB_TEXT_DATASETS, fetch_hub_text, process_hub_text
from attncert.data.images import IMAGE_DATASETS, fetch_image, process_image
from attncert.data.samples import SAMPLE_FOLDERS, load_imagenet_val, load_sample
from attncert.data.sst2 import fetch_sst2, process_sst2
from attncert.pipeline.io import torch_save


def prepare(datasets: list[str], samples: list[str], mirror: str, raw_dir: str,
            processed_dir: str, download: bool, max_train: int, max_test: int,
            subset_seed: int, optional: Sequence[str] = (), imagenet_val_images: int = 0,
            progress: bool = True) -> list[dict[str, Any]]:
    """Fetch, process and save every requested dataset; return one summary row each.

    Every dataset is fetched before anything is written, so a missing dataset fails the
    stage in seconds, naming both routes. A sample without a route is skipped: its file holds
    the reason (see :func:`skipped_sample`) and its row has a ``skipped`` entry. A dataset in
    ``optional`` is skipped the same way (:func:`skipped_dataset`) when no route provides it
    or when it is not in ``datasets``. ``imagenet_val_images``: the seeded subset of the
    user's ImageNet validation images kept (0 = all; :func:`load_imagenet_val`).
    """
    from attncert.pipeline.progress import bar

    mirror_path = resolve_mirror(mirror)
    raw, processed = Path(raw_dir), Path(processed_dir)
    sources = {}
    # an optional dataset (data.optional) is skipped, never fatal, with the reason recorded in
    # its processed file, like a sample; every optional dataset gets a file (the data or the
    # record), so a stage that depends on one always finds it
    skipped = {name: "not listed in data.datasets" for name in optional if name not in datasets}
    for name in bar(datasets, desc="fetch", enabled=progress):
        try:
            sources[name] = fetch(name, raw, mirror_path, download)
        except DataUnavailable as exc:
            if name not in optional:
                raise
            skipped[name] = str(exc)
    # a sample is a small extra evaluation set: without a route it is skipped, never fatal. Every
    # known sample gets a file (the images, or a record of why it was skipped), so a stage
    # that depends on one always finds it and can say in its report that it was skipped.
    loaded = []
    for name in SAMPLE_FOLDERS:
        if name not in samples:
            loaded.append(skipped_sample(name, "not listed in data.samples"))
            continue
        try:
            loaded.append(load_imagenet_val(mirror_path, raw, imagenet_val_images, subset_seed,
                                            progress) if name == "imagenet_val"
                          else load_sample(name, mirror_path, raw))
        except DataUnavailable as exc:
            loaded.append(skipped_sample(name, str(exc)))

    rows = []
    for name in bar(list(sources), desc="process", enabled=progress):
        if name in IMAGE_DATASETS:
            obj = process_image(name, raw, max_train, max_test, subset_seed, sources[name],
                                progress)
        elif name in HUB_TEXT_DATASETS:
            obj = process_hub_text(name, raw, max_train, max_test, subset_seed, sources[name])
        else:
            obj = process_sst2(raw, max_train, max_test, subset_seed, sources[name])
        torch_save(obj, processed / f"{name}.pt")
        rows.append(summary_row(obj))
    for name, reason in skipped.items():
        obj = skipped_dataset(name, reason)
        torch_save(obj, processed / f"{name}.pt")
        rows.append(summary_row(obj))
    for obj in loaded:
        torch_save(obj, processed / f"{obj['name']}.pt")
        rows.append(summary_row(obj))
    return rows


def skipped_sample(name: str, reason: str) -> dict[str, Any]:
    """The processed file of a sample that could not be provided: the reason, no images."""
    return {"name": name, "kind": "image", "source": f"skipped: {reason}", "skipped": reason}


def skipped_dataset(name: str, reason: str) -> dict[str, Any]:
    """The processed file of an optional dataset that was not provided: the reason, no data."""
    kind = "image" if name in IMAGE_DATASETS else "text"
    return {"name": name, "kind": kind, "source": f"skipped: {reason}", "skipped": reason}


def fetch(name: str, raw_dir: Path, mirror: Path | None, download: bool) -> str:
    """Fetch any dataset of ``data.datasets``; return the source used."""
    if name in IMAGE_DATASETS:
        return fetch_image(name, raw_dir, mirror, download)
    if name in HUB_TEXT_DATASETS:
        return fetch_hub_text(name, raw_dir, mirror, download)
    return fetch_sst2(raw_dir, mirror, download)


def summary_row(obj: dict[str, Any]) -> dict[str, Any]:
    row = {"dataset": obj["name"], "kind": obj["kind"], "source": obj["source"]}
    if "skipped" in obj:
        return {**row, "skipped": obj["skipped"]}
    for split in ("train", "dev", "test"):
        if split in obj:
            row[f"n_{split}"] = len(obj[split]["y"])
    if obj["kind"] == "image":
        row["shape"] = "x".join(map(str, obj["shape"]))
        row["mean"] = [round(m, 4) for m in obj["mean"]]
        row["std"] = [round(s, 4) for s in obj["std"]]
    return row
