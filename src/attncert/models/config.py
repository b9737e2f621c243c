"""The ViT's architecture: :class:`ViTConfig` and its choice lists (kinds, block forms, pools,
attentions, norms); see :mod:`attncert.models.vit` for what each choice builds."""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attncert.pipeline.params import NORMALIZE, dataclass_from_mapping

KINDS = ("lipschitz", "standard")
BLOCKS = ("stream", "prenorm")
POOLS = ("cls", "mean")
ATTENTIONS = ("dot", "l2", "lnformer", "cosine")
NORMS = ("layernorm", "center")


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of a ViT. ``radius_stream = None`` means sqrt(dim) (LoFAST's LayerNorm
    replacement); ``mean``/``std`` are the dataset's per-channel pixel statistics (None: 0 / 1).
    Radii and gammas only matter for ``kind = "lipschitz"``; ``attn_bias`` only for "standard".
    ``head_norm = True``: the head applies its rows scaled to unit l2 norm (w_j / ||w_j||; the
    bias stays free), so logit margins are feature-space margins and a fixed logit_scale / LMT
    offset keep their meaning (the head cannot grow instead of the margins; certificates use
    those rows).
    ``attention``, ``norm``, ``residual_scale``, ``spectral_init``: the baselines of the module
    docstring (standard ViT only). ``qk_tied``: every dot-product attention uses its query map
    for its keys (W^K = W^Q, so B = W^Q W^Q^T is positive semi-definite). ``attn_orthogonal``:
    the Lipschitz attention's maps are scaled orthogonal ones, W^K = W^Q (neither the value path
    nor the pattern's B can vanish).
    """

    image_size: int = 28
    channels: int = 1
    patch: int = 4
    dim: int = 128
    depth: int = 3
    heads: int = 4
    mlp_hidden: int = 256
    num_classes: int = 10
    kind: str = "lipschitz"
    block: str = "stream"
    pool: str = "cls"
    radius_attn: float = 1.0
    radius_stream: float | None = None
    gamma_qk: float = 1.0
    gamma_vo: float = 1.0
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    attn_bias: bool = False
    head_norm: bool = False
    attention: str = "dot"
    norm: str = "layernorm"
    residual_scale: float = 0.0
    spectral_init: bool = False
    qk_tied: bool = False
    attn_orthogonal: bool = False

    def __post_init__(self) -> None:
        for name in ("image_size", "channels", "patch", "dim", "depth", "heads", "mlp_hidden",
                     "num_classes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"ViTConfig.{name} must be a positive int, got {v!r}")
        for name, choices in (("kind", KINDS), ("block", BLOCKS), ("pool", POOLS),
                              ("attention", ATTENTIONS), ("norm", NORMS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"ViTConfig.{name} = {getattr(self, name)!r}: choose from "
                                 f"{', '.join(choices)}")
        if self.dim % self.heads:
            raise ValueError(f"ViTConfig.dim = {self.dim} is not divisible by heads = {self.heads}")
        if self.image_size % self.patch:
            raise ValueError(f"ViTConfig.image_size = {self.image_size} is not divisible by "
                             f"patch = {self.patch}")
        for name in ("radius_attn", "radius_stream", "gamma_qk", "gamma_vo"):
            v = getattr(self, name)
            if v is None and name == "radius_stream":
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"ViTConfig.{name} must be a number > 0, got {v!r}")
        for name, default in (("mean", 0.0), ("std", 1.0)):
            v = getattr(self, name)
            v = (default,) * self.channels if v is None else tuple(float(s) for s in v)
            if len(v) != self.channels:
                raise ValueError(f"ViTConfig.{name} has {len(v)} entries for {self.channels} "
                                 "channels")
            object.__setattr__(self, name, v)
        if min(self.std) <= 0:
            raise ValueError(f"ViTConfig.std must be > 0, got {self.std}")
        if not isinstance(self.head_norm, bool):
            raise ValueError(f"ViTConfig.head_norm must be a bool, got {self.head_norm!r}")
        if self.attn_bias and self.kind == "lipschitz":
            raise ValueError("ViTConfig.attn_bias: the Lipschitz attention is bias-free")
        v = self.residual_scale
        if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
            raise ValueError(f"ViTConfig.residual_scale must be a number >= 0, got {v!r}")
        if not isinstance(self.attn_orthogonal, bool):
            raise ValueError(f"ViTConfig.attn_orthogonal must be a bool, got "
                             f"{self.attn_orthogonal!r}")
        if self.attn_orthogonal and (self.kind != "lipschitz" or self.attention != "dot"
                                     or self.qk_tied):
            raise ValueError("ViTConfig.attn_orthogonal: the Lipschitz ViT's dot-product "
                             "attention only (its keys are tied already: no qk_tied)")
        if not isinstance(self.qk_tied, bool):
            raise ValueError(f"ViTConfig.qk_tied must be a bool, got {self.qk_tied!r}")
        if self.qk_tied and self.attention != "dot":
            raise ValueError("ViTConfig.qk_tied: ties the dot-product attention's keys to its "
                             f"queries; attention {self.attention!r} has its own form")
        if not isinstance(self.spectral_init, bool):
            raise ValueError(f"ViTConfig.spectral_init must be a bool, got {self.spectral_init!r}")
        if self.kind == "lipschitz" and self.baseline:
            raise ValueError("ViTConfig.attention/norm/residual_scale/spectral_init: the "
                             "baselines are standard ViTs (kind = 'standard')")

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch) ** 2

    @property
    def n_tokens(self) -> int:
        return self.n_patches + (self.pool == "cls")

    @property
    def baseline(self) -> bool:
        """True when any baseline option differs from the plain standard ViT."""
        return (self.attention != "dot" or self.norm != "layernorm" or self.residual_scale > 0
                or self.spectral_init)

    @property
    def stream_radius(self) -> float:
        return math.sqrt(self.dim) if self.radius_stream is None else float(self.radius_stream)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ViTConfig:
        """From a params mapping; unknown keys are an error."""
        return dataclass_from_mapping(cls, d)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["mean"], d["std"] = list(self.mean), list(self.std)
        return d


def dataset_vit_config(data: Mapping[str, Any], normalize: str, **fields: Any) -> ViTConfig:
    """A ViTConfig sized by a processed dataset (``attncert.data.load_processed``): image size
    and channels from its training images, the number of classes, and its pixel statistics.

    ``normalize`` (one of :data:`attncert.pipeline.params.NORMALIZE`) puts the statistics inside the
    model: "mean" subtracts the mean only (1-Lipschitz), "std" also divides by the std (the
    certificate counts 1 / min std), "none" feeds pixels as they are. ``fields``: every other
    ViTConfig field.
    """
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {', '.join(NORMALIZE)}, got {normalize!r}")
    x = data["train"]["x"]
    mean = tuple(data["mean"]) if normalize in ("mean", "std") else None
    std = tuple(data["std"]) if normalize == "std" else None
    return ViTConfig(image_size=int(x.shape[2]), channels=int(x.shape[1]),
                     num_classes=len(data["classes"]), mean=mean, std=std, **fields)


def sequence_block_config(kind: str, **fields: Any) -> ViTConfig:
    """The ViT blocks a token-sequence model stacks (the text transformers of
    :mod:`attncert.text`): ``kind`` and the block fields (``dim``, ``depth``, ``heads``,
    ``mlp_hidden``, ``block``, radii, gammas, ``num_classes``), mean pooling over the tokens;
    the image fields (size, patch, channels) are unused."""
    return ViTConfig(kind=kind, pool="mean", **fields)


#: Hugging Face ViTs the certvit and specformer stages may load: the standard-ViT shape of each
#: (:func:`hub_vit_config`), for the plans and the cost model
HF_VITS = {
    "google/vit-base-patch16-224": dict(image_size=224, patch=16, dim=768, depth=12, heads=12,
                                        mlp_hidden=3072),
    "WinKawaks/vit-small-patch16-224": dict(image_size=224, patch=16, dim=384, depth=12,
                                            heads=6, mlp_hidden=1536),
    "facebook/deit-tiny-patch16-224": dict(image_size=224, patch=16, dim=192, depth=12,
                                           heads=3, mlp_hidden=768),
    "WinKawaks/vit-tiny-patch16-224": dict(image_size=224, patch=16, dim=192, depth=12,
                                           heads=3, mlp_hidden=768),
}


def hub_vit_shape(source: str) -> dict[str, int] | None:
    """The shape (:data:`HF_VITS`' fields) of the hub ViT ``source``: a known id's, or a
    ``save_pretrained`` folder's (its ``config.json``); None when neither tells."""
    if source in HF_VITS:
        return HF_VITS[source]
    path = Path(source) / "config.json"
    if not path.is_file():
        return None
    c = json.loads(path.read_text())
    return dict(image_size=c["image_size"], patch=c["patch_size"], dim=c["hidden_size"],
                depth=c["num_hidden_layers"], heads=c["num_attention_heads"],
                mlp_hidden=c["intermediate_size"])


def hub_vit_config(image_size: int, patch: int, dim: int, depth: int, heads: int,
                   mlp_hidden: int, channels: int, num_classes: int,
                   mean: tuple[float, ...] | None = None, std: tuple[float, ...] | None = None
                   ) -> ViTConfig:
    """The standard ViT a hub checkpoint (ViT / DeiT, Hugging Face's layout) maps to: pre-norm
    blocks, a class token, biased attention maps. The one place this shape is spelt: the loader
    (:func:`attncert.certvit.load.vit_from_hf`) and the cost model build it from here."""
    return ViTConfig(image_size=image_size, channels=channels, patch=patch, dim=dim, depth=depth,
                     heads=heads, mlp_hidden=mlp_hidden, num_classes=num_classes,
                     kind="standard", block="prenorm", pool="cls", mean=mean, std=std,
                     attn_bias=True)
