"""OLSA: 1-Lipschitz self-attention for text (OLSA paper, docs/math.md sections 4 and 7).

Building blocks, each 1-Lipschitz in ||.||_F of the token matrix (or with a stated bound):

* :func:`newton_orthogonalize` / :class:`OrthogonalLinear`: W = (V V^T)^{-1/2} V by
  Newton-Schulz iteration (docs/math.md section 7).
* :class:`GroupSort`: sorts each group of ``group_size`` features (1-Lipschitz, a
  permutation of its input within every group; group size 2 is MaxMin).
* :class:`OLSAAttention`: additive attention s_ij = W^S_h sigma((W^Q x_i + W^K x_j)/2) / alpha1,
  y_i = (1/alpha2) sum_j p_ij W^V x_j, with W^Q, W^K, W^V orthogonal, ||W^S_h|| = 1,
  sigma = GroupSort, alpha1 trainable and alpha2 chosen so the layer is 1-Lipschitz.
* :class:`L2Attention`: Kim et al. (2021) L2 multi-head attention (W^Q = W^K), divided by its
  Theorem 3.2 constant (:func:`attncert.bounds.kim_l2_attention_lipschitz`).
* :class:`OLSALayer`: LayerProject onto the ball the bound assumes, then the averaged residual
  0.5 x + 0.5 Att(x), then the averaged residual of a GroupSort feed-forward map (or, with
  ``residual="gated"``, (1 - b) x + b f(x) with one trainable b = sigmoid(theta) per sublayer).
* :func:`sqrt_mean_pool`: G(X) = (1/sqrt(n)) sum_i x_i (OLSA Theorem 4.2, 1-Lipschitz).

The Lipschitz bound of the attention (:func:`olsa_attention_lipschitz`) is derived here for
inputs whose tokens lie in the l2 ball of radius R (which the LayerProject in front of every
layer enforces for clean AND perturbed inputs). For n tokens, per-head blocks of norm <= s_q,
s_k, s_v and a 1-Lipschitz sigma, with Y = (1/alpha2)(P V):

  dY = (1/alpha2) [ dP V + P dV ].
  (a) ||P dV||_F <= ||P||_2 s_v ||dX||_F and ||P||_2 <= sqrt(||P||_1 ||P||_inf) = sqrt(kappa),
      kappa = max column sum of P <= n max p_ij <= n e^D / (e^D + n - 1), D = s_k R / alpha1,
      since |s_ij - s_ij'| <= ||k_j - k_j'|| / (2 alpha1) <= s_k R / alpha1 within a row.
  (b) Row i of dP V is Cov_{p_i}(ds_i, v) (softmax Jacobian diag(p) - p p^T); Cauchy-Schwarz and
      Popoviciu give ||Cov_p(u, v)|| <= sqrt(Var_p u) max_w sqrt(Var_p w.v) <= ||u|| s_v R / sqrt 2,
      and sum_{h,i} ||ds_i||^2 <= sum_{ij} ||dq_i + dk_j||^2 / (4 alpha1^2)
      <= n (s_q + s_k)^2 ||dX||_F^2 / (4 alpha1^2); so
      ||dP V||_F <= s_v R sqrt(n) (s_q + s_k) / (2 sqrt(2) alpha1) ||dX||_F
      (and 0 for n = 1: a one-token softmax is constant).

  Lip <= (s_v / alpha2) [ sqrt(kappa) + R sqrt(n) (s_q + s_k) / (2 sqrt 2 alpha1) ].

The paper's Theorem 4.1 takes ||P||_2 <= 1 (false for a row-stochastic P whose rows all favour
one token: ||P||_2 can reach sqrt(n)) and ||dP V|| <= ||V||_2 s ||ds|| with ||V||_2 <= c; (b)
replaces ||V||_2 / 2 <= R sqrt(n) / 2 by R / sqrt(2), a factor sqrt(n / 2) tighter. For
n >= 4 the whole bound stays below the sound-constant paper form with c = R sqrt(n)
(``attncert.bounds.olsa_layer_lipschitz``; checked numerically for n = 4..512 and
R / alpha1 = 1e-4..1e3); for n = 2, 3 it can exceed it by up to 0.41 (times 1/alpha2), the
range where the paper form leans on ||P||_2 <= 1. tests/test_text.py checks it against the
paper form, random pairs and PGD.
alpha2 = sqrt(kappa) + R sqrt(n) / (sqrt(2) alpha1) (unit norms) makes the layer 1-Lipschitz
for every sentence length n; it is computed per sample from the padding mask.

The linear maps and GroupSort live in :mod:`attncert.text.orthogonal`, the bounds and the
certificate regulariser in :mod:`attncert.text.olsa_bounds`; this module holds the attentions,
the layer and the pooling, and re-exports both.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from attncert.bounds import kim_l2_attention_lipschitz
from attncert.layers import LayerProject, spectral_norm_exact
from attncert.text.olsa_bounds import (
    certificate_regulariser,
    certified_radius,
    gamma_ramp,
    olsa_alpha2,
    olsa_attention_lipschitz,
)
from attncert.text.orthogonal import (
    GroupSort,
    OrthogonalLinear,
    SpectralNormLinear,
    newton_orthogonalize,
    orthogonal_weights,
    reproject_orthogonal_,
)

__all__ = [
    "ATTENTIONS", "RESIDUALS", "GroupSort", "L2Attention", "OLSAAttention", "OLSALayer",
    "OrthogonalLinear", "SpectralNormLinear", "certificate_regulariser", "certified_radius",
    "gamma_ramp", "mixed_residual_lipschitz", "newton_orthogonalize", "normalize_tokens",
    "olsa_alpha2", "olsa_attention_lipschitz", "orthogonal_weights", "reproject_orthogonal_",
    "sqrt_mean_pool",
]


ATTENTIONS = ("olsa", "l2")
#: averaged: OLSA's 0.5 x + 0.5 f(x); gated: (1 - b) x + b f(x), b = sigmoid(theta) trained
RESIDUALS = ("averaged", "gated")


def _lengths(mask: Tensor) -> Tensor:
    """(B,) number of real tokens."""
    return mask.sum(-1)


def _split_heads(t: Tensor, heads: int) -> Tensor:
    """(B, n, h*d_h) -> (B, h, n, d_h)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _given(weights: dict[str, Tensor] | None, name: str) -> Tensor | None:
    """The matrix of map ``name`` computed already for this forward pass (the training
    forward's batch, :func:`~attncert.text.orthogonal.orthogonal_weights`), else None: the map
    computes its own."""
    return None if weights is None else weights[name]


