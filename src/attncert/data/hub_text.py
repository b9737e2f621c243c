"""Yelp polarity and QQP: their original file layouts (read and written), fetched from the
mirror or through Hugging Face ``datasets``, processed like SST-2."""

from __future__ import annotations

import csv
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class HubTextDataset:
    """A text dataset in its original file layout, or downloaded from the Hugging Face hub."""

    name: str
    files: dict[str, str]  # split -> file name in <mirror>/<folder>/
    hub_id: str
    hub_config: str | None
    hub_splits: dict[str, str]  # our split -> the hub's split: the labelled splits, required
    classes: tuple[str, ...]

    @property
    def folder(self) -> str:
        return TEXT_FOLDER[self.name]


HUB_TEXT_DATASETS: dict[str, HubTextDataset] = {
    d.name: d
    for d in (
        # Zhang et al. 2015's CSV release: no header, "class","text" with class 1 (negative) or
        # 2 (positive), quotes doubled, newlines written as the two characters \n
        HubTextDataset("yelp_polarity", {"train": "train.csv", "test": "test.csv"},
                       "fancyzhx/yelp_polarity", None, {"train": "train", "test": "test"},
                       ("negative", "positive")),
        # GLUE's QQP TSVs (header id, qid1, qid2, question1, question2, is_duplicate); its test
        # split has no labels: a mirror's copy is listed as unlabelled, the download skips it
        HubTextDataset("qqp", {"train": "train.tsv", "dev": "dev.tsv", "test": "test.tsv"},
                       "nyu-mll/glue", "qqp", {"train": "train", "dev": "validation"},
                       ("not_duplicate", "duplicate")),
    )
}
QQP_COLUMNS = ("question1", "question2", "is_duplicate")


def read_yelp_csv(path: Path) -> dict[str, list]:
    """Read one Yelp polarity CSV of the original release: labels 1/2 become 0/1."""
    text, label = [], []
    with open(path, newline="", encoding="utf-8") as f:
        for line, row in enumerate(csv.reader(f), start=1):
            if len(row) != 2 or row[0] not in ("1", "2"):
                raise ValueError(f"{path}:{line}: expected \"1\" or \"2\" then the review, "
                                 f"got {row[:2]!r}")
            label.append(int(row[0]) - 1)
            text.append(row[1].replace("\\n", "\n"))
    return {"text": text, "label": label}


