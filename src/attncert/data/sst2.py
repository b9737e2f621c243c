"""SST-2: read its TSVs by header (the mirror's or GLUE's), fetch (mirror, then GLUE's zip, then
GLUE's ``sst2`` through Hugging Face ``datasets``) and process into sentences and labels with
seeded subsets."""

from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any

import torch

from attncert.data.common import (
    TEXT_FOLDER,
    first_line,
    mark_source,
    marked_source,
    subset_indices,
    unavailable_error,
)

SST2_GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data/SST-2.zip"


def read_sst2_tsv(path: Path) -> dict[str, list] | None:
    """Read one SST-2 TSV by its header (mirror: label/sentence|content; GLUE: sentence/label).

    Returns None for a split without labels (GLUE's public test split).
    """
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        fields = reader.fieldnames or []
        text_col = next((c for c in ("sentence", "content") if c in fields), None)
        if text_col is None:
            raise ValueError(f"{path}: no 'sentence' or 'content' column in header {fields}")
        if "label" not in fields:
            return None
        text, label = [], []
        for row in reader:
            text.append(row[text_col])
            label.append(int(row["label"]))
    return {"text": text, "label": label}


def _sst2_splits(folder: Path) -> dict[str, Path]:
    paths = {s: folder / f"{s}.tsv" for s in ("train", "dev", "test")}
    return {s: p for s, p in paths.items() if p.is_file()}


def fetch_sst2(raw_dir: Path, mirror: Path | None, download: bool) -> str:
    local = raw_dir / TEXT_FOLDER["sst2"] / "raw"
    cached = marked_source(local)
    if cached and {"train", "dev"} <= set(_sst2_splits(local)):
        return cached
    mirror_dir = mirror / TEXT_FOLDER["sst2"] if mirror else None
    if mirror_dir and {"train", "dev"} <= set(_sst2_splits(mirror_dir)):
        local.mkdir(parents=True, exist_ok=True)
        for path in _sst2_splits(mirror_dir).values():
            shutil.copyfile(path, local / path.name)
        return mark_source(local, f"mirror {mirror_dir}")
    errors = []
    if download:
        from attncert.data.hub_text import DownloadFailed, _with_retries, no_route

        # each route retried on a transient error; the next route when it fails
        for what, route in (("GLUE archive", lambda: _from_glue_zip(local)),
                            ("Hugging Face datasets", lambda: _from_hub(raw_dir, local))):
            try:
                return _with_retries(route, f"sst2 ({what})")
            except DownloadFailed as exc:
                errors.append(f"{what}: {first_line(exc)}")
            except Exception as exc:
                if not no_route(exc) and not isinstance(exc, ImportError):
                    raise
                errors.append(f"{what}: {first_line(exc)}")
    raise unavailable_error("sst2", mirror_dir, "; ".join(errors) or None)


#: GLUE's SST-2 on the Hugging Face hub (the second download route)
SST2_HUB = ("nyu-mll/glue", "sst2")


def _from_glue_zip(local: Path) -> str:
    from torchvision.datasets.utils import download_and_extract_archive

    download_and_extract_archive(SST2_GLUE_URL, download_root=str(local))
    for path in _sst2_splits(local / "SST-2").values():
        shutil.move(str(path), local / path.name)
    return mark_source(local, f"download ({SST2_GLUE_URL})")


def _from_hub(raw_dir: Path, local: Path) -> str:
    """GLUE's labelled SST-2 splits (train, validation) through ``datasets``, written as the
    archive's train.tsv and dev.tsv (header ``sentence\tlabel``)."""
    from datasets import load_dataset

    cache = raw_dir / TEXT_FOLDER["sst2"] / "hub-cache"
    hub = load_dataset(*SST2_HUB, cache_dir=str(cache))
    local.mkdir(parents=True, exist_ok=True)
    for split, hub_split in (("train", "train"), ("dev", "validation")):
        with open(local / f"{split}.tsv", "w", encoding="utf-8") as f:
            f.write("sentence\tlabel\n")
            for row in hub[hub_split]:
                text = " ".join(row["sentence"].replace("\t", " ").splitlines())
                f.write(f"{text}\t{int(row['label'])}\n")
    shutil.rmtree(cache, ignore_errors=True)  # the files above are the raw copy
    return mark_source(local, f"download (Hugging Face datasets: {' '.join(SST2_HUB)})")


def process_sst2(raw_dir: Path, max_train: int, max_test: int, seed: int,
                 source: str) -> dict[str, Any]:
    local = raw_dir / TEXT_FOLDER["sst2"] / "raw"
    out: dict[str, Any] = {"name": "sst2", "kind": "text", "source": source,
                           "classes": ["negative", "positive"], "unlabelled_splits": []}
    for split, path in _sst2_splits(local).items():
        rows = read_sst2_tsv(path)
        if rows is None:
            out["unlabelled_splits"].append(split)
            continue
        idx = subset_indices(len(rows["label"]), max_train if split == "train" else max_test, seed)
        out[split] = {"text": [rows["text"][i] for i in idx],
                      "y": torch.tensor(rows["label"], dtype=torch.int64)[idx]}
    return out
