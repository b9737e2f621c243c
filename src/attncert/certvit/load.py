"""Load a pre-trained ViT into the project's standard ViT (the model CertViT adapts).

Three sources, one entry point, :func:`load_model`:

* a Hugging Face hub id of a ``ViTForImageClassification`` checkpoint (ViT, or DeiT without
  distillation token, e.g. ``google/vit-base-patch16-224``); needs the hub (a GPU box);
* a local folder in the same format (``save_pretrained``), e.g. from :func:`tiny_hf_vit`;
* a checkpoint file written by :func:`attncert.models.vit.save_vit`.

The weights map one to one (transformers 5.x module names; older checkpoints with
``encoder.layer.N.attention.attention.query`` keys are renamed by transformers on load):

    embeddings.patch_embeddings.projection (Conv2d, kernel = stride = p) -> embed.proj
        (the conv weight (D, C, p, p) flattened to (D, C p p): the per-patch matrix E in
        the (c, i, j) order of :func:`attncert.layers.patchify`; Lipschitz ||E||_2)
    embeddings.cls_token, embeddings.position_embeddings -> cls_token, pos
    layers.N.layernorm_before, layernorm_after -> blocks.N.norm_attn, norm_mlp
    layers.N.attention.{q,k,v,o}_proj (+ biases; zeros without qkv_bias) -> blocks.N.attn.{q,k,v,o}
    layers.N.mlp.fc1, fc2 -> blocks.N.mlp.fc1, fc2
    layernorm, classifier -> norm, head

HF ViTs take pixels rescaled to [0, 1] and normalised by the image processor's mean/std
(``preprocessor_config.json``; 0.5 / 0.5 when absent, the ViT processor's default). Here that
normalisation goes INSIDE the model (:class:`attncert.layers.Normalize`), so the model eats
pixels in [0, 1] and eps stays in pixel space (docs/math.md section 5). The LayerNorm eps of the
checkpoint (HF ViT: 1e-12; ``nn.LayerNorm``'s default: 1e-5) is set on every LayerNorm.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn

from attncert.models.config import hub_vit_config
from attncert.models.vit import ViT, build_vit, load_vit

__all__ = [
    "CheckpointUnavailable",
    "hf_normalization",
    "load_model",
    "tiny_hf_vit",
    "vit_from_hf",
]

DEFAULT_MEAN_STD = 0.5  # transformers' ViTImageProcessor default (IMAGENET_STANDARD_MEAN/STD)
PROCESSOR_FILE = "preprocessor_config.json"


class CheckpointUnavailable(OSError):
    """A checkpoint could not be read (no hub access, no such folder or file)."""


def _square(value, name: str) -> int:
    """An int from an int or an (h, w) pair with h == w."""
    if isinstance(value, int):
        return value
    h, w = value
    if h != w:
        raise ValueError(f"non-square {name} {tuple(value)} is not supported")
    return int(h)


def _floats(value) -> list[float]:
    """A list of floats from a number or a list of numbers."""
    return [float(v) for v in (value if isinstance(value, list) else [value])]


def hf_normalization(source: str | Path, revision: str | None = None,
                     local_files_only: bool = False) -> tuple[list[float], list[float]]:
    """(mean, std) per channel of a checkpoint's image processor, in pixels scaled to [0, 1].

    Read from ``preprocessor_config.json`` (a local folder or the hub); 0.5 / 0.5 when the
    file is absent, mean 0 / std 1 when it sets ``do_normalize: false``. The processor must
    rescale by 1/255 (pixels in [0, 1]), the only input space the project uses.
    """
    from transformers.utils import cached_file

    path = cached_file(str(source), PROCESSOR_FILE, revision=revision,
                       local_files_only=local_files_only,
                       _raise_exceptions_for_missing_entries=False)
    cfg = json.loads(Path(path).read_text()) if path else {}
    if cfg.get("do_rescale", True) and not math.isclose(cfg.get("rescale_factor", 1 / 255),
                                                         1 / 255, rel_tol=1e-6):
        raise ValueError(f"{source}: image processor rescales by {cfg['rescale_factor']}, not "
                         "1/255; its input space is not pixels in [0, 1]")
    if not cfg.get("do_normalize", True):
        return [0.0], [1.0]
    return _floats(cfg.get("image_mean", DEFAULT_MEAN_STD)), \
        _floats(cfg.get("image_std", DEFAULT_MEAN_STD))


def vit_from_hf(hf_model: nn.Module, mean: Sequence[float], std: Sequence[float]) -> ViT:
    """The project's standard ViT with the weights of a transformers ViTForImageClassification.

    ``mean``/``std``: the processor's normalisation (one value is broadcast to every channel).
    Raises ValueError for what the standard ViT cannot express (non-GELU MLPs, non-square
    images or patches, a model without classifier). Exact up to float rounding.
    """
    c = hf_model.config
    if c.model_type != "vit":
        raise ValueError(f"model_type {c.model_type!r}: only ViT checkpoints map to the standard "
                         "ViT (DeiT without distillation token is stored as 'vit')")
    if c.hidden_act != "gelu":
        raise ValueError(f"hidden_act {c.hidden_act!r}: the standard ViT uses the exact (erf) GELU")
    if c.num_labels < 1:
        raise ValueError("the checkpoint has no classifier (num_labels = 0)")
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if head_dim * c.num_attention_heads != c.hidden_size:
        raise ValueError(f"heads x head_dim = {c.num_attention_heads} x {head_dim} != hidden "
                         f"size {c.hidden_size}")
    channels = c.num_channels
    mean, std = list(mean), list(std)
    mean = mean * channels if len(mean) == 1 else mean
    std = std * channels if len(std) == 1 else std
    cfg = hub_vit_config(_square(c.image_size, "image_size"), _square(c.patch_size, "patch_size"),
                         c.hidden_size, c.num_hidden_layers, c.num_attention_heads,
                         c.intermediate_size, channels, c.num_labels, tuple(mean), tuple(std))
    model = build_vit(cfg)

    vit = hf_model.vit
    emb = vit.embeddings
    conv = emb.patch_embeddings.projection
    state: dict[str, Tensor] = {
        "normalize.mean": model.normalize.mean, "normalize.std": model.normalize.std,
        "embed.proj.weight": conv.weight.reshape(conv.weight.shape[0], -1),
        "embed.proj.bias": conv.bias,
        "cls_token": emb.cls_token,
        "pos": emb.position_embeddings,
        "norm.weight": vit.layernorm.weight, "norm.bias": vit.layernorm.bias,
        "head.weight": hf_model.classifier.weight, "head.bias": hf_model.classifier.bias,
    }
    for i, layer in enumerate(vit.layers):
        p = f"blocks.{i}."
        att = layer.attention
        for ours, theirs in (("q", att.q_proj), ("k", att.k_proj), ("v", att.v_proj),
                             ("o", att.o_proj)):
            state[f"{p}attn.{ours}.weight"] = theirs.weight
            state[f"{p}attn.{ours}.bias"] = (theirs.bias if theirs.bias is not None
                                             else torch.zeros(theirs.out_features))
        for ours, theirs in (("norm_attn", layer.layernorm_before),
                             ("norm_mlp", layer.layernorm_after),
                             ("mlp.fc1", layer.mlp.fc1), ("mlp.fc2", layer.mlp.fc2)):
            state[f"{p}{ours}.weight"], state[f"{p}{ours}.bias"] = theirs.weight, theirs.bias
    model.load_state_dict({k: v.detach().float().cpu() for k, v in state.items()}, strict=True)
    for m in model.modules():
        if isinstance(m, nn.LayerNorm):
            m.eps = float(c.layer_norm_eps)
    return model.eval()


def load_model(source: str | Path, revision: str | None = None,
               local_files_only: bool = False) -> ViT:
    """The standard ViT (CPU, eval mode) from a hub id, an HF folder or a save_vit checkpoint.

    A path to a file is read with :func:`attncert.models.vit.load_vit` (it must hold a
    ``kind="standard"`` ViT); a folder, or a string that is no local path, goes through
    ``ViTForImageClassification.from_pretrained`` and :func:`vit_from_hf`. Without hub
    access (offline machines) a hub id fails with :class:`CheckpointUnavailable`.
    A checkpoint that lacks weights (which ``from_pretrained`` would fill at random) is an
    error. Note: a save_vit checkpoint does not store the LayerNorm eps (``nn.LayerNorm``'s 1e-5
    comes back), so an HF model saved that way differs slightly from the HF original.
    """
    path = Path(source)
    if path.is_file():
        model = load_vit(path)
        if model.config.kind != "standard":
            raise ValueError(f"{path}: a {model.config.kind!r} ViT; CertViT adapts standard ViTs")
        return model
    from transformers import ViTForImageClassification

    try:
        hf, info = ViTForImageClassification.from_pretrained(
            str(source), revision=revision, local_files_only=local_files_only,
            output_loading_info=True)
        mean, std = hf_normalization(source, revision, local_files_only)
    except OSError as exc:
        where = "local folder" if path.is_dir() else "Hugging Face hub id"
        raise CheckpointUnavailable(
            f"cannot load {str(source)!r} as a {where}: {str(exc).splitlines()[0]}. Offline, "
            "pass a folder written by save_pretrained (see tiny_hf_vit) or a save_vit "
            "checkpoint file") from exc
    # from_pretrained fills weights a checkpoint lacks with random ones and only logs it: a
    # certified model of random weights is no result, so a missing weight is an error
    missing = [*info.get("missing_keys", []), *(k for k, *_ in info.get("mismatched_keys", []))]
    if missing:
        raise ValueError(f"{source}: the checkpoint lacks (or has other shapes for) "
                         f"{len(missing)} weight(s) of ViTForImageClassification, e.g. "
                         f"{sorted(missing)[:3]}; pass a complete ViTForImageClassification "
                         "checkpoint")
    model = vit_from_hf(hf.eval(), mean, std)
    model.hub_revision = hub_revision(hf)
    return model


def hub_revision(model) -> str | None:
    """The hub commit a pre-trained model was loaded from (transformers records it on the
    config; our converted ViTs carry it as ``hub_revision``); None for a local folder or
    file. The stages write it into their reports and checkpoint fingerprints, so a run says
    which weights it used and never resumes on others."""
    found = getattr(model, "hub_revision", None)
    if found is None:
        found = getattr(getattr(model, "config", None), "_commit_hash", None)
    return found if isinstance(found, str) and found else None


def tiny_hf_vit(path: str | Path, image_size: int = 224, patch_size: int = 16,
                hidden_size: int = 32, num_layers: int = 2, num_heads: int = 2,
                intermediate_size: int = 64, num_labels: int = 1000, channels: int = 3,
                seed: int = 0) -> Path:
    """Save a tiny randomly initialised HF ViTForImageClassification (and its processor config).

    A stand-in for a hub checkpoint on offline machines: the same files ``save_pretrained``
    writes for ``google/vit-base-patch16-224`` (ImageNet sizes by default: 224 pixels,
    patch 16, 1000 labels), so the GPU-box route of :func:`load_model` can run end to end
    on the ImageNet sample images. Returns ``path``.
    """
    from transformers import ViTConfig as HFViTConfig
    from transformers import ViTForImageClassification, ViTImageProcessor

    cfg = HFViTConfig(image_size=image_size, patch_size=patch_size, hidden_size=hidden_size,
                      num_hidden_layers=num_layers, num_attention_heads=num_heads,
                      intermediate_size=intermediate_size, num_labels=num_labels,
                      num_channels=channels)
    path = Path(path)
    with torch.random.fork_rng(devices=[]):  # seeded weights, global RNG untouched
        torch.manual_seed(seed)
        model = ViTForImageClassification(cfg)
    model.save_pretrained(path)
    ViTImageProcessor(size={"height": image_size, "width": image_size}).save_pretrained(path)
    return path
