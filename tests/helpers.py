"""Shared test helpers: seeded generators, random attention weights and small random models."""

from __future__ import annotations

from pathlib import Path

import torch

from attncert.bounds import AttentionWeights
from attncert.models.vit import ViTConfig, build_vit
from attncert.pipeline.params import read_yaml
from attncert.pipeline.shapes import VIT_SECTION, parse_presets

ROOT = Path(__file__).resolve().parents[1]
#: the committed params.yaml's named ViT shapes (a section that names one is parsed with them)
PRESETS = parse_presets(read_yaml(ROOT / "params.yaml")[VIT_SECTION])

F64 = torch.float64

# A tiny standard ViT on 8x8 single-channel images (CertViT tests).
TINY_VIT = dict(image_size=8, channels=1, patch=4, dim=16, depth=2, heads=2, mlp_hidden=24,
                num_classes=4, kind="standard", block="prenorm", pool="cls", attn_bias=True,
                mean=(0.3,), std=(0.4,))


def gen(seed: int) -> torch.Generator:
    """A CPU ``torch.Generator`` seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def random_attention_weights(h: int, d: int, scale: float, g: torch.Generator) -> AttentionWeights:
    """Float64 multi-head attention weights (h heads, width d, d_h = d // h): W^Q, W^K, W^V of
    shape (h, d, d_h) and W^O of shape (h, d_h, d), standard normal times ``scale``, drawn
    from ``g`` in that order."""
    d_h = d // h
    mk = lambda *s: torch.randn(*s, generator=g, dtype=F64) * scale  # noqa: E731
    return AttentionWeights(mk(h, d, d_h), mk(h, d, d_h), mk(h, d, d_h), mk(h, d_h, d))


def randomise(module: torch.nn.Module, seed: int, scale: float = 0.5) -> torch.nn.Module:
    """Cast ``module`` to float64 and overwrite every parameter (biases included) with
    ``scale`` times a standard normal draw from ``gen(seed)``; returns the module."""
    g = gen(seed)
    module.double()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(scale * torch.randn(p.shape, generator=g, dtype=F64))
    return module


def tiny_vit(**kw) -> torch.nn.Module:
    """``TINY_VIT`` with ``kw`` overriding, built after ``torch.manual_seed(0)``, in eval mode."""
    torch.manual_seed(0)
    return build_vit(ViTConfig(**{**TINY_VIT, **kw})).eval()


def set_key(tree: dict, section: str, key: str, value) -> None:
    """Set ``section.key`` in a params tree; ``key`` may name a group's key (``train.epochs``)."""
    *groups, leaf = key.split(".")
    where = tree[section]
    for g in groups:
        where = where[g]
    where[leaf] = value


def params_with(path: Path, tmp_path: Path, section: str, key: str, value) -> Path:
    """A copy of the params file ``path`` in ``tmp_path`` with ``section.key`` = ``value``."""
    from ruamel.yaml import YAML

    yaml = YAML()
    data = yaml.load(path.read_text())
    set_key(data, section, key, value)
    out = tmp_path / f"{section}-{key}.yaml"
    with out.open("w") as f:
        yaml.dump(data, f)
    return out


def pixels(b, seed=0, shape=(1, 8, 8)):
    """``b`` seeded uniform images in [0, 1] of ``shape``."""
    return torch.rand(b, *shape, generator=torch.Generator().manual_seed(seed))


def toy_sentences(n, vocab=12, max_len=8, seed=0):
    """``n`` seeded sentences of random words 3.. between [CLS] = 1 and [SEP] = 2, padded with
    [PAD] = 0 to ``max_len``; the label: token 3 occurs more often than token 4."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, max_len - 1, (n,), generator=g)
    ids = torch.randint(3, vocab, (n, max_len), generator=g)
    mask = torch.arange(max_len)[None, :] < (lengths + 2)[:, None]
    ids[:, 0] = 1
    ids[torch.arange(n), lengths + 1] = 2
    ids[~mask] = 0
    return {"ids": ids, "mask": mask, "y": ((ids == 3).sum(1) > (ids == 4).sum(1)).long()}


def processed_images(n=32, size=8, classes=4, channels=1, seed=0):
    """A processed image dataset (the data stage's format) of ``n`` seeded uint8 images, the
    same split for training and test, labels cycling through ``classes``."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 256, (n, channels, size, size), generator=g, dtype=torch.uint8)
    split = {"x": x, "y": torch.arange(n) % classes}
    return {"train": split, "test": split, "classes": [str(c) for c in range(classes)],
            "mean": [0.5] * channels, "std": [0.25] * channels, "source": "synthetic"}
