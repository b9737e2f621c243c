"""The small real evaluation sets (20 CIFAR-10 or ImageNet images) with labels from their file
names, and their class names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attncert.data.common import (
    DataUnavailable,
    channel_stats,
)
from attncert.data.images import IMAGE_DATASETS, loads_from, to_uint8_nchw

SAMPLE_FOLDERS = {"cifar10_sample": "CIFAR10-sample", "imagenet_sample": "ImageNet-sample"}


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
    elif name == "cifar10_sample" and raw_dir and loads_from(IMAGE_DATASETS["cifar10"], raw_dir):
        x, y = to_uint8_nchw(IMAGE_DATASETS["cifar10"].load_split(raw_dir, "test"))
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
