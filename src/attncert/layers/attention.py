"""Standard dot-product multi-head self-attention (LoFAST section 3, docs/math.md section 1).

P_l(X) = softmax_rows(X W_l^Q (X W_l^K)^T / sqrt(d_h)),  Att(X) = sum_l P_l(X) X W_l^V W_l^O.
The residual (H = I) is added by the block, not here.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .linear import NormConstrainedLinear, OrthogonalLinear


def linear_weight(m: nn.Module) -> Tensor:
    """The (out, in) matrix a linear module applies (the constrained one when it has one)."""
    return m.weight_effective() if hasattr(m, "weight_effective") else m.weight


def probs_replaced(module: nn.Module, cls: type) -> bool:
    """Whether ``module``'s ``compute_probs`` is not ``cls``'s own: replaced on the instance
    (:func:`attncert.diagnostics.override_attention`) or redefined by a subclass; a forward
    that computes the matrix its own way then uses ``compute_probs`` instead."""
    return "compute_probs" in vars(module) or type(module).compute_probs is not cls.compute_probs


class MultiHeadAttention(nn.Module):
    """Multi-head self-attention on (B, n, dim) with four dim x dim projections.

    ``lipschitz=True``: bias-free NormConstrainedLinear maps with ||W^Q||, ||W^K|| <= gamma_qk
    and ||W^V||, ||W^O|| <= gamma_vo (each head's block is a sub-matrix, so it obeys the same
    bound). ``lipschitz=False``: plain nn.Linear (biases optional). ``qk_tied``: the keys use
    the queries' map (one module, W^K = W^Q). ``orthogonal`` (Lipschitz only): W^V, W^O are
    gamma_vo times orthogonal maps and W^K = W^Q gamma_qk times one, so every head's value path
    A_l = W^V_l W^O_l has norm exactly gamma_vo^2 and B_l = W^Q_l W^Q_l^T is gamma_qk^2 times
    an orthogonal projection of rank d_h: neither can be shrunk to switch the branch off.
    """

    def __init__(self, dim: int, heads: int, lipschitz: bool, gamma_qk: float = 1.0,
                 gamma_vo: float = 1.0, bias: bool = False, qk_tied: bool = False,
                 orthogonal: bool = False):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        if lipschitz and bias:
            raise ValueError("the Lipschitz attention has no biases (F(X) = H X + sum P X A)")
        self.dim, self.heads, self.d_head = dim, heads, dim // heads
        if lipschitz:
            def make(gamma):
                return NormConstrainedLinear(dim, dim, gamma, bias=False)
            if orthogonal:
                self.q = self.k = OrthogonalLinear(dim, gamma_qk)
                self.v, self.o = OrthogonalLinear(dim, gamma_vo), OrthogonalLinear(dim, gamma_vo)
            else:
                self.q, self.k = make(gamma_qk), make(gamma_qk)
                self.v, self.o = make(gamma_vo), make(gamma_vo)
        else:
            if orthogonal:
                raise ValueError("orthogonal: the Lipschitz attention only")
            self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=bias) for _ in range(4))
        if qk_tied:  # W^K = W^Q: B_l = W^Q_l W^Q_l^T is positive semi-definite, never 0
            self.k = self.q  # while W^Q_l is not (keys cannot turn orthogonal to queries)

    @property
    def has_bias(self) -> bool:
        return any(m.bias is not None for m in (self.q, self.k, self.v, self.o))

    def _split(self, t: Tensor) -> Tensor:
        """(B, n, h*d_h) -> (B, h, n, d_h): head l is features l*d_h:(l+1)*d_h."""
        b, n, _ = t.shape
        return t.reshape(b, n, self.heads, self.d_head).transpose(1, 2)

    def compute_probs(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, h, n, n): P_l(X) = softmax(X W_l^Q (X W_l^K)^T / sqrt(d_h)); ``mask`` (B, n)
        bool excludes the False (padding) keys, so a padded sentence of n real tokens gives
        its real tokens exactly the n-token outputs."""
        q, k = self._split(self.q(x)), self._split(self.k(x))
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.d_head)
        if mask is not None:
            scores = scores.masked_fill(~mask[:, None, None, :], -math.inf)
        return torch.softmax(scores, dim=-1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Att(X) on (B, n, dim), ``mask`` as :meth:`compute_probs`'s. The matrix is the one
        :meth:`compute_probs` gives, fused with the values (``scaled_dot_product_attention``:
        its fused kernels have neither a forward-mode derivative nor a second backward, so
        take Jacobians of the module in reverse mode)."""
        v = self._split(self.v(x))
        if probs_replaced(self, MultiHeadAttention):
            # the matrix replaced (diagnostics.override_attention) or redefined: as it gives
            heads = self.compute_probs(x, mask) @ v  # (B, h, n, d_h): P_l X W_l^V
        else:  # the same P_l X W_l^V fused: one kernel, not the products, softmax and copies
            heads = F.scaled_dot_product_attention(
                self._split(self.q(x)), self._split(self.k(x)), v,
                attn_mask=None if mask is None else mask[:, None, None, :])
        b, _, n, _ = heads.shape
        return self.o(heads.transpose(1, 2).reshape(b, n, self.dim))  # concat heads, W^O

    def attention_weights(self, detach: bool = True):
        """The effective per-head matrices as ``attncert.bounds.AttentionWeights`` (x W convention).

        wq/wk/wv: (h, d, d_h), head l = weight[l*d_h:(l+1)*d_h, :].T; wo: (h, d_h, d), head l =
        weight[:, l*d_h:(l+1)*d_h].T. Detached unless ``detach=False`` (a training loss on the
        bound: :mod:`attncert.training.certified_training`). Raises if the layer has biases (the
        bounds model bias-free projections).
        """
        from attncert.bounds import AttentionWeights

        if self.has_bias:
            raise ValueError("attention with biases is not covered by the bounds (bias-free F(X))")
        h, dh, d = self.heads, self.d_head, self.dim
        wq, wk, wv, wo = (linear_weight(m) for m in (self.q, self.k, self.v, self.o))
        if detach:
            wq, wk, wv, wo = (w.detach() for w in (wq, wk, wv, wo))

        def split_in(w: Tensor) -> Tensor:
            return w.reshape(h, dh, d).transpose(1, 2)

        return AttentionWeights(split_in(wq), split_in(wk), split_in(wv), wo.T.reshape(h, dh, d))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}"