def read_qqp_tsv(path: Path) -> dict[str, list] | None:
    """Read one GLUE QQP TSV by its header; None for a split without labels (GLUE's test)."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        fields = reader.fieldnames or []
        missing = [c for c in QQP_COLUMNS[:2] if c not in fields]
        if missing:
            raise ValueError(f"{path}: no {missing} column(s) in header {fields}")
        if "is_duplicate" not in fields:
            return None
        text, pair, label = [], [], []
        for line, row in enumerate(reader, start=2):
            if row["is_duplicate"] not in ("0", "1"):
                raise ValueError(f"{path}:{line}: is_duplicate must be 0 or 1, "
                                 f"got {row['is_duplicate']!r}")
            text.append(row["question1"])
            pair.append(row["question2"])
            label.append(int(row["is_duplicate"]))
    return {"text": text, "text_pair": pair, "label": label}


def _hub_text_files(spec: HubTextDataset, folder: Path) -> dict[str, Path]:
    paths = {s: folder / f for s, f in spec.files.items()}
    return {s: p for s, p in paths.items() if p.is_file()}


def _one_line(text: str) -> str:
    """A field for a QUOTE_NONE TSV: tabs and line breaks become spaces."""
    return " ".join(text.replace("\t", " ").splitlines())


def _write_hub_text(spec: HubTextDataset, hub: Any, folder: Path) -> None:
    """Write the hub's labelled splits in the dataset's original file layout."""
    folder.mkdir(parents=True, exist_ok=True)
    for split, hub_split in spec.hub_splits.items():
        rows = hub[hub_split]
        with open(folder / spec.files[split], "w", newline="", encoding="utf-8") as f:
            if spec.name == "yelp_polarity":
                writer = csv.writer(f, quoting=csv.QUOTE_ALL)
                for row in rows:
                    writer.writerow([str(int(row["label"]) + 1), row["text"].replace("\n", "\\n")])
            else:
                f.write("id\t" + "\t".join(QQP_COLUMNS) + "\n")
                for i, row in enumerate(rows):
                    f.write(f"{row.get('idx', i)}\t{_one_line(row['question1'])}\t"
                            f"{_one_line(row['question2'])}\t{int(row['label'])}\n")


#: seconds to wait before each retry of a download that failed for a transient reason
RETRY_DELAYS = (10.0, 60.0)
#: what an exception (or its cause) says when there is no route at all (offline, no host):
#: recorded as a skip; any other download error is retried, then fails the stage
_NO_ROUTE = ("couldn't reach", "name or service not known", "temporary failure in name "
             "resolution", "network is unreachable", "connection refused", "offline",
             "no address associated", "nodename nor servname", "failed to resolve")
#: what a transient failure says somewhere in the chain; it wins over :data:`_NO_ROUTE`, since
#: ``datasets`` wraps a read timeout as "Couldn't reach '<name>' on the Hub (ReadTimeout)" (or
#: "(LocalEntryNotFoundError)" around an httpx/requests timeout)
_TRANSIENT = ("timeout", "timed out", "connection reset", "connection aborted",
              "remote end closed", "remoteprotocolerror", "chunkedencodingerror",
              "incompleteread", "too many requests", "bad gateway", "service unavailable",
              "gateway time", "internal server error", "server error")


class DownloadFailed(RuntimeError):
    """A download that failed for a transient reason after every retry: the stage fails and
    records no skip (the next run tries again)."""


def no_route(exc: BaseException) -> bool:
    """Whether ``exc`` means the download has no route here (the library is missing, the hub
    is unreachable or offline mode is on), as opposed to a transient failure worth a retry
    (a timeout, a dropped connection or a server error anywhere in its chain of causes)."""
    chain: list[BaseException] = []
    seen: BaseException | None = exc
    while seen is not None and seen not in chain:
        chain.append(seen)
        seen = seen.__cause__ or seen.__context__
    if any(isinstance(e, ImportError) for e in chain):
        return True
    texts = [f"{type(e).__name__}: {e}".lower() for e in chain]
    if any(isinstance(e, TimeoutError) or any(m in t for m in _TRANSIENT)
           for e, t in zip(chain, texts, strict=True)):
        return False
    return any(marker in t for t in texts for marker in _NO_ROUTE)


def _with_retries(download: Callable[[], str], what: str) -> str:
    """``download()``, retried after each of :data:`RETRY_DELAYS` on a transient error; an
    error meaning no route (:func:`no_route`) propagates at once (the caller records the
    skip); a transient one that outlasts the retries raises :class:`DownloadFailed`: the stage
    fails and nothing is recorded, so the next run tries again."""
    for attempt, delay in enumerate((*RETRY_DELAYS, None), start=1):
        try:
            return download()
        except Exception as exc:  # network, hub and library errors
            if no_route(exc):
                raise
            if delay is None:
                raise DownloadFailed(f"{what}: download failed {attempt} times "
                                     f"({first_line(exc)}); not recorded as skipped: run the "
                                     "data stage again") from exc
            print(f"{what}: download failed ({first_line(exc)}); retrying in {delay:g} s",
                  flush=True)
            time.sleep(delay)
    raise AssertionError("unreachable")


def fetch_hub_text(name: str, raw_dir: Path, mirror: Path | None, download: bool) -> str:
    """Make Yelp polarity or QQP readable from ``raw_dir``; return the source used.

    Mirror layout: ``<mirror>/YelpPolarity/{train,test}.csv`` (the original CSV release),
    ``<mirror>/QQP/{train,dev}.tsv`` (GLUE). The download goes through Hugging Face
    ``datasets`` (imported only here) and is written out in the same layout.
    """
    spec = HUB_TEXT_DATASETS[name]
    local = raw_dir / spec.folder / "raw"
    cached = marked_source(local)
    if cached and set(spec.hub_splits) <= set(_hub_text_files(spec, local)):
        return cached
    mirror_dir = mirror / spec.folder if mirror else None
    if mirror_dir and set(spec.hub_splits) <= set(_hub_text_files(spec, mirror_dir)):
        local.mkdir(parents=True, exist_ok=True)
        for path in _hub_text_files(spec, mirror_dir).values():
            shutil.copyfile(path, local / path.name)
        return mark_source(local, f"mirror {mirror_dir}")
    error = None
    if download:
        cache = raw_dir / spec.folder / "hub-cache"

        def fetch() -> str:
            from datasets import load_dataset

            hub = load_dataset(spec.hub_id, spec.hub_config, cache_dir=str(cache))
            _write_hub_text(spec, hub, local)
            shutil.rmtree(cache, ignore_errors=True)  # the files above are the raw copy
            where = spec.hub_id + (f" {spec.hub_config}" if spec.hub_config else "")
            return mark_source(local, f"download (Hugging Face datasets: {where})")

        try:
            return _with_retries(fetch, name)
        except DownloadFailed:
            raise
        except Exception as exc:  # no route: the library is missing, or the hub unreachable
            error = first_line(exc)
    layout = ", ".join(f"{spec.folder}/{spec.files[split]}" for split in spec.hub_splits)
    raise unavailable_error(name, mirror_dir, error, layout=f"their original layout ({layout})")


def process_hub_text(name: str, raw_dir: Path, max_train: int, max_test: int, seed: int,
                     source: str) -> dict[str, Any]:
    """Sentences (and QQP's second questions as ``text_pair``) and labels, like SST-2."""
    spec = HUB_TEXT_DATASETS[name]
    local = raw_dir / spec.folder / "raw"
    out: dict[str, Any] = {"name": name, "kind": "text", "source": source,
                           "classes": list(spec.classes), "unlabelled_splits": []}
    for split, path in _hub_text_files(spec, local).items():
        rows = read_yelp_csv(path) if name == "yelp_polarity" else read_qqp_tsv(path)
        if rows is None:
            out["unlabelled_splits"].append(split)
            continue
        idx = subset_indices(len(rows["label"]), max_train if split == "train" else max_test, seed)
        out[split] = {key: [rows[key][i] for i in idx.tolist()] for key in ("text", "text_pair")
                      if key in rows}
        out[split]["y"] = torch.tensor(rows["label"], dtype=torch.int64)[idx]
    return out
