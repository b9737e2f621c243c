"""LoFAST's small BERT-like text transformer with a Lipschitz certificate (LoFAST appendix D):
its config (:class:`TextTransformerConfig`) and model (:class:`LipschitzTextTransformer`), the
ViT's Lipschitz blocks over normalised token embeddings, certified in embedding space; and the
masked mean-pooled logits every text model shares (:func:`masked_mean_logits`)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attncert.layers import LayerProject, spectral_norm_exact
from attncert.models.config import sequence_block_config
from attncert.models.vit import Block, Component, ViTConfig

from .olsa import (
    normalize_tokens,
)


def full_mask(x: Tensor) -> Tensor:
    return torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)


def trim_padding(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` (B, L, ...) and ``mask`` (B, L) without the positions past the longest sentence
    (padding in every row: masked everywhere, so the logits do not change). Eager only: under
    ``torch.compile`` the padded length is kept, since reading the longest length is a host
    sync and a data-dependent shape (a graph break, and a new CUDA graph per length)."""
    if torch.compiler.is_compiling():
        return x, mask
    keep = int(mask.sum(1).max())
    return x[:, :keep], mask[:, :keep]


def masked_mean_logits(model: nn.Module, x: Tensor, mask: Tensor | None) -> Tensor:
    """The shared trunk of the block-stack text models: ids (or embeddings) + position
    embeddings -> ``model.blocks`` (padding keys masked) -> ``model.norm`` -> mean over the
    real tokens -> ``model.head``. Positions past the longest sentence are dropped first."""
    if mask is not None:
        x, mask = trim_padding(x, mask)
    t = (x if x.is_floating_point() else model.embed(x)) + model.pos[:, :x.shape[1]]
    for block in model.blocks:
        t = block(t, mask)
    t = model.norm(t)
    if mask is None:
        return model.head(t.mean(dim=1))
    m = mask.to(t.dtype)[..., None]
    return model.head((t * m).sum(1) / m.sum(1).clamp_min(1.0))



