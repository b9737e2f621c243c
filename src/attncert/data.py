"""Datasets: fetch (local mirror first, then the real download), load, subset, save.

Every image dataset is loaded through torchvision's own dataset class with
``download=False`` once its raw files are in place; only the source of those raw files
differs:

1. a local mirror in torchvision's ``<mirror>/<Dataset>/raw`` layout (``../shared/datasets``
   by default, ``data.mirror`` in params.yaml, ``$ATTNCERT_DATA_MIRROR`` overrides both);
   files are copied or decompressed into ``data/raw``, the mirror is never modified;
2. the real download (torchvision ``download=True``; SST-2 from GLUE; Yelp polarity and QQP
   through Hugging Face ``datasets``, written out in their original file layout).

A dataset listed in ``data.optional`` that neither route provides is skipped, never fatal: its
processed file records why (the same record as a skipped sample).

Processed outputs hold uint8 pixels (N, C, H, W) and per-channel mean/std of the training
split in [0, 1] pixel space: models normalise inside, so eps stays in pixel space.
"""

from __future__ import annotations

import csv
import gzip
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attncert import rng
from attncert.io import torch_save

MIRROR_ENV = "ATTNCERT_DATA_MIRROR"
SOURCE_MARKER = ".attncert-source"
SST2_GLUE_URL = "https://dl.fbaipublicfiles.com/glue/data/SST-2.zip"


class DataUnavailable(RuntimeError):
    """Neither the local mirror nor the download could provide a dataset."""


@dataclass(frozen=True)
class ImageDataset:
    """How torchvision names and lays out one image dataset."""

    name: str
    folder: str  # <mirror>/<folder>/raw and data/raw/<folder>/raw
    tv_class: str
    root_is_parent: bool  # MNIST-style classes append <folder>/raw to root themselves
    split_kwargs: Callable[[str], dict]

    def tv_root(self, raw_dir: Path) -> Path:
        return raw_dir if self.root_is_parent else raw_dir / self.folder / "raw"

    def load_split(self, raw_dir: Path, split: str, download: bool = False):
        import torchvision.datasets as tvd

        cls = getattr(tvd, self.tv_class)
        return cls(root=str(self.tv_root(raw_dir)), download=download, **self.split_kwargs(split))


def _train_flag(split: str) -> dict:
    return {"train": split == "train"}


IMAGE_DATASETS: dict[str, ImageDataset] = {
    d.name: d
    for d in (
        ImageDataset("mnist", "MNIST", "MNIST", True, _train_flag),
        ImageDataset("fashion_mnist", "FashionMNIST", "FashionMNIST", True, _train_flag),
        ImageDataset("cifar10", "CIFAR10", "CIFAR10", False, _train_flag),
        ImageDataset("cifar100", "CIFAR100", "CIFAR100", False, _train_flag),
        ImageDataset("svhn", "SVHN", "SVHN", False, lambda s: {"split": s}),
    )
}
TEXT_FOLDER = {"sst2": "SST2", "yelp_polarity": "YelpPolarity", "qqp": "QQP"}
SAMPLE_FOLDERS = {"cifar10_sample": "CIFAR10-sample", "imagenet_sample": "ImageNet-sample"}


# ---------------------------------------------------------------------------- mirror
def resolve_mirror(param: str) -> Path | None:
    """The mirror to use: $ATTNCERT_DATA_MIRROR, else the param ('' means none)."""
    value = os.environ.get(MIRROR_ENV, param)
    return Path(value).expanduser() if value else None


