"""A standard (non-Lipschitz) text transformer: the clean-accuracy reference of the certified
models of :mod:`attncert.text.models`, read the same way (ids or embeddings in, logits out)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attncert.models.config import sequence_block_config
from attncert.models.vit import Block

from .lofast import masked_mean_logits
from .olsa import normalize_tokens


class StandardTextTransformer(nn.Module):
    """A standard pre-norm transformer classifier of the given size: word embeddings of norm
    ``token_norm`` (the certified models' embedding space) + position embeddings,
    :class:`attncert.models.vit.Block` s of the standard ViT (LayerNorm, dot-product attention
    with padding keys masked, GELU MLP), LayerNorm, mean pooling over the real tokens, a linear
    head. No Lipschitz constraint: the clean-accuracy reference of the certified models."""

    def __init__(self, vocab_size: int, max_len: int, dim: int, depth: int, heads: int,
                 mlp_hidden: int, num_classes: int = 2, token_norm: float = 2.0):
        super().__init__()
        cfg = sequence_block_config("standard", dim=dim, depth=depth, heads=heads,
                                    mlp_hidden=mlp_hidden, num_classes=num_classes,
                                    block="prenorm")
        self.token_norm = float(token_norm)
        self.word = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.word.weight, std=dim ** -0.5)
        self.pos = nn.Parameter(torch.zeros(1, max_len, dim))
        nn.init.trunc_normal_(self.pos, std=0.02)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def embed(self, ids: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, dim): word embeddings normalised to ``token_norm`` (the input PGD perturbs)."""
        return normalize_tokens(self.word(ids), self.token_norm)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return masked_mean_logits(self, x, mask)
