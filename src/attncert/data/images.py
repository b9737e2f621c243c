"""Image datasets (MNIST, Fashion-MNIST, CIFAR-10/100, SVHN, Imagenette) through torchvision's
own classes: fetch (mirror, then download), and process into uint8 (N, C, H, W) with seeded
subsets. Imagenette's JPEGs of every size become the standard ViT evaluation crop
(:func:`imagenet_crop`), 224 x 224."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attncert.data.common import (
    channel_stats,
    copy_tree_decompressing,
    first_line,
    mark_source,
    marked_source,
    subset_indices,
    unavailable_error,
)


@dataclass(frozen=True)
class ImageDataset:
    """How torchvision names and lays out one image dataset."""

    name: str
    folder: str  # <mirror>/<folder>/raw and data/raw/<folder>/raw
    tv_class: str
    root_is_parent: bool  # MNIST-style classes append <folder>/raw to root themselves
    split_kwargs: Callable[[str], dict]
    #: a folder of JPEGs (Imagenette) rather than arrays in memory: decoded and cropped
    #: (:func:`imagenet_crop`) when processed
    jpeg_files: bool = False

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
        # Imagenette 2 (fastai's current release, 9469 train / 3925 val images, 10 ImageNet
        # classes), 320-pixel shorter side; "test" is its validation split
        ImageDataset("imagenette", "Imagenette", "Imagenette", False,
                     lambda s: {"split": "train" if s == "train" else "val", "size": "320px"},
                     jpeg_files=True),
    )
}


def imagenet_crop(image: torch.Tensor) -> torch.Tensor:
    """The standard ViT evaluation crop: shorter side 256, centre 224 x 224."""
    from torchvision.transforms import v2

    return v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224)])(image)


def _decode_crop(path: str) -> torch.Tensor:
    from torchvision.io import ImageReadMode, decode_image

    return imagenet_crop(decode_image(path, mode=ImageReadMode.RGB))


def jpeg_tensors(ds, indices: torch.Tensor, desc: str, progress: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``indices`` images of a torchvision folder dataset (Imagenette) decoded and cropped
    (:func:`imagenet_crop`) into uint8 (N, 3, 224, 224), and their labels."""
    from attncert.pipeline.progress import bar

    ds.loader = _decode_crop
    pairs = [ds[int(i)] for i in bar(indices, desc=desc, enabled=progress)]
    return (torch.stack([x for x, _ in pairs]).contiguous(),
            torch.tensor([y for _, y in pairs], dtype=torch.int64))


def fetch_image(name: str, raw_dir: Path, mirror: Path | None, download: bool) -> str:
    """Make the raw files of ``name`` loadable from ``raw_dir``; return the source used."""
    spec = IMAGE_DATASETS[name]
    local = raw_dir / spec.folder / "raw"
    cached = marked_source(local)
    if cached and loads_from(spec, raw_dir):
        return cached
    mirror_dir = mirror / spec.folder / "raw" if mirror else None
    if mirror_dir and mirror_dir.is_dir():
        copy_tree_decompressing(mirror_dir, local)
        if loads_from(spec, raw_dir):
            return mark_source(local, f"mirror {mirror_dir}")
    error = None
    if download:
        try:
            for split in ("train", "test"):
                spec.load_split(raw_dir, split, download=True)
            return mark_source(local, "download (torchvision)")
        except Exception as exc:  # network errors come in many types
            error = first_line(exc)
    raise unavailable_error(name, mirror_dir, error)


def loads_from(spec: ImageDataset, raw_dir: Path) -> bool:
    try:
        for split in ("train", "test"):
            spec.load_split(raw_dir, split)
        return True
    except RuntimeError:
        return False


def to_uint8_nchw(ds) -> tuple[torch.Tensor, torch.Tensor]:
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


def process_image(name: str, raw_dir: Path, max_train: int, max_test: int, seed: int,
                  source: str, progress: bool = True) -> dict[str, Any]:
    spec = IMAGE_DATASETS[name]
    out: dict[str, Any] = {"name": name, "kind": "image", "source": source}
    for split, k in (("train", max_train), ("test", max_test)):
        ds = spec.load_split(raw_dir, split)
        if spec.jpeg_files:  # only the subset is decoded
            x, y = jpeg_tensors(ds, subset_indices(len(ds), k, seed), f"{name} {split}",
                                progress)
        else:
            x, y = to_uint8_nchw(ds)
            idx = subset_indices(len(y), k, seed)
            x, y = x[idx].clone(), y[idx].clone()
        out[split] = {"x": x, "y": y}
        if split == "train":
            classes = getattr(ds, "classes", range(int(y.max()) + 1))
            # Imagenette names each class by a tuple of synonyms: the first
            out["classes"] = [str(c[0] if isinstance(c, tuple) else c) for c in classes]
    out["mean"], out["std"] = channel_stats(out["train"]["x"])
    out["shape"] = list(out["train"]["x"].shape[1:])
    return out
