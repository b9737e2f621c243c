"""The real evaluation sets beside the datasets: 20 CIFAR-10 or ImageNet images with labels
from their file names, ImageNet validation images the user provides (:func:`load_imagenet_val`),
and their class names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from attncert.data.common import (
    DataUnavailable,
    channel_stats,
)
from attncert.data.images import IMAGE_DATASETS, imagenet_crop, loads_from, to_uint8_nchw

SAMPLE_FOLDERS = {"cifar10_sample": "CIFAR10-sample", "imagenet_sample": "ImageNet-sample",
                  "imagenet_val": "ImageNet/val"}
#: ImageNet-1k: its classes are the sorted WordNet ids, the label order of every ImageNet model
IMAGENET_CLASSES = 1000
IMAGE_SUFFIXES = (".jpeg", ".jpg", ".png")


def load_imagenet_val(mirror: Path | None, raw_dir: Path, max_images: int, seed: int,
                      progress: bool = False) -> dict[str, Any]:
    """ImageNet validation images as uint8 tensors (the evaluation crop), a seeded subset of
    ``max_images`` (0 = all) spread evenly over the classes, in a seeded random order (any
    prefix mixes the classes: the certvit stage calibrates on the first images and certifies
    one per class of the rest), labels from their folders.

    ImageNet has no public download route: the user provides the validation images in the
    ImageFolder layout ``<raw_dir>/ImageNet/val/<wnid>/<image>.JPEG`` (the 1000 WordNet-id
    folders, as torchvision's ``ImageNet`` writes them; the mirror's ``ImageNet/val`` is read
    when ``raw_dir`` has none). Label k is the k-th WordNet id in sorted order, the index of
    ImageNet-1k models (``google/vit-base-patch16-224`` included).
    """
    from torchvision.io import ImageReadMode, decode_image

    from attncert.data.common import stratified_indices
    from attncert.pipeline.progress import bar

    where = [raw_dir / SAMPLE_FOLDERS["imagenet_val"]]
    if mirror:
        where.append(mirror / SAMPLE_FOLDERS["imagenet_val"])
    folder = next((w for w in where if w.is_dir()), None)
    if folder is None:
        raise DataUnavailable(
            "imagenet_val: ImageNet validation images have no public download route: put them "
            f"at {where[0]}/<wnid>/*.JPEG (the 1000 WordNet-id folders; torchvision's ImageNet "
            "writes this layout from the official archives)")
    wnids = sorted(d.name for d in folder.iterdir() if d.is_dir())
    if len(wnids) != IMAGENET_CLASSES or not all(
            w.startswith("n") and w[1:].isdigit() for w in wnids):
        raise DataUnavailable(
            f"imagenet_val: {folder} holds {len(wnids)} class folders; expected the "
            f"{IMAGENET_CLASSES} WordNet ids (n01440764 ...): labels are their sorted order")
    files = [(f, k) for k, w in enumerate(wnids) for f in sorted((folder / w).iterdir())
             if f.suffix.lower() in IMAGE_SUFFIXES]
    if not files:
        raise DataUnavailable(f"imagenet_val: no images under {folder}/<wnid>/")
    idx = stratified_indices([k for _, k in files], max_images, seed).tolist()
    x = torch.stack([imagenet_crop(decode_image(str(files[i][0]), mode=ImageReadMode.RGB))
                     for i in bar(idx, desc="imagenet_val", enabled=progress)])
    y = torch.tensor([files[i][1] for i in idx], dtype=torch.int64)
    mean, std = channel_stats(x)
    return {"name": "imagenet_val", "kind": "image",
            "source": f"user-provided {folder} ({len(idx)} of {len(files)} images)",
            "test": {"x": x, "y": y}, "mean": mean, "std": std, "shape": list(x.shape[1:]),
            "classes": sample_classes("imagenet_sample")}


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

    folder = mirror / SAMPLE_FOLDERS[name] if mirror else None
    prefix = name.removesuffix("_sample")
    files = _sample_files(folder, prefix) if folder and folder.is_dir() else []
    if files:
        imgs = [decode_image(str(f), mode=ImageReadMode.RGB) for f, _ in files]
        if name == "imagenet_sample":  # the standard ViT evaluation crop
            imgs = [imagenet_crop(im) for im in imgs]
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
