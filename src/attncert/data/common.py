"""What every data source shares: the mirror (``$ATTNCERT_DATA_MIRROR`` or ``data.mirror``),
the source marker of a fetched folder, the error naming both routes, seeded subsets and
per-channel statistics."""

from __future__ import annotations

import gzip
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import torch

from attncert.pipeline import rng

MIRROR_ENV = "ATTNCERT_DATA_MIRROR"
SOURCE_MARKER = ".attncert-source"
TEXT_FOLDER = {"sst2": "SST2", "yelp_polarity": "YelpPolarity", "qqp": "QQP"}


class DataUnavailable(RuntimeError):
    """Neither the local mirror nor the download could provide a dataset."""


def resolve_mirror(param: str) -> Path | None:
    """The mirror to use: $ATTNCERT_DATA_MIRROR, else the param ('' means none)."""
    value = os.environ.get(MIRROR_ENV, param)
    return Path(value).expanduser() if value else None


def copy_tree_decompressing(src: Path, dst: Path) -> None:
    """Copy ``src`` into ``dst``: ``.gz`` files are decompressed, archives extracted."""
    from torchvision.datasets.utils import extract_archive

    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir():
            copy_tree_decompressing(entry, target)
        elif entry.name.endswith((".tar.gz", ".tgz", ".tar", ".zip")):
            extract_archive(str(entry), str(dst))
        elif entry.suffix == ".gz":
            with gzip.open(entry, "rb") as fin, open(dst / entry.stem, "wb") as fout:
                shutil.copyfileobj(fin, fout)
        else:
            shutil.copyfile(entry, target)


def mark_source(folder: Path, source: str) -> str:
    """Record where ``folder``'s raw files came from (read back by :func:`marked_source`)."""
    (folder / SOURCE_MARKER).write_text(source + "\n")
    return source


def marked_source(folder: Path) -> str | None:
    """The source :func:`mark_source` recorded for ``folder``, or None."""
    marker = folder / SOURCE_MARKER
    return marker.read_text().strip() if marker.is_file() else None


def unavailable_error(name: str, mirror_dir: Path | None, download_error: str | None,
                      layout: str = "torchvision's layout") -> DataUnavailable:
    """The error naming both routes that failed and how to provide ``name``."""
    where = str(mirror_dir) if mirror_dir else "no mirror configured"
    dl = download_error if download_error else "downloads disabled (data.download: false)"
    return DataUnavailable(
        f"{name}: no usable copy in the local mirror ({where}) and the download failed "
        f"({dl}). Provide it by either (1) placing the raw files in {layout} under "
        f"a mirror folder and pointing ${MIRROR_ENV} or data.mirror at it, or (2) running "
        f"with internet access and data.download: true."
    )


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The exception as one line (torchvision's download errors span several)."""
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}"


def subset_indices(n: int, k: int, seed: int) -> torch.Tensor:
    """``k`` distinct indices of ``range(n)`` from a seeded permutation (all if k = 0 or k >= n)."""
    if k == 0 or k >= n:
        return torch.arange(n)
    # host indices into host data: a CPU generator by design
    return torch.randperm(n, generator=rng.generator(seed, "cpu"))[:k].sort().values


def stratified_indices(labels: Sequence[int], k: int, seed: int) -> torch.Tensor:
    """``k`` distinct indices spread evenly over the classes of ``labels`` (k // classes of
    each, seeded; the remainder from the rest at random), in a seeded random order (so any
    prefix mixes the classes); all of them, in that order, if k = 0 or k >= len(labels)."""
    g = rng.generator(seed, "cpu")  # host indices into host data
    n = len(labels)
    order = torch.randperm(n, generator=g)
    if 0 < k < n:
        classes = sorted(set(labels))
        per, taken, rest = k // len(classes), {c: 0 for c in classes}, []
        chosen = []
        for i in order.tolist():
            if taken[labels[i]] < per:
                taken[labels[i]] += 1
                chosen.append(i)
            else:
                rest.append(i)
        chosen += rest[:k - len(chosen)]
        order = torch.tensor(chosen)[torch.randperm(len(chosen), generator=g)]
    return order


def channel_stats(x: torch.Tensor, chunk: int = 1024) -> tuple[list[float], list[float]]:
    """Per-channel mean and std of uint8 images in [0, 1] pixel space, in float64 sums over
    chunks of ``chunk`` images (never a float copy of the whole set: ImageNet-sized splits)."""
    c = x.shape[1]
    total = torch.zeros(c, dtype=torch.float64)
    squares = torch.zeros(c, dtype=torch.float64)
    for start in range(0, len(x), chunk):
        xf = x[start:start + chunk].to(torch.float64) / 255.0
        total += xf.sum(dim=(0, 2, 3))
        squares += xf.square().sum(dim=(0, 2, 3))
    n = x.numel() // c
    mean = total / n
    var = (squares - n * mean.square()).clamp_min(0) / max(n - 1, 1)  # unbiased, as Tensor.std
    return mean.tolist(), var.sqrt().tolist()
