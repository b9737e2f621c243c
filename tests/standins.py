"""Stand-in raw files in a dataset's own release layout, for the data stage's real loading code."""

from __future__ import annotations

from pathlib import Path


def write_imagenette(raw: Path, per_class: int) -> None:
    """Imagenette 2's 320-pixel release layout: ``imagenette2-320/{train,val}/<wnid>/*.JPEG``,
    small random JPEGs of uneven shapes (the data stage crops them to 224 x 224)."""
    import torch
    from torchvision.datasets import Imagenette
    from torchvision.io import write_jpeg

    g = torch.Generator().manual_seed(15)
    for split in ("train", "val"):
        for k, wnid in enumerate(sorted(Imagenette._WNID_TO_CLASS)):
            folder = raw / "imagenette2-320" / split / wnid
            folder.mkdir(parents=True)
            for i in range(per_class):
                h, w = 40 + 8 * i, 56 - 4 * k
                img = torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=g)
                write_jpeg(img, str(folder / f"{wnid}_{i}.JPEG"))

