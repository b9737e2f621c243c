"""Lipschitz ViT (LoFAST section 5.2) and the standard ViT, from one skeleton.

normalise -> patch embedding -> (+ class token) + position embedding -> depth x block ->
final norm -> pool -> linear head. The Lipschitz model replaces LayerNorm by LayerProject
(eq. 29), the GELU MLP by an SLL residual layer, constrains the attention projections
(||W^Q||, ||W^K|| <= gamma_qk, ||W^V||, ||W^O|| <= gamma_vo) and the patch matrix (<= 1).

Block forms (MATH.md section 6):
  stream:  x <- Norm_R(x); x <- x + Att(x); MLP part     (H = I exactly on the attention input)
  prenorm: x <- x + Att(Norm_R(x));          MLP part     (eps + delta_{H=0})
MLP part: Lipschitz x <- SLL(Project(x)); standard x <- x + MLP(LayerNorm(x)).

Baselines (``kind = "standard"`` only; the defaults build the plain standard ViT):
``attention`` "dot" | "l2" (L2Former: Kim et al.'s L2 attention, W^K = W^Q) | "lnformer"
(LipschitzNorm) | "cosine" (LipsFormer's scaled cosine attention); ``norm`` "layernorm" |
"center" (LipsFormer's CenterNorm, every norm of the model); ``residual_scale`` alpha > 0
scales both branches, x + alpha * f(x) (LipsFormer; 0 = off); ``spectral_init`` starts every
linear map of the blocks at spectral norm 1 (LipsFormer). LipsFormer = center + cosine +
residual_scale + spectral_init (:mod:`attncert.layers.attention_variants`).

For certification, :meth:`ViT.components` lists the network as ordered pieces with their
constants and :meth:`ViT.attention_inputs` returns each attention layer's clean input X_k
from one forward pass; :func:`propagate` chains them (MATH.md section 6, eq. 9).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attncert.io import torch_save
from attncert.layers import (
    CenterNorm,
    L2MultiHeadAttention,
    LayerProject,
    LNFormerAttention,
    MultiHeadAttention,
    Normalize,
    PatchEmbed,
    ResidualScale,
    ScaledCosineAttention,
    SLLResidual,
    project_local_lipschitz,
    spectral_init_,
    spectral_norm_exact,
)
from attncert.params import dataclass_from_mapping

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
    docstring (standard ViT only).
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


@dataclass(frozen=True, eq=False)
class Component:
    """One piece of the network, in forward order, for perturbation propagation.

    How a perturbation bound eps (in ||.||_F of the whole tensor) passes through it:
      kind "attention", residual "identity": eps -> delta_{H=I}(X, eps), X = the clean input
          of the attention module ``name`` (the projected stream: H = I is exact);
      kind "attention", residual "skip": eps -> eps + delta_{H=0}(X, pre_lipschitz * eps)
          (pre-norm block: the branch's norm, Lipschitz ``pre_lipschitz``, is inside);
      kind "head": logits = features @ weight.T + bias; use ``weight`` rows for the pairwise test;
      anything else: eps -> lipschitz * eps.
    ``lipschitz`` is a global constant; math.inf where none exists (dot-product attention,
    LayerNorm and anything containing it).
    """

    name: str
    kind: str  # normalize|patch_embed|tokens|project|layernorm|centernorm|attention|
    #            attention_variant (a baseline's residual attention, no bound)|sll|mlp|pool|head
    lipschitz: float
    module: nn.Module | None = None
    residual: str = "none"  # attention only: "identity" | "skip"
    pre_lipschitz: float = 1.0
    weight: Tensor | None = None
    bias: Tensor | None = None


class MLP(nn.Module):
    """Standard GELU MLP (the branch; the block adds the residual)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.act, self.fc2 = nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))