# ---------------------------------------------------------------------------- LoFAST model
@dataclass(frozen=True)
class TextTransformerConfig:
    """LoFAST appendix D's text transformer; ``radius_stream = None`` means sqrt(dim);
    ``token_norm``: the norm of every word embedding (OLSA's 2).

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
    token_norm: float = 2.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "max_len"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"TextTransformerConfig.{name} must be a positive int, got {v!r}")
        v = self.token_norm
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ValueError(f"TextTransformerConfig.token_norm must be a number > 0, got {v!r}")
        self.block_config()  # validates the remaining fields

    def block_config(self) -> ViTConfig:
        """The ViTConfig whose Lipschitz blocks this model stacks."""
        fields = {f.name for f in dataclasses.fields(ViTConfig)}
        own = {k: v for k, v in dataclasses.asdict(self).items() if k in fields}
        return sequence_block_config("lipschitz", **own)



class LipschitzTextTransformer(nn.Module):
    """LoFAST appendix D classifier with the ViT's certification interface on embeddings.

    The certified input is the word embeddings normalised to ``token_norm`` (OLSA's embedding
    space: every text model's radii are in the same units). A padding mask truncates the batch
    to its longest sentence, excludes padding keys from attention and padding tokens from the
    mean pooling, so a sentence of n tokens is exactly the unpadded n-token model; certificates
    are stated for that model (:meth:`at_length`), pooling constant 1/sqrt(n).
    """

    def __init__(self, config: TextTransformerConfig):
        super().__init__()
        self.config = config
        block_cfg = config.block_config()
        self.word = nn.Embedding(config.vocab_size, config.dim)
        # raw norms ~1 (as OLSA's): Adam's fixed step size then turns the directions usefully
        nn.init.normal_(self.word.weight, std=config.dim ** -0.5)
        self.pos = nn.Parameter(torch.zeros(1, config.max_len, config.dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(block_cfg) for _ in range(config.depth))
        self.norm = LayerProject(block_cfg.stream_radius)
        self.head = nn.Linear(config.dim, config.num_classes)

    def embed(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, dim): word embeddings normalised to ``token_norm`` (the certified input)."""
        return normalize_tokens(self.word(ids), self.config.token_norm)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Logits from ids (B, L) or embeddings (B, L, dim), L <= max_len; ``mask`` (B, L)
        bool with the real tokens first (None: every position is a real token)."""
        if x.shape[1] > self.config.max_len:
            raise ValueError(f"input has {x.shape[1]} positions; this model reads at most "
                             f"max_len = {self.config.max_len}")
        return masked_mean_logits(self, x, mask)

    def at_length(self, n: int) -> _FixedLength:
        """The certification interface for unpadded sentences of ``n`` tokens."""
        return _FixedLength(self, n)

    # -- certification interface (as attncert.models.vit.ViT, input = embeddings) -------------

    def attention_modules(self) -> dict[str, nn.Module]:
        return {f"blocks.{i}.attn": b.attn for i, b in enumerate(self.blocks)}

    def project_modules(self) -> dict[str, LayerProject]:
        """Every LayerProject by component name (their clean inputs give local constants)."""
        out = {}
        for i, b in enumerate(self.blocks):
            out[f"blocks.{i}.norm_attn"], out[f"blocks.{i}.norm_mlp"] = b.norm_attn, b.norm_mlp
        return out | {"norm": self.norm}

    @torch.no_grad()
    def attention_inputs(self, e: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One forward pass on unpadded embeddings: (logits, {attention or projection name: its
        clean input}); the projections' inputs give their local constants in
        :func:`attncert.models.vit.propagate`."""
        captured: dict[str, Tensor] = {}
        mods = self.attention_modules() | self.project_modules()
        handles = [mod.register_forward_pre_hook(
            lambda _m, args, name=name: captured.__setitem__(name, args[0].detach()))
            for name, mod in mods.items()]
        try:
            logits = self(e)
        finally:
            for h in handles:
                h.remove()
        return logits, captured

    def components(self, n_tokens: int | None = None) -> list[Component]:
        """Ordered :class:`Component` s from the embeddings of ``n_tokens`` (default max_len)
        unpadded tokens to the logits (exact SVDs)."""
        n = self.config.max_len if n_tokens is None else n_tokens
        out = [Component("pos", "tokens", 1.0, None)]  # adding position embeddings
        for i, block in enumerate(self.blocks):
            out += block.components(f"blocks.{i}")
        out.append(Component("norm", "project", LayerProject.lipschitz, self.norm))
        out.append(Component("pool", "pool", 1.0 / math.sqrt(n), None))
        out.append(Component("head", "head", spectral_norm_exact(self.head.weight), self.head,
                             weight=self.head.weight.detach(), bias=self.head.bias.detach()))
        return out

    @torch.no_grad()
    def certified_radius(self, ids: Tensor, mask: Tensor | None, y: Tensor,
                         variant: str = "lofast_M", test: str = "pairwise") -> Tensor:
        """(B,) float64 LoFAST radius on the normalised embeddings of each sentence's real
        tokens via :func:`attncert.certify.certify_batch` (0 if misclassified), one call per
        sentence length."""
        from attncert import certify

        mask = full_mask(ids) if mask is None else mask
        e, lengths = self.embed(ids), mask.sum(1)
        r = torch.zeros(len(y), dtype=torch.float64)
        for n in lengths.unique().tolist():
            rows = (lengths == n).nonzero().squeeze(1)
            out = certify.certify_batch(self.at_length(n), e[rows, :n], y[rows], [variant],
                                        test)
            ok = out["prediction"] == y[rows].cpu()
            r[rows.cpu()] = torch.where(ok, out[f"radius_{variant}"], 0.0)
        return r



class _FixedLength(nn.Module):
    """A :class:`LipschitzTextTransformer` on unpadded sentences of n tokens: the interface
    :mod:`attncert.certify` reads (``config``, ``components``, ``attention_inputs``, calls on
    (B, n, dim) embeddings), sharing the model's parameters."""

    def __init__(self, model: LipschitzTextTransformer, n: int):
        super().__init__()
        if not 1 <= n <= model.config.max_len:
            raise ValueError(f"length {n} outside 1..max_len = {model.config.max_len}")
        self.model, self.n, self.config = model, int(n), model.config

    def _check(self, e: Tensor) -> None:
        if e.shape[1] != self.n:
            raise ValueError(f"embeddings have {e.shape[1]} tokens; this view reads {self.n}")

    def forward(self, e: Tensor) -> Tensor:
        self._check(e)
        return self.model(e)

    def attention_inputs(self, e: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        self._check(e)
        return self.model.attention_inputs(e)

    def components(self) -> list[Component]:
        return self.model.components(self.n)
