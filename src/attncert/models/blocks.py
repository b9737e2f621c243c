"""The ViT's pieces: :class:`Component` (one piece of the network with its constants, for
perturbation propagation), the standard MLP, the transformer :class:`Block` in its stream and
pre-norm forms, and the norm and attention each kind of block uses."""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import Tensor, nn

from attncert.layers import (
    CenterNorm,
    L2MultiHeadAttention,
    LayerProject,
    LNFormerAttention,
    MultiHeadAttention,
    ResidualScale,
    ScaledCosineAttention,
    SLLResidual,
    spectral_init_,
)
from attncert.models.config import ViTConfig


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
            self.norm_attn, self.norm_mlp = standard_norm(cfg), standard_norm(cfg)
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

    def forward(self, x: Tensor, mask: Tensor | None = None, taps: list[Tensor] | None = None
                ) -> Tensor:
        """``mask`` (B, n) bool: padding keys excluded (dot-product attention only); ``taps``:
        the attention's input is appended to it (:meth:`ViT.attention_inputs`)."""
        kw = {} if mask is None else {"mask": mask}
        if self.form == "stream":
            x = self.norm_attn(x)
            if taps is not None:
                taps.append(x)
            # F(X) = X + sum_l P_l X A_l on the attention's own input
            x = x + self._scaled(self.scale_attn, self.attn(x, **kw))
        else:
            a = self.norm_attn(x)
            if taps is not None:
                taps.append(a)
            x = x + self._scaled(self.scale_attn, self.attn(a, **kw))
        if self.lipschitz:
            return self.mlp(self.norm_mlp(x))  # SLL carries its own residual
        return x + self._scaled(self.scale_mlp, self.mlp(self.norm_mlp(x)))

    def components(self, prefix: str) -> list[Component]:
        norm_kind, norm_l = norm_component(self.norm_attn)
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


def standard_norm(cfg: ViTConfig) -> nn.Module:
    """The standard ViT's norm: LayerNorm, or LipsFormer's CenterNorm."""
    return CenterNorm(cfg.dim) if cfg.norm == "center" else nn.LayerNorm(cfg.dim)


def norm_component(norm: nn.Module) -> tuple[str, float]:
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
                              cfg.gamma_vo, bias=cfg.attn_bias, qk_tied=cfg.qk_tied,
                              orthogonal=cfg.attn_orthogonal)
