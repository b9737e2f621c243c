"""Per-head attention weights (x W convention) and the attention map (docs/math.md section 1).

P_l(X) = softmax_rows(X W_l^Q (X W_l^K)^T / sqrt(d_h)),  F(X) = H X + sum_l P_l(X) X A_l,
A_l = W_l^V W_l^O,  B_l = W_l^Q (W_l^K)^T,  H = I (residual) or 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["AttentionWeights", "a_factors", "attention_forward", "attention_probs", "b_factors",
           "probs_of", "xa_factors", "xi_factors"]


def _split_in(weight: Tensor, heads: int) -> Tensor:
    """Linear(d, h d_h).weight (out, in) -> (h, d, d_h); head l: weight[l*d_h:(l+1)*d_h, :].T."""
    out, d = weight.shape
    if out % heads:
        raise ValueError(f"{out} output features do not split into {heads} heads")
    return weight.reshape(heads, out // heads, d).transpose(1, 2)


def _split_out(weight: Tensor, heads: int) -> Tensor:
    """Linear(h d_h, d).weight (out, in) -> (h, d_h, d); head l: weight[:, l*d_h:(l+1)*d_h].T."""
    d, inner = weight.shape
    if inner % heads:
        raise ValueError(f"{inner} input features do not split into {heads} heads")
    return weight.T.reshape(heads, inner // heads, d)


@dataclass(frozen=True)
class AttentionWeights:
    """Per-head matrices of a multi-head attention layer, x W convention.

    wq, wk, wv: (h, d, d_h); wo: (h, d_h, d). Biases are not represented: the bounds of
    docs/math.md are for bias-free projections (a key/query bias changes P, a value/output bias
    is a constant shift that cancels in F(X') - F(X) only for the value/output part).
    """

    wq: Tensor
    wk: Tensor
    wv: Tensor
    wo: Tensor

    def __post_init__(self) -> None:
        h, d, d_h = self.wq.shape
        for name, shape in (("wk", (h, d, d_h)), ("wv", (h, d, d_h)), ("wo", (h, d_h, d))):
            if tuple(getattr(self, name).shape) != shape:
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, want {shape}"
                )

    @property
    def h(self) -> int:
        return self.wq.shape[0]

    @property
    def d(self) -> int:
        return self.wq.shape[1]

    @property
    def d_h(self) -> int:
        return self.wq.shape[2]

    @property
    def A(self) -> Tensor:  # noqa: N802 - the papers' name
        """(h, d, d): A_l = W_l^V W_l^O."""
        return self.wv @ self.wo

    @property
    def B(self) -> Tensor:  # noqa: N802 - the papers' name
        """(h, d, d): B_l = W_l^Q (W_l^K)^T."""
        return self.wq @ self.wk.transpose(-1, -2)

    def to(self, *args, **kwargs) -> AttentionWeights:
        """Tensor.to on every matrix (device and/or dtype)."""
        return AttentionWeights(
            *(t.to(*args, **kwargs) for t in (self.wq, self.wk, self.wv, self.wo))
        )

    def like(self, x: Tensor) -> AttentionWeights:
        """Weights on x's device and dtype (a no-op when they already match)."""
        if self.wq.device == x.device and self.wq.dtype == x.dtype:
            return self
        return self.to(device=x.device, dtype=x.dtype)

    def head(self, l: int) -> AttentionWeights:
        """Single-head weights of head l (h = 1)."""
        return AttentionWeights(*(t[l : l + 1] for t in (self.wq, self.wk, self.wv, self.wo)))

    # -- constructors ------------------------------------------------------------------------

    @classmethod
    def from_linears(cls, q: nn.Linear, k: nn.Linear, v: nn.Linear, o: nn.Linear, heads: int):
        """From four nn.Linear maps (weight (out, in)); heads are contiguous blocks of features."""
        return cls(
            _split_in(q.weight.detach(), heads),
            _split_in(k.weight.detach(), heads),
            _split_in(v.weight.detach(), heads),
            _split_out(o.weight.detach(), heads),
        )

    @classmethod
    def from_mha(cls, mha: nn.MultiheadAttention) -> AttentionWeights:
        """From torch.nn.MultiheadAttention (in_proj_weight (3d, d) stacks q, k, v)."""
        h = mha.num_heads
        if mha.in_proj_weight is not None:
            wq, wk, wv = mha.in_proj_weight.detach().chunk(3, dim=0)
        else:
            wq, wk, wv = (
                p.detach() for p in (mha.q_proj_weight, mha.k_proj_weight, mha.v_proj_weight)
            )
        return cls(
            _split_in(wq, h),
            _split_in(wk, h),
            _split_in(wv, h),
            _split_out(mha.out_proj.weight.detach(), h),
        )

    @classmethod
    def from_hf(cls, self_attention: nn.Module, output_dense: nn.Linear | None = None):
        """From a Hugging Face attention block.

        BERT: ``from_hf(layer.attention.self, layer.attention.output.dense)`` (attributes
        query/key/value). ViT in transformers >= 5 keeps q_proj/k_proj/v_proj/o_proj in one
        module: ``from_hf(layer.attention)`` (output_dense defaults to its o_proj).
        """
        names = (
            ("query", "key", "value")
            if hasattr(self_attention, "query")
            else ("q_proj", "k_proj", "v_proj")
        )
        q, k, v = (getattr(self_attention, n) for n in names)
        if output_dense is None:
            output_dense = self_attention.o_proj
        return cls.from_linears(q, k, v, output_dense, self_attention.num_attention_heads)


def attention_probs(x: Tensor, w: AttentionWeights) -> Tensor:
    """(B, h, n, n): P_l(X) = softmax(X W_l^Q (X W_l^K)^T / sqrt(d_h)) (LoFAST section 3)."""
    w = w.like(x)
    q = torch.einsum("bnd,hde->bhne", x, w.wq)
    k = torch.einsum("bnd,hde->bhne", x, w.wk)
    return probs_of(q, k)


def probs_of(q: Tensor, k: Tensor) -> Tensor:
    """(B, h, n, n): softmax(q k^T / sqrt(d_h)) of per-head queries and keys (B, h, n, d_h):
    :func:`attention_probs` from X W^Q and X W^K computed already."""
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)


def attention_forward(x: Tensor, w: AttentionWeights, residual: bool) -> Tensor:
    """(B, n, d): F(X) = H X + sum_l P_l(X) X W_l^V W_l^O, H = I if residual else 0."""
    w = w.like(x)
    p = attention_probs(x, w)
    v = torch.einsum("bnd,hde->bhne", x, w.wv)
    out = torch.einsum("bhne,hef->bnf", p @ v, w.wo)
    return out + x if residual else out


# -- the products whose spectral norms Theorem 1 takes, each as a pair (u, v) of thin factors of
# u v^T: :func:`attncert.bounds.spectral.norm_of_product` takes the norm exactly, the training
# surrogate bounds it from above (:func:`attncert.training.certified_training.surrogate_terms`)


def a_factors(w: AttentionWeights) -> tuple[Tensor, Tensor]:
    """A_l = W_l^V W_l^O as (W_l^V, W_l^O^T), each (h, d, d_h)."""
    return w.wv, w.wo.transpose(-1, -2)


def b_factors(w: AttentionWeights) -> tuple[Tensor, Tensor]:
    """B_l = W_l^Q W_l^K^T as (W_l^Q, W_l^K), each (h, d, d_h)."""
    return w.wq, w.wk


def xi_factors(x: Tensor, w: AttentionWeights) -> tuple[tuple[Tensor, Tensor], ...]:
    """X B_l^T = (X W_l^K) W_l^Q^T and X B_l = (X W_l^Q) W_l^K^T as factor pairs, (B, h, n,
    d_h) and (h, d, d_h) (the norms xi_l(X) sums, LoFAST eq. 26)."""
    w = w.like(x)
    xq = torch.einsum("bnd,hde->bhne", x, w.wq)
    xk = torch.einsum("bnd,hde->bhne", x, w.wk)
    return (xk, w.wq), (xq, w.wk)


def xa_factors(x: Tensor, w: AttentionWeights) -> tuple[Tensor, Tensor]:
    """X A_l = (X W_l^V) W_l^O as (X W_l^V (B, h, n, d_h), W_l^O^T (h, d, d_h))."""
    w = w.like(x)
    return torch.einsum("bnd,hde->bhne", x, w.wv), w.wo.transpose(-1, -2)