def _copy_tree_decompressing(src: Path, dst: Path) -> None:
    """Copy ``src`` into ``dst``: ``.gz`` files are decompressed, archives extracted."""
    from torchvision.datasets.utils import extract_archive

    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir():
            _copy_tree_decompressing(entry, target)
        elif entry.name.endswith((".tar.gz", ".tgz", ".tar", ".zip")):
            extract_archive(str(entry), str(dst))
        elif entry.suffix == ".gz":
            with gzip.open(entry, "rb") as fin, open(dst / entry.stem, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        else:
            shutil.copyfile(entry, target)


def _mark(folder: Path, source: str) -> str:
    (folder / SOURCE_MARKER).write_text(source + "\n")
    return source


def _marked_source(folder: Path) -> str | None:
    marker = folder / SOURCE_MARKER
    return marker.read_text().strip() if marker.is_file() else None


def _unavailable(name: str, mirror_dir: Path | None, download_error: str | None,
                 layout: str = "torchvision's layout") -> DataUnavailable:
    where = str(mirror_dir) if mirror_dir else "no mirror configured"
    dl = download_error if download_error else "downloads disabled (data.download: false)"
    return DataUnavailable(
        f"{name}: no usable copy in the local mirror ({where}) and the download failed "
        f"({dl}). Provide it by either (1) placing the raw files in {layout} under "
        f"a mirror folder and pointing ${MIRROR_ENV} or data.mirror at it, or (2) running "
        f"with internet access and data.download: true."
    )


def _first_line(exc: BaseException, limit: int = 300) -> str:
    """The exception as one line (torchvision's download errors span several)."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


# ---------------------------------------------------------------------------- image data
def fetch_image(name: str, raw_dir: Path, mirror: Path | None, download: bool) -> str:
    """Make the raw files of ``name`` loadable from ``raw_dir``; return the source used."""
    spec = IMAGE_DATASETS[name]
    local = raw_dir / spec.folder / "raw"
    cached = _marked_source(local)
    if cached and _loads(spec, raw_dir):
        return cached
    mirror_dir = mirror / spec.folder / "raw" if mirror else None
    if mirror_dir and mirror_dir.is_dir():
        _copy_tree_decompressing(mirror_dir, local)
        if _loads(spec, raw_dir):
            return _mark(local, f"mirror {mirror_dir}")
    error = None
    if download:
        try:
            for split in ("train", "test"):
                spec.load_split(raw_dir, split, download=True)
            return _mark(local, "download (torchvision)")
        except Exception as exc:  # network errors come in many types
            error = _first_line(exc)
    raise _unavailable(name, mirror_dir, error)


def _loads(spec: ImageDataset, raw_dir: Path) -> bool:
    try:
        for split in ("train", "test"):
            spec.load_split(raw_dir, split)
        return True
    except RuntimeError:
        return False


def _to_uint8_nchw(ds) -> tuple[torch.Tensor, torch.Tensor]:
    """Pixels and labels of a torchvision dataset as uint8 (N, C, H, W) and int64 (N,)."""
    data = ds.data
    x = torch.as_tensor(data) if not isinstance(data, torch.Tensor) else data
    if x.ndim == 3:  # MNIST-like (N, H, W)
        x = x.unsqueeze(1)
    elif x.shape[-1] in (1, 3):  # CIFAR (N, H, W, C)
        x = x.permute(0, 3, 1, 2)
    labels = getattr(ds, "targets", None)
    if labels is None:
        labels = ds.labels  # SVHN
    return x.contiguous().to(torch.uint8), torch.as_tensor(labels, dtype=torch.int64)


def subset_indices(n: int, k: int, seed: int) -> torch.Tensor:
    """``k`` distinct indices of ``range(n)`` from a seeded permutation (all if k = 0 or k >= n)."""
    if k == 0 or k >= n:
        return torch.arange(n)
    # host indices into host data: a CPU generator by design
    return torch.randperm(n, generator=rng.generator(seed, "cpu"))[:k].sort().values


def channel_stats(x: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 images in [0, 1] pixel space."""
    xf = x.to(torch.float64) / 255.0
    mean = xf.mean(dim=(0, 2, 3))
    std = xf.std(dim=(0, 2, 3))
    return mean.tolist(), std.tolist()


def process_image(name: str, raw_dir: Path, max_train: int, max_test: int, seed: int,
                  source: str) -> dict[str, Any]:
    spec = IMAGE_DATASETS[name]
    out: dict[str, Any] = {"name": name, "kind": "image", "source": source}
    for split, k in (("train", max_train), ("test", max_test)):
        ds = spec.load_split(raw_dir, split)
        x, y = _to_uint8_nchw(ds)
        idx = subset_indices(len(y), k, seed)
        out[split] = {"x": x[idx].clone(), "y": y[idx].clone()}
        if split == "train":
            out["classes"] = [str(c) for c in getattr(ds, "classes", range(int(y.max()) + 1))]
    out["mean"], out["std"] = channel_stats(out["train"]["x"])
    out["shape"] = list(out["train"]["x"].shape[1:])
    return out


# ---------------------------------------------------------------------------- SST-2
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
    cached = _marked_source(local)
    if cached and {"train", "dev"} <= set(_sst2_splits(local)):
        return cached
    mirror_dir = mirror / TEXT_FOLDER["sst2"] if mirror else None
    if mirror_dir and {"train", "dev"} <= set(_sst2_splits(mirror_dir)):
        local.mkdir(parents=True, exist_ok=True)
        for path in _sst2_splits(mirror_dir).values():
            shutil.copyfile(path, local / path.name)
        return _mark(local, f"mirror {mirror_dir}")
    error = None
    if download:
        try:
            from torchvision.datasets.utils import download_and_extract_archive

            download_and_extract_archive(SST2_GLUE_URL, download_root=str(local))
            for path in _sst2_splits(local / "SST-2").values():
                shutil.move(str(path), local / path.name)
            return _mark(local, f"download ({SST2_GLUE_URL})")
        except Exception as exc:
            error = _first_line(exc)
    raise _unavailable("sst2", mirror_dir, error)


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


# ---------------------------------------------------------------------------- Yelp, QQP
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


def fetch_hub_text(name: str, raw_dir: Path, mirror: Path | None, download: bool) -> str:
    """Make Yelp polarity or QQP readable from ``raw_dir``; return the source used.

    Mirror layout: ``<mirror>/YelpPolarity/{train,test}.csv`` (the original CSV release),
    ``<mirror>/QQP/{train,dev}.tsv`` (GLUE). The download goes through Hugging Face
    ``datasets`` (imported only here) and is written out in the same layout.
    """
    spec = HUB_TEXT_DATASETS[name]
    local = raw_dir / spec.folder / "raw"
    cached = _marked_source(local)
    if cached and set(spec.hub_splits) <= set(_hub_text_files(spec, local)):
        return cached
    mirror_dir = mirror / spec.folder if mirror else None
    if mirror_dir and set(spec.hub_splits) <= set(_hub_text_files(spec, mirror_dir)):
        local.mkdir(parents=True, exist_ok=True)
        for path in _hub_text_files(spec, mirror_dir).values():
            shutil.copyfile(path, local / path.name)
        return _mark(local, f"mirror {mirror_dir}")
    error = None
    if download:
        cache = raw_dir / spec.folder / "hub-cache"
        try:
            from datasets import load_dataset

            hub = load_dataset(spec.hub_id, spec.hub_config, cache_dir=str(cache))
            _write_hub_text(spec, hub, local)
            shutil.rmtree(cache, ignore_errors=True)  # the files above are the raw copy
            where = spec.hub_id + (f" {spec.hub_config}" if spec.hub_config else "")
            return _mark(local, f"download (Hugging Face datasets: {where})")
        except Exception as exc:  # ImportError, network and hub errors
            error = _first_line(exc)
    layout = ", ".join(f"{spec.folder}/{spec.files[split]}" for split in spec.hub_splits)
    raise _unavailable(name, mirror_dir, error, layout=f"their original layout ({layout})")


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


# ---------------------------------------------------------------------------- samples
def _sample_files(folder: Path, prefix: str) -> list[tuple[Path, int]]:
    files = sorted(folder.glob(f"{prefix}_*_*.*"))
    return [(f, int(f.stem.rsplit("_", 1)[1])) for f in files]


def load_sample(name: str, mirror: Path | None, raw_dir: Path,
                available: dict[str, dict] | None = None) -> dict[str, Any]:
    """A small real evaluation set (20 images) as uint8 tensors, labels from file names.

    ``cifar10_sample`` falls back to the first 20 official CIFAR-10 test images when the
    full dataset was fetched; ImageNet validation images have no public download route.
    """
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms import v2

    folder = mirror / SAMPLE_FOLDERS[name] if mirror else None
    prefix = name.removesuffix("_sample")
    files = _sample_files(folder, prefix) if folder and folder.is_dir() else []
    if files:
        imgs = [decode_image(str(f), mode=ImageReadMode.RGB) for f, _ in files]
        if name == "imagenet_sample":  # the standard ViT evaluation crop
            tf = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])
            imgs = [tf(im) for im in imgs]
        x = torch.stack(imgs)
        y = torch.tensor([label for _, label in files], dtype=torch.int64)
        source = f"mirror {folder}"
    elif name == "cifar10_sample" and raw_dir and _loads(IMAGE_DATASETS["cifar10"], raw_dir):
        x, y = _to_uint8_nchw(IMAGE_DATASETS["cifar10"].load_split(raw_dir, "test"))
        x, y, source = x[:20], y[:20], "first 20 CIFAR-10 test images (download route)"
    else:
        raise DataUnavailable(
            f"{name}: not found in the local mirror ({folder or 'no mirror configured'})"
            + (" and CIFAR-10 was not fetched (add cifar10 to data.datasets to use its first 20 "
               "test images)" if name == "cifar10_sample" else
               "; ImageNet images have no public download route: provide the folder "
               f"{SAMPLE_FOLDERS[name]}/ with imagenet_<index>_<label>.jpg files in the mirror")
        )
    mean, std = channel_stats(x)
    return {"name": name, "kind": "image", "source": source, "test": {"x": x, "y": y},
            "mean": mean, "std": std, "shape": list(x.shape[1:]), "classes": sample_classes(name)}