class Block(nn.Module):
    """One transformer block, "stream" or "prenorm" form (see the module docstring)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.form, self.lipschitz = cfg.block, cfg.kind == "lipschitz"
        if self.lipschitz:
            self.norm_attn = LayerProject(cfg.radius_attn)
            self.norm_mlp = LayerProject(cfg.stream_radius)
            self.mlp = SLLResidual(cfg.dim, cfg.mlp_hidden)
        else:
            self.norm_attn, self.norm_mlp = _norm(cfg), _norm(cfg)
            self.mlp = MLP(cfg.dim, cfg.mlp_hidden)
        self.attn = _attention(cfg)
        # the plain dot-product residual F(X) = H X + sum_l P_l X A_l that the bounds know
        self.dot_residual = cfg.attention == "dot" and cfg.residual_scale == 0
        self.scale_attn = self.scale_mlp = None
        if cfg.residual_scale > 0:  # LipsFormer: x + alpha * f(x) on both branches
            self.scale_attn = ResidualScale(cfg.dim, cfg.residual_scale)
            self.scale_mlp = ResidualScale(cfg.dim, cfg.residual_scale)
        if cfg.spectral_init:
            for m in self.modules():
                if isinstance(m, nn.Linear):
                    spectral_init_(m.weight)

    @staticmethod
    def _scaled(scale: ResidualScale | None, y: Tensor) -> Tensor:
        return y if scale is None else scale(y)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """``mask`` (B, n) bool: padding keys excluded (dot-product attention only)."""
        kw = {} if mask is None else {"mask": mask}
        if self.form == "stream":
            x = self.norm_attn(x)
            # F(X) = X + sum_l P_l X A_l on the attention's own input
            x = x + self._scaled(self.scale_attn, self.attn(x, **kw))
        else:
            x = x + self._scaled(self.scale_attn, self.attn(self.norm_attn(x), **kw))
        if self.lipschitz:
            return self.mlp(self.norm_mlp(x))  # SLL carries its own residual
        return x + self._scaled(self.scale_mlp, self.mlp(self.norm_mlp(x)))

    def components(self, prefix: str) -> list[Component]:
        norm_kind, norm_l = _norm_component(self.norm_attn)
        out = []
        if not self.dot_residual:  # a baseline's attention: no local bound, no constant claimed
            if self.form == "stream":
                out.append(Component(f"{prefix}.norm_attn", norm_kind, norm_l, self.norm_attn))
            out.append(Component(f"{prefix}.attn", "attention_variant", math.inf, self.attn))
        elif self.form == "stream":
            out.append(Component(f"{prefix}.norm_attn", norm_kind, norm_l, self.norm_attn))
            out.append(Component(f"{prefix}.attn", "attention", math.inf, self.attn,
                                 residual="identity"))
        else:
            out.append(Component(f"{prefix}.attn", "attention", math.inf, self.attn,
                                 residual="skip", pre_lipschitz=norm_l))
        if self.lipschitz:
            out.append(Component(f"{prefix}.norm_mlp", "project", 1.0, self.norm_mlp))
            out.append(Component(f"{prefix}.mlp", "sll", SLLResidual.lipschitz, self.mlp))
        else:
            out.append(Component(f"{prefix}.mlp", "mlp", math.inf, self.mlp))  # contains its norm
        return out


def _norm(cfg: ViTConfig) -> nn.Module:
    """The standard ViT's norm: LayerNorm, or LipsFormer's CenterNorm."""
    return CenterNorm(cfg.dim) if cfg.norm == "center" else nn.LayerNorm(cfg.dim)


def _norm_component(norm: nn.Module) -> tuple[str, float]:
    """(component kind, Lipschitz constant) of a norm: LayerNorm has none (math.inf)."""
    if isinstance(norm, LayerProject):
        return "project", LayerProject.lipschitz
    if isinstance(norm, CenterNorm):
        return "centernorm", norm.compute_lipschitz()
    return "layernorm", math.inf


def _attention(cfg: ViTConfig) -> nn.Module:
    """The block's attention: dot-product (constrained for the Lipschitz ViT) or a baseline."""
    if cfg.attention == "l2":
        return L2MultiHeadAttention(cfg.dim, cfg.heads, bias=cfg.attn_bias)
    if cfg.attention == "lnformer":
        return LNFormerAttention(cfg.dim, cfg.heads, bias=cfg.attn_bias)
    if cfg.attention == "cosine":
        return ScaledCosineAttention(cfg.dim, cfg.heads, bias=cfg.attn_bias)
    return MultiHeadAttention(cfg.dim, cfg.heads, cfg.kind == "lipschitz", cfg.gamma_qk,
                              cfg.gamma_vo, bias=cfg.attn_bias)


