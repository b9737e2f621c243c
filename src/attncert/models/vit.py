"""Lipschitz ViT (LoFAST section 5.2) and the standard ViT, from one skeleton.

normalise -> patch embedding -> (+ class token) + position embedding -> depth x block ->
final norm -> pool -> linear head. The Lipschitz model replaces LayerNorm by LayerProject
(eq. 29), the GELU MLP by an SLL residual layer, constrains the attention projections
(||W^Q||, ||W^K|| <= gamma_qk, ||W^V||, ||W^O|| <= gamma_vo) and the patch matrix (<= 1).

Block forms (docs/math.md section 6):
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
from one forward pass; :func:`propagate` chains them (docs/math.md section 6, eq. 9).

The configuration lives in :mod:`attncert.models.config`, the blocks and components in
:mod:`attncert.models.blocks`; this module holds the model, the propagation of a perturbation
bound through its components, and saving and loading.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attncert.bounds.schatten import eigenvalue_upper, gram
from attncert.layers import (
    LayerProject,
    MultiHeadAttention,
    Normalize,
    PatchEmbed,
    project_local_lipschitz,
    spectral_norm_exact,
)
from attncert.models.blocks import MLP, Block, Component, norm_component, standard_norm
from attncert.models.config import ATTENTIONS, BLOCKS, KINDS, NORMS, POOLS, ViTConfig
from attncert.pipeline.io import torch_save

__all__ = ["ATTENTIONS", "BLOCKS", "KINDS", "MLP", "NORMS", "POOLS", "Block", "Component", "ViT",
           "ViTConfig", "build_vit", "lipschitz_product", "load_vit",
           "propagate", "save_vit"]


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
        self.norm = LayerProject(cfg.stream_radius) if lip else standard_norm(cfg)
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

    def head_weight(self, dtype: torch.dtype | None = None) -> Tensor:
        """(num_classes, dim): the matrix the head applies (unit rows when head_norm), in
        ``dtype`` (default: the weight's) and normalised in it: ``torch.float64`` gives the
        rows a float64 copy of the model applies, the ones a certificate divides by."""
        w = self.head.weight if dtype is None else self.head.weight.to(dtype)
        if self.config.head_norm:
            w = w / w.norm(dim=1, keepdim=True).clamp_min(1e-12)
        return w

    def forward(self, x: Tensor) -> Tensor:
        return nn.functional.linear(self.features(x), self.head_weight(), self.head.bias)

    # -- certification interface --------------------------------------------------------------

    def attention_modules(self) -> dict[str, MultiHeadAttention]:
        """Attention layers by module name ("blocks.0.attn", ...), in forward order."""
        return {f"blocks.{i}.attn": b.attn for i, b in enumerate(self.blocks)}

    def attention_inputs(self, x: Tensor, detach: bool = True
                         ) -> tuple[Tensor, dict[str, Tensor]]:
        """One forward pass: (logits, {attention name: its clean input X_k (B, n, dim)});
        ``detach=True`` runs it without autograd; ``detach=False`` keeps the logits and the
        inputs in the graph (a training loss on the logits and the bound)."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not detach):
            return self._attention_inputs(x, detach)

    def _attention_inputs(self, x: Tensor, detach: bool) -> tuple[Tensor, dict[str, Tensor]]:
        # the forward pass with its blocks' attention inputs tapped (no hooks: a compiled loss
        # traces it as one graph, :func:`attncert.training.certified_training.margin_loss`)
        taps: list[Tensor] = []
        t = self.tokens(x)
        for block in self.blocks:
            t = block(t, taps=taps)
        logits = nn.functional.linear(self.pool(self.norm(t)), self.head_weight(), self.head.bias)
        names = self.attention_modules()
        return logits, {name: a.detach() if detach else a
                        for name, a in zip(names, taps, strict=True)}

    def components(self, exact: bool = True) -> list[Component]:
        """The network as ordered :class:`Component` s, their constants computed now (exact
        SVDs). ``exact=False``: the input normalisation's, the patch embedding's and the
        head's constants are NaN (no SVD and, in the Lipschitz ViT, whose norms are
        projections, no read on the host; a CenterNorm's gain is still read): a training bound
        takes upper bounds of the first two from :meth:`live_constants` on the device, and
        :func:`propagate` never reads the head's."""
        cfg = self.config
        nan = math.nan
        out = [
            Component("normalize", "normalize",
                      self.normalize.compute_lipschitz() if exact else nan, self.normalize),
            Component("embed", "patch_embed",
                      self.embed.compute_lipschitz() if exact else nan, self.embed),
            Component("pos", "tokens", 1.0, None),  # adding constants (cls token, positions)
        ]
        for i, block in enumerate(self.blocks):
            out += block.components(f"blocks.{i}")
        out.append(Component("norm", *norm_component(self.norm), self.norm))
        pool_l = 1.0 if cfg.pool == "cls" else 1.0 / math.sqrt(cfg.n_tokens)
        out.append(Component("pool", "pool", pool_l, None))
        if not exact:
            return out + [Component("head", "head", nan, self.head)]
        w = self.head_weight().detach()
        out.append(Component("head", "head", spectral_norm_exact(w), self.head,
                             weight=w, bias=self.head.bias.detach()))
        return out

    def live_constants(self) -> dict[str, Tensor]:
        """{component name: 0-d float64 tensor}: the constants ``components(exact=False)``
        leaves NaN that :func:`propagate` reads, computed on the parameters' device by
        elementwise operations and matrix products only (no solver, no host read: a CUDA graph
        holds them) and detached: the normalisation's 1 / min(std) exactly, and an upper bound
        of the patch embedding's spectral norm, the Schatten-norm bound of its Gram matrix
        (:func:`attncert.bounds.schatten.eigenvalue_upper`), above the exact SVD's by at most a
        factor k^(1/1024), k = min(dim, C patch^2). For a training bound; certificates take
        :meth:`components`' exact constants."""
        e = self.embed.per_patch_matrix().detach().double()
        return {"normalize": 1.0 / self.normalize.std.double().min(),
                "embed": eigenvalue_upper(gram(e)).sqrt()}

    def input_lipschitz(self) -> float:
        """Lipschitz factor of the input normalisation, 1 / min(std) (certifiers must count it)."""
        return self.normalize.compute_lipschitz()

    def global_lipschitz_upper(self, include_head: bool = True) -> float:
        """Product of global constants over all components (docs/math.md section 4).

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
              eps: float | Tensor, attention_delta: AttentionDelta,
              live: Mapping[str, Tensor] | None = None) -> Tensor:
    """Bound on the perturbation of the head's input (B,) for input perturbations <= eps (eq. 9).

    ``inputs``: from :meth:`ViT.attention_inputs`; ``attention_delta(component, X, eps)`` must
    return an upper bound on ||Att(X') - Att(X)||_F over ||X' - X||_F <= eps (residual
    INCLUDED when component.residual == "identity", EXCLUDED (H = 0) when "skip").
    ``inputs`` may also hold the clean input of a "project" component (LayerProject): its
    local factor :func:`attncert.layers.project_local_lipschitz` then replaces the constant 1.
    ``live`` {component name: 0-d tensor}: constants read in place of the components' floats
    (:meth:`ViT.live_constants` for ``components(exact=False)``, whose NaN constants must all
    be there); a compiled loss computes them in its graph, where floats would be constants of
    it.
    """
    live = {} if live is None else live
    if unknown := sorted(set(live) - {c.name for c in components}):
        raise ValueError(f"propagate: live constants of no component: {unknown}")
    batch = next(iter(inputs.values())).shape[0] if inputs else None
    e = torch.as_tensor(eps, dtype=torch.float64)
    if e.dim() == 0 and batch is not None:
        e = e.expand(batch)
    for c in components:
        if c.kind == "head":
            break
        lip = live[c.name] if c.name in live else c.lipschitz
        if isinstance(lip, float) and math.isnan(lip):
            raise ValueError(f"propagate: component {c.name!r} ({c.kind}) has no constant "
                             f"(components(exact=False)): pass it in live")
        pre = c.pre_lipschitz
        if c.kind == "attention":
            x = inputs[c.name]
            e_in = e.to(device=x.device, dtype=x.dtype)
            if c.residual == "identity":
                e = attention_delta(c, x, e_in)
            else:
                e = e_in + attention_delta(c, x, pre * e_in)
        elif c.kind == "project" and c.name in inputs:
            # a projection whose clean input lies outside its ball is locally contracting
            x = inputs[c.name]
            e = e.to(x.device)
            e = e * project_local_lipschitz(x, c.module.radius, e)
        else:
            e = e.to(lip.device) * lip if isinstance(lip, Tensor) else e * lip
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