def sample_classes(name: str) -> list[str]:
    if name == "cifar10_sample":
        return ["airplane", "automobile", "bird", "cat", "deer",
                "dog", "frog", "horse", "ship", "truck"]
    import torchvision

    return list(torchvision.models.ViT_B_16_Weights.IMAGENET1K_V1.meta["categories"])


# ---------------------------------------------------------------------------- the stage
def prepare(datasets: list[str], samples: list[str], mirror: str, raw_dir: str,
            processed_dir: str, download: bool, max_train: int, max_test: int,
            subset_seed: int, optional: Sequence[str] = (),
            progress: bool = True) -> list[dict[str, Any]]:
    """Fetch, process and save every requested dataset; return one summary row each.

    Every dataset is fetched before anything is written, so a missing dataset fails the
    stage in seconds, naming both routes. A sample without a route is skipped: its file holds
    the reason (see :func:`skipped_sample`) and its row has a ``skipped`` entry. A dataset in
    ``optional`` is skipped the same way (:func:`skipped_dataset`) when no route provides it
    or when it is not in ``datasets``.
    """
    from tqdm.auto import tqdm

    mirror_path = resolve_mirror(mirror)
    raw, processed = Path(raw_dir), Path(processed_dir)
    sources = {}
    # an optional dataset (data.optional) is skipped, never fatal, with the reason recorded in
    # its processed file, like a sample; every optional dataset gets a file (the data or the
    # record), so a stage that depends on one always finds it
    skipped = {name: "not listed in data.datasets" for name in optional if name not in datasets}
    for name in tqdm(datasets, desc="fetch", disable=not progress):
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
            loaded.append(load_sample(name, mirror_path, raw))
        except DataUnavailable as exc:
            loaded.append(skipped_sample(name, str(exc)))

    rows = []
    for name in tqdm(list(sources), desc="process", disable=not progress):
        if name in IMAGE_DATASETS:
            obj = process_image(name, raw, max_train, max_test, subset_seed, sources[name])
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


def _read_processed(name: str, processed_dir: str | Path) -> dict[str, Any]:
    path = Path(processed_dir) / f"{name}.pt"
    if not path.is_file():
        raise DataUnavailable(f"{path}: missing; run the data stage (`dvc repro data`) with "
                              f"{name!r} in data.datasets or data.samples")
    return torch.load(path, weights_only=True)


def load_processed(name: str, processed_dir: str | Path) -> dict[str, Any]:
    """Read a processed dataset; a clear error if the data stage has not produced it or
    skipped it (a sample without a route)."""
    obj = _read_processed(name, processed_dir)
    if "skipped" in obj:
        raise DataUnavailable(f"{name}: skipped by the data stage: {obj['skipped']}")
    return obj


def dataset_skipped(name: str, processed_dir: str | Path) -> str | None:
    """Why the data stage skipped the optional dataset ``name`` (None: it is available)."""
    return _read_processed(name, processed_dir).get("skipped")


def sample_skipped(name: str, processed_dir: str | Path) -> str | None:
    """Why the data stage skipped the sample ``name`` (None: it is available)."""
    return _read_processed(name, processed_dir).get("skipped")


def as_float(x: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float in [0, 1] (the space eps is measured in)."""
    return x.to(torch.float32) / 255.0
