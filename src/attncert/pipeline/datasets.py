"""The study's datasets, one table: what each is (images or text), its shape, classes and the
public release's labelled examples per split. The params checks read the names
(:data:`IMAGE_DATASETS`, :data:`TEXT_DATASETS`), the cost model the shapes and sizes
(:mod:`attncert.cost.counting`); the data package keys its routes (mirror and download,
:mod:`attncert.data.images`, :mod:`attncert.data.hub_text`) by the same names, and
``tests/test_datasets.py`` holds them to this table. A new dataset is a row here, its route in
the data package, and its tests."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DATASETS", "IMAGE_DATASETS", "TABLE", "TEXT_DATASETS", "Dataset", "stand_in"]

KINDS = ("image", "text")


@dataclass(frozen=True)
class Dataset:
    """One dataset of the study. ``splits``: labelled examples per split of the public release
    (a split without labels is absent: Yelp polarity has no dev split, QQP's GLUE test split no
    labels). Images: ``channels`` and ``size`` (the side in pixels of the images the data stage
    keeps; Imagenette: the 224-pixel evaluation crop)."""

    name: str
    kind: str
    classes: int
    splits: Mapping[str, int] = field(default_factory=dict)
    channels: int = 0
    size: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"dataset {self.name}: kind {self.kind!r}, one of {KINDS}")
        if (self.kind == "image") != (self.channels > 0 and self.size > 0):
            raise ValueError(f"dataset {self.name}: images have channels and a size, text none")


TABLE: dict[str, Dataset] = {d.name: d for d in (
    Dataset("mnist", "image", 10, {"train": 60000, "test": 10000}, 1, 28),
    Dataset("fashion_mnist", "image", 10, {"train": 60000, "test": 10000}, 1, 28),
    Dataset("cifar10", "image", 10, {"train": 50000, "test": 10000}, 3, 32),
    Dataset("cifar100", "image", 100, {"train": 50000, "test": 10000}, 3, 32),
    Dataset("svhn", "image", 10, {"train": 73257, "test": 26032}, 3, 32),
    Dataset("imagenette", "image", 10, {"train": 9469, "test": 3925}, 3, 224),
    Dataset("sst2", "text", 2, {"train": 67349, "dev": 872, "test": 1821}),
    Dataset("yelp_polarity", "text", 2, {"train": 560000, "test": 38000}),
    Dataset("qqp", "text", 2, {"train": 363846, "dev": 40430}),
)}

#: the image datasets the data stage can prepare, and the text datasets, by name
IMAGE_DATASETS = tuple(n for n, d in TABLE.items() if d.kind == "image")
TEXT_DATASETS = tuple(n for n, d in TABLE.items() if d.kind == "text")
DATASETS = IMAGE_DATASETS + TEXT_DATASETS


def stand_in(dataset: str) -> dict[str, Any]:
    """The processed-data fields a model config reads of an image dataset (shape, classes,
    statistics), without its images: what a plan or the cost model builds a config from."""
    import torch

    d = TABLE[dataset]
    if d.kind != "image":
        raise ValueError(f"stand_in: {dataset!r} is not an image dataset")
    return {"train": {"x": torch.zeros(1, d.channels, d.size, d.size, dtype=torch.uint8)},
            "classes": list(range(d.classes)), "mean": [0.5] * d.channels,
            "std": [0.25] * d.channels}