def _masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the keys of (B, h, n, n) scores, padded keys excluded."""
    return torch.softmax(scores.masked_fill(~mask[:, None, None, :], -math.inf), dim=-1)


class OLSAAttention(nn.Module):
    """OLSA additive multi-head attention (docs/math.md section 7) on (B, n, dim) with a mask.

    sigma is MaxMin (GroupSort with groups of 2). alpha1 = exp(log_alpha1) is trainable;
    alpha2 = :func:`olsa_alpha2` per sample (its n is the number of real tokens), so the map is
    1-Lipschitz on tokens of norm <= ``radius`` (with exactly orthogonal W^Q, W^K, W^V).
    """

    def __init__(self, dim: int, heads: int, radius: float, alpha1: float = 4.0,
                 iters: int = 1, train_alpha1: bool = True):
        super().__init__()
        if dim % heads or (dim // heads) % 2:
            raise ValueError(f"dim {dim} must split into {heads} heads of even size (MaxMin)")
        self.heads, self.radius = heads, float(radius)
        self.q, self.k, self.v = (OrthogonalLinear(dim, iters=iters) for _ in range(3))
        self.w_s = nn.Parameter(torch.randn(heads, dim // heads) / math.sqrt(dim // heads))
        self.log_alpha1 = nn.Parameter(torch.tensor(math.log(alpha1)),
                                       requires_grad=train_alpha1)

    @property
    def alpha1(self) -> Tensor:
        return self.log_alpha1.exp()

    def score_vector(self) -> Tensor:
        """(h, d_h): W^S_h with unit rows."""
        return self.w_s / self.w_s.norm(dim=-1, keepdim=True)

    def compute_probs(self, x: Tensor, mask: Tensor,
                      weights: dict[str, Tensor] | None = None) -> Tensor:
        """(B, h, n, n): softmax_j W^S_h MaxMin((W^Q x_i + W^K x_j) / 2) / alpha1 (``weights``:
        the maps' matrices computed already, by name, :func:`_given`).

        For a pair (a, b): max = (a + b)/2 + |a - b|/2 and min = (a + b)/2 - |a - b|/2, so
        w . MaxMin(z) = sum_p (w_p1 + w_p2)(a_p + b_p)/2 + (w_p1 - w_p2)|a_p - b_p|/2. With
        z = (q_i + k_j)/2 the first sum is f(q_i) + g(k_j), and f(q_i), the same for every key,
        cancels in the softmax: only g(k_j) + sum_p c_p |u_ip + u'_jp| is formed, a
        (B, h, n, n, d_h/2) tensor instead of sorting a (B, h, n, n, d_h) one.
        """
        q = _split_heads(self.q(x, _given(weights, "q")), self.heads)
        k = _split_heads(self.k(x, _given(weights, "k")), self.heads)
        w = self.score_vector()
        w1, w2 = w[:, 0::2], w[:, 1::2]
        g = torch.einsum("bhjp,hp->bhj", k[..., 0::2] + k[..., 1::2], w1 + w2) / 4
        u = (q[..., 0::2] - q[..., 1::2]) / 4  # (a - b)/2 = u_i + u'_j
        u_k = (k[..., 0::2] - k[..., 1::2]) / 4
        gap = (u.unsqueeze(-2) + u_k.unsqueeze(-3)).abs()  # (B, h, n, n, d_h/2)
        scores = g.unsqueeze(-2) + torch.einsum("bhijp,hp->bhij", gap, w1 - w2)
        return _masked_softmax(scores / self.alpha1, mask)

    def forward(self, x: Tensor, mask: Tensor, weights: dict[str, Tensor] | None = None
                ) -> Tensor:
        p = self.compute_probs(x, mask, weights)
        alpha2 = olsa_alpha2(self.alpha1, self.radius, _lengths(mask)).to(x.dtype)
        y = (p @ _split_heads(self.v(x, _given(weights, "v")), self.heads)).transpose(1, 2)
        y = y.flatten(2)
        return y / alpha2[:, None, None]

    @torch.no_grad()
    def lipschitz(self, n: Tensor) -> Tensor:
        """(B,) float64 sound bound at lengths n, with the exact norms of W^Q, W^K, W^V."""
        s_q, s_k, s_v = (spectral_norm_exact(m.weight_effective()) for m in (self.q, self.k,
                                                                              self.v))
        a1 = self.alpha1.double()
        alpha2 = olsa_alpha2(a1, self.radius, n).to(self.log_alpha1.dtype)  # as forward uses it
        return olsa_attention_lipschitz(a1, alpha2, self.radius, n, s_q, s_k, s_v)


class L2Attention(nn.Module):
    """Kim et al. (2021) L2 multi-head attention, W^Q = W^K, scaled to be 1-Lipschitz.

    P^h_ij ~ exp(-||x_i W^{Q,h} - x_j W^{Q,h}||^2 / sqrt(d_h)); head h outputs P^h X A_h W^{V,h},
    A_h = W^{Q,h} W^{Q,h}^T / sqrt(d_h); heads concatenated, times W^O; all three maps
    orthogonal. The output is divided by Theorem 3.2's constant for unit norms at the sample's
    length n, so the bound with the exact norms (:meth:`lipschitz`) is ~1.
    """

    def __init__(self, dim: int, heads: int, max_len: int, iters: int = 1):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.heads, self.d_head = heads, dim // heads
        self.q, self.v, self.o = (OrthogonalLinear(dim, iters=iters) for _ in range(3))
        eye = torch.eye(dim, dtype=torch.float64)
        self.register_buffer("scale", self._theorem_constants(eye, eye, eye, max_len).float(),
                             persistent=False)

    def _per_head(self, wq: Tensor, wv: Tensor, wo: Tensor):
        """(out, in) matrices -> Kim's per-head (h, d, d_h), (h, d, d_h), (h d_h, d) forms."""
        h, dh = self.heads, self.d_head
        split = lambda w: w.T.reshape(-1, h, dh).transpose(0, 1)  # noqa: E731
        return split(wq), split(wv), wo.T

    def _theorem_constants(self, wq: Tensor, wv: Tensor, wo: Tensor, max_len: int) -> Tensor:
        """(max_len + 1,) Theorem 3.2 bound for every length (entry 0 unused)."""
        heads = self._per_head(wq, wv, wo)
        return torch.tensor([1.0] + [kim_l2_attention_lipschitz(*heads, n)
                                     for n in range(1, max_len + 1)], dtype=torch.float64,
                            device=wq.device)

    def _probs(self, y: Tensor, mask: Tensor) -> Tensor:
        # -||y_i - y_j||^2 = 2 y_i.y_j - ||y_j||^2 - ||y_i||^2; the last term cancels in softmax
        scores = 2 * y @ y.transpose(-1, -2) - y.pow(2).sum(-1).unsqueeze(-2)
        return _masked_softmax(scores / math.sqrt(self.d_head), mask)

    def _weight(self, name: str, weights: dict[str, Tensor] | None) -> Tensor:
        given = _given(weights, name)
        return getattr(self, name).weight_effective() if given is None else given

    def compute_probs(self, x: Tensor, mask: Tensor,
                      weights: dict[str, Tensor] | None = None) -> Tensor:
        """(B, h, n, n): softmax_j -||x_i W^{Q,h} - x_j W^{Q,h}||^2 / sqrt(d_h), padding masked
        (``weights``: as :meth:`OLSAAttention.compute_probs`)."""
        return self._probs(_split_heads(x @ self._weight("q", weights).T, self.heads), mask)

    def forward(self, x: Tensor, mask: Tensor, weights: dict[str, Tensor] | None = None
                ) -> Tensor:
        wq = self._weight("q", weights)
        y = _split_heads(x @ wq.T, self.heads)  # (B, h, n, d_h): X W^{Q,h}
        p = self.compute_probs(x, mask, weights)  # as self._probs(y, mask), replaceable
        # X A_h W^{V,h} = (X W^{Q,h}) (W^{Q,h}^T W^{V,h}) / sqrt(d_h); row blocks of (out, in)
        wq_h = wq.unflatten(0, (self.heads, self.d_head))  # (h, d_h, d) = W^{Q,h}^T
        wv_h = self._weight("v", weights).unflatten(0, (self.heads, self.d_head))
        values = y @ (wq_h @ wv_h.transpose(-1, -2)) / math.sqrt(self.d_head)
        out = self.o((p @ values).transpose(1, 2).flatten(2), _given(weights, "o"))
        return out / self.scale[_lengths(mask)][:, None, None]

    @torch.no_grad()
    def lipschitz(self, n: Tensor) -> Tensor:
        """(B,) float64: Theorem 3.2 with the exact weights, over the training-time scale."""
        w = (m.weight_effective().double() for m in (self.q, self.v, self.o))
        exact = self._theorem_constants(*w, len(self.scale) - 1)
        return exact[n] / self.scale.double()[n]


# ---------------------------------------------------------------------------- layer, pooling
def mixed_residual_lipschitz(keep: float, mix: float, lip: Tensor | float) -> Tensor:
    """float64 bound |keep| + |mix| Lip(f) on the Lipschitz constant of x -> keep x + mix f(x)
    (triangle inequality); OLSA's averaged residual is keep = mix = 0.5 (docs/math.md section 4)."""
    return abs(keep) + abs(mix) * torch.as_tensor(lip, dtype=torch.float64)


class OLSALayer(nn.Module):
    """x <- Project_R(x); x <- (1 - b_a) x + b_a Att(x); x <- (1 - b_f) x + b_f FF(x),
    FF(x) = W_2 GroupSort(W_1 x + b_1) + b_2.

    Project_R (LayerProject, per token) keeps clean and perturbed inputs in the ball the
    attention bound assumes; the feed-forward map has orthogonal W_1, W_2, so it is 1-Lipschitz.

    ``residual="averaged"`` is OLSA's averaged residual, b_a = b_f = 0.5 (0.5 x + 0.5 f(x)).
    ``residual="gated"`` trains one theta per sublayer, b = sigmoid(theta) in (0, 1), starting
    at b = ``residual_init`` (0.5 is the averaged layer; a small b keeps the input and lets
    training decide how much of each sublayer to mix in). ``train_alpha1=False`` keeps OLSA's
    alpha1 fixed at its initial value (a softmax temperature the model cannot raise to make
    its attention uniform).

    Soundness of the bound, for either choice: for any inputs x, x' and fixed coefficients
    c = 1 - b and b (the forward pass's own values: they do not depend on the input),
    ||(c x + b f(x)) - (c x' + b f(x'))|| <= |c| ||x - x'|| + |b| ||f(x) - f(x')||
    <= (|c| + |b| Lip(f)) ||x - x'|| by the triangle inequality
    (:func:`mixed_residual_lipschitz`); the projection is 1-Lipschitz and the sublayers compose,
    so Lip <= (|1 - b_a| + |b_a| L_att(n)) (|1 - b_f| + |b_f| ||W_1|| ||W_2||). With 0 < b < 1
    and 1-Lipschitz sublayers each factor is exactly 1, as for the averaged residual.
    """

    def __init__(self, dim: int, heads: int, radius: float, attention: str = "olsa",
                 max_len: int = 32, alpha1: float = 4.0, group_size: int = 2, iters: int = 1,
                 residual: str = "averaged", residual_init: float = 0.5,
                 train_alpha1: bool = True):
        super().__init__()
        if attention not in ATTENTIONS:
            raise ValueError(f"attention {attention!r}: choose from {', '.join(ATTENTIONS)}")
        if residual not in RESIDUALS:
            raise ValueError(f"residual {residual!r}: choose from {', '.join(RESIDUALS)}")
        if not 0 < residual_init < 1:
            raise ValueError(f"residual_init must be in (0, 1) (b = sigmoid(theta)), got "
                             f"{residual_init!r}")
        self.residual = residual
        self.project = LayerProject(radius)
        self.attn = (OLSAAttention(dim, heads, radius, alpha1, iters, train_alpha1)
                     if attention == "olsa" else L2Attention(dim, heads, max_len, iters))
        self.ff1 = OrthogonalLinear(dim, bias=True, iters=iters)
        self.ff2 = OrthogonalLinear(dim, bias=True, iters=iters)
        self.act = GroupSort(group_size)
        if residual == "gated":
            logit = math.log(residual_init / (1.0 - residual_init))  # sigmoid(logit) = init
            self.theta_att = nn.Parameter(torch.tensor(logit))
            self.theta_ff = nn.Parameter(torch.tensor(logit))

    def residual_weights(self) -> tuple[tuple[Tensor | float, Tensor | float],
                                        tuple[Tensor | float, Tensor | float]]:
        """((1 - b_a, b_a), (1 - b_f, b_f)): the coefficients the forward pass applies."""
        if self.residual == "averaged":
            return (0.5, 0.5), (0.5, 0.5)
        b_att, b_ff = torch.sigmoid(self.theta_att), torch.sigmoid(self.theta_ff)
        return (1 - b_att, b_att), (1 - b_ff, b_ff)

    def forward(self, x: Tensor, mask: Tensor, weights: dict[str, Tensor] | None = None
                ) -> Tensor:
        """``weights``: the orthogonal maps' matrices computed already, by module name in the
        layer ("attn.q", "ff1", ...; the training forward's batch), or None."""
        (keep_a, mix_a), (keep_f, mix_f) = self.residual_weights()
        attn = (None if weights is None else
                {k.removeprefix("attn."): w for k, w in weights.items() if k.startswith("attn.")})
        x = self.project(x)
        x = keep_a * x + mix_a * self.attn(x, mask, attn)
        hidden = self.act(self.ff1(x, _given(weights, "ff1")))
        return keep_f * x + mix_f * self.ff2(hidden, _given(weights, "ff2"))

    @torch.no_grad()
    def lipschitz(self, n: Tensor) -> Tensor:
        """(B,) float64: 1 (projection) x (|1 - b_a| + |b_a| L_att) x (|1 - b_f| + |b_f|
        ||W_1|| ||W_2||), with the forward pass's coefficients (class docstring)."""
        ff = spectral_norm_exact(self.ff1.weight_effective()) * spectral_norm_exact(
            self.ff2.weight_effective())
        (keep_a, mix_a), (keep_f, mix_f) = (tuple(float(c) for c in pair)  # exact in float64
                                            for pair in self.residual_weights())
        return (mixed_residual_lipschitz(keep_a, mix_a, self.attn.lipschitz(n))
                * mixed_residual_lipschitz(keep_f, mix_f, ff))

    def extra_repr(self) -> str:
        return f"residual={self.residual}"


def sqrt_mean_pool(x: Tensor, mask: Tensor) -> Tensor:
    """(B, dim): (1/sqrt(n)) sum of the n real tokens (OLSA Theorem 4.2: 1-Lipschitz)."""
    m = mask.to(x.dtype)[..., None]
    return (x * m).sum(1) / m.sum(1).sqrt()


def normalize_tokens(x: Tensor, norm: float) -> Tensor:
    """Every token (last dimension) rescaled to l2 norm ``norm``."""
    return norm * x / x.norm(dim=-1, keepdim=True).clamp_min(1e-12)