class ViT(nn.Module):
    """Vision transformer on pixels in [0, 1] (B, C, H, W) -> logits (B, num_classes)."""

    def __init__(self, cfg: ViTConfig):
        super().__init__()
        self.config = cfg
        lip = cfg.kind == "lipschitz"
        self.normalize = Normalize(cfg.mean, cfg.std)
        self.embed = PatchEmbed(cfg.channels, cfg.patch, cfg.dim, lipschitz=lip)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim)) if cfg.pool == "cls" else None
        self.pos = nn.Parameter(torch.zeros(1, cfg.n_tokens, cfg.dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = LayerProject(cfg.stream_radius) if lip else _norm(cfg)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)

    def tokens(self, x: Tensor) -> Tensor:
        """(B, n, dim): normalised, embedded patches (+ class token) + position embedding."""
        t = self.embed(self.normalize(x))
        if self.cls_token is not None:
            t = torch.cat([self.cls_token.expand(t.shape[0], -1, -1), t], dim=1)
        return t + self.pos

    def pool(self, t: Tensor) -> Tensor:
        return t[:, 0] if self.config.pool == "cls" else t.mean(dim=1)

    def features(self, x: Tensor) -> Tensor:
        """(B, dim): the head's input."""
        t = self.tokens(x)
        for block in self.blocks:
            t = block(t)
        return self.pool(self.norm(t))

    def head_weight(self) -> Tensor:
        """(num_classes, dim): the matrix the head applies (unit rows when head_norm)."""
        w = self.head.weight
        if self.config.head_norm:
            w = w / w.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return w

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(self.features(x), self.head_weight(), self.head.bias)

    # -- certification interface --------------------------------------------------------------

    def attention_modules(self) -> dict[str, MultiHeadAttention]:
        """Attention layers by module name ("blocks.0.attn", ...), in forward order."""
        return {f"blocks.{i}.attn": b.attn for i, b in enumerate(self.blocks)}

    @torch.no_grad()
    def attention_inputs(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One forward pass: (logits, {attention name: its clean input X_k (B, n, dim)})."""
        captured: dict[str, Tensor] = {}
        handles = []
        for name, mod in self.attention_modules().items():
            def hook(_m, args, name=name):
                captured[name] = args[0].detach()
            handles.append(mod.register_forward_pre_hook(hook))
        try:
            logits = self(x)
        finally:
            for h in handles:
                h.remove()
        return logits, captured

    def components(self) -> list[Component]:
        """The network as ordered :class:`Component` s (constants computed now, exact SVDs)."""
        cfg = self.config
        out = [
            Component("normalize", "normalize", self.normalize.compute_lipschitz(), self.normalize),
            Component("embed", "patch_embed", self.embed.compute_lipschitz(), self.embed),
            Component("pos", "tokens", 1.0, None),  # adding constants (cls token, positions)
        ]
        for i, block in enumerate(self.blocks):
            out += block.components(f"blocks.{i}")
        out.append(Component("norm", *_norm_component(self.norm), self.norm))
        pool_l = 1.0 if cfg.pool == "cls" else 1.0 / math.sqrt(cfg.n_tokens)
        out.append(Component("pool", "pool", pool_l, None))
        w = self.head_weight().detach()
        out.append(Component("head", "head", spectral_norm_exact(w), self.head,
                             weight=w, bias=self.head.bias.detach()))
        return out

    def input_lipschitz(self) -> float:
        """Lipschitz factor of the input normalisation, 1 / min(std) (certifiers must count it)."""
        return self.normalize.compute_lipschitz()

    def global_lipschitz_upper(self, include_head: bool = True) -> float:
        """Product of global constants over all components (MATH.md section 4).

        Dot-product attention has no global Lipschitz constant, so this is math.inf whenever
        the model has attention layers; :func:`lipschitz_product` on a slice of
        :meth:`components` gives the constants of the parts before / after them.
        """
        comps = self.components()
        return lipschitz_product(comps if include_head else comps[:-1])


def lipschitz_product(components: Sequence[Component]) -> float:
    """Product bound; a skip-residual attention counts 1 + pre_lipschitz * L (L = inf)."""
    total = 1.0
    for c in components:
        if c.kind == "attention" and c.residual == "skip":
            total *= 1.0 + c.pre_lipschitz * c.lipschitz
        else:
            total *= c.lipschitz
    return total


AttentionDelta = Callable[[Component, Tensor, Tensor], Tensor]


def propagate(components: Sequence[Component], inputs: Mapping[str, Tensor],
              eps: float | Tensor, attention_delta: AttentionDelta) -> Tensor:
    """Bound on the perturbation of the head's input (B,) for input perturbations <= eps (eq. 9).

    ``inputs``: from :meth:`ViT.attention_inputs`; ``attention_delta(component, X, eps)`` must
    return an upper bound on ||Att(X') - Att(X)||_F over ||X' - X||_F <= eps (residual
    INCLUDED when component.residual == "identity", EXCLUDED (H = 0) when "skip").
    ``inputs`` may also hold the clean input of a "project" component (LayerProject): its
    local factor :func:`attncert.layers.project_local_lipschitz` then replaces the constant 1.
    """
    batch = next(iter(inputs.values())).shape[0] if inputs else None
    e = torch.as_tensor(eps, dtype=torch.float64)
    if e.dim() == 0 and batch is not None:
        e = e.expand(batch)
    for c in components:
        if c.kind == "head":
            break
        if c.kind == "attention":
            x = inputs[c.name]
            e_in = e.to(device=x.device, dtype=x.dtype)
            if c.residual == "identity":
                e = attention_delta(c, x, e_in)
            else:
                e = e_in + attention_delta(c, x, c.pre_lipschitz * e_in)
        elif c.kind == "project" and c.name in inputs:
            # a projection whose clean input lies outside its ball is locally contracting
            x = inputs[c.name]
            e = e.to(x.device)
            e = e * project_local_lipschitz(x, c.module.radius, e)
        else:
            e = e * c.lipschitz
    return e


def build_vit(config: ViTConfig | Mapping[str, Any]) -> ViT:
    """A ViT from a ViTConfig or a params mapping (unknown keys are an error)."""
    cfg = config if isinstance(config, ViTConfig) else ViTConfig.from_dict(config)
    return ViT(cfg)


def save_vit(model: ViT, path: str | Path) -> None:
    """Atomically save config and weights (CPU tensors) for :func:`load_vit`."""
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch_save({"config": model.config.to_dict(), "state_dict": state}, path)


def load_vit(path: str | Path, map_location: str | torch.device = "cpu") -> ViT:
    """Rebuild a ViT saved by :func:`save_vit` (eval mode)."""
    obj = torch.load(path, map_location=map_location, weights_only=True)
    model = build_vit(obj["config"])
    model.load_state_dict(obj["state_dict"])
    return model.to(map_location).eval()
