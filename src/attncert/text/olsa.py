"""OLSA: 1-Lipschitz self-attention for text (OLSA paper, MATH.md sections 4 and 7).

Building blocks, each 1-Lipschitz in ||.||_F of the token matrix (or with a stated bound):

* :func:`newton_orthogonalize` / :class:`OrthogonalLinear`: W = (V V^T)^{-1/2} V by
  Newton-Schulz iteration (MATH.md section 7).
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
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.bounds import kim_l2_attention_lipschitz
from attncert.layers import LayerProject, spectral_norm_exact
from attncert.train import logit_margin

ATTENTIONS = ("olsa", "l2")
#: averaged: OLSA's 0.5 x + 0.5 f(x); gated: (1 - b) x + b f(x), b = sigmoid(theta) trained
RESIDUALS = ("averaged", "gated")


# ---------------------------------------------------------------------------- orthogonality
def newton_orthogonalize(v: Tensor, iters: int) -> Tensor:
    """(..., d, d) -> the orthogonal polar factor W = (V V^T)^{-1/2} V by Newton-Schulz.

    X_0 = V / sqrt(s), s the largest absolute row sum of V V^T (>= ||V||_2^2), so every
    singular value of X_0 is in (0, 1]; X_{k+1} = X_k (3I - X_k^T X_k) / 2 maps each singular
    value by f(x) = (3x - x^3) / 2, which keeps (0, 1] inside (0, 1] and converges to 1
    (quadratically near 1) with unchanged singular vectors: the polar factor that the coupled
    iteration of MATH.md section 7 (Y_0 = V V^T, Z_0 = I) reaches as Z -> (V V^T)^{-1/2}.
    This uncoupled form corrects its own rounding (the coupled one stalls near 4e-4 in
    float32 on an ill-conditioned V), and an unconverged result still has ||W||_2 <= 1 (up to
    rounding). Differentiable. Certificates use the exact spectral norm of the result.
    """
    a = v @ v.transpose(-1, -2)
    x = v / a.abs().sum(-1).amax(-1)[..., None, None].sqrt()
    for _ in range(iters):
        x = 1.5 * x - 0.5 * x @ (x.transpose(-1, -2) @ x)
    return x


class OrthogonalLinear(nn.Module):
    """y = W x (+ b), W = newton_orthogonalize(V, iters) (dim x dim), V the free parameter.

    Training keeps V near-orthogonal with :meth:`reproject_` after every optimiser step (a
    polar retraction), so one differentiable Newton-Schulz step in the forward pass suffices
    (measured: ||W W^T - I||_max ~ 4e-7 in float32 for dim 256).
    """

    def __init__(self, dim: int, bias: bool = False, iters: int = 1):
        super().__init__()
        self.iters = iters
        self.v = nn.Parameter(torch.empty(dim, dim))
        nn.init.orthogonal_(self.v)
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def weight_effective(self) -> Tensor:
        """(dim, dim): the (nearly) orthogonal matrix applied."""
        return newton_orthogonalize(self.v, self.iters)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_effective(), self.bias)

    @torch.no_grad()
    def reproject_(self, iters: int = 5) -> None:
        """V <- its polar factor (W unchanged): keeps V near-orthogonal between optimiser steps,
        so the few forward iterations converge (a step moves the singular values little)."""
        self.v.copy_(newton_orthogonalize(self.v, iters))


def reproject_orthogonal_(model: nn.Module) -> None:
    """:meth:`OrthogonalLinear.reproject_` on every orthogonal map of ``model`` (after a step)."""
    for m in model.modules():
        if isinstance(m, OrthogonalLinear):
            m.reproject_()


class SpectralNormLinear(nn.Module):
    """y = W x / ||W||_2 (no bias): a 1-Lipschitz linear head, normalised by its exact
    (differentiable) spectral norm, so the certificate regulariser cannot grow the radius
    M / (sqrt(2) Lip) by shrinking the head while the CE loss stays bounded."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.orthogonal_(self.weight)

    def weight_effective(self) -> Tensor:
        """(out, in): W / ||W||_2."""
        return self.weight / torch.linalg.matrix_norm(self.weight, 2)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight_effective())


class GroupSort(nn.Module):
    """Sort every consecutive group of ``group_size`` features in decreasing order.

    A permutation of its input in every group, hence norm preserving; 1-Lipschitz in l2
    (sorting is 1-Lipschitz; Anil et al. 2019). group_size 2 is MaxMin.
    """

    def __init__(self, group_size: int = 2):
        super().__init__()
        self.group_size = group_size

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] % self.group_size:
            raise ValueError(f"{x.shape[-1]} features do not split into groups of "
                             f"{self.group_size}")
        g = x.unflatten(-1, (-1, self.group_size))
        return g.sort(dim=-1, descending=True).values.flatten(-2)

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}"


# ---------------------------------------------------------------------------- pure bounds
def _kappa(n: Tensor, d: Tensor) -> Tensor:
    """Max column sum of a row-stochastic n x n matrix whose row scores spread by <= d."""
    return n / (1.0 + (n - 1.0) * torch.exp(-d))


def olsa_alpha2(alpha1: Tensor | float, radius: float, n: Tensor | int) -> Tensor:
    """alpha2 = sqrt(kappa) + R sqrt(n) / (sqrt(2) alpha1) (0 second term at n = 1): with unit
    weight norms this makes :func:`olsa_attention_lipschitz` exactly 1 (module docstring)."""
    return olsa_attention_lipschitz(alpha1, 1.0, radius, n)


def olsa_attention_lipschitz(alpha1: Tensor | float, alpha2: Tensor | float, radius: float,
                             n: Tensor | int, s_q: float = 1.0, s_k: float = 1.0,
                             s_v: float = 1.0) -> Tensor:
    """Lipschitz bound (in ||.||_F) of OLSA attention on n tokens of norm <= R (float64).

    (s_v / alpha2) [ sqrt(kappa) + R sqrt(n) (s_q + s_k) / (2 sqrt 2 alpha1) ],
    kappa = n / (1 + (n - 1) exp(-s_k R / alpha1)); the second term is 0 for n = 1. s_q, s_k,
    s_v bound the spectral norms of W^Q, W^K, W^V (1 when orthogonal). Derivation: module
    docstring. Batched over n (and alpha1, alpha2) by broadcasting.
    """
    a1 = torch.as_tensor(alpha1, dtype=torch.float64)
    n = torch.as_tensor(n, dtype=torch.float64)
    kappa = _kappa(n, s_k * radius / a1)
    score = torch.where(n > 1, radius * n.sqrt() * (s_q + s_k) / (2.0 * math.sqrt(2.0) * a1),
                        torch.zeros_like(n))
    return s_v * (kappa.sqrt() + score) / torch.as_tensor(alpha2, dtype=torch.float64)


def certified_radius(logits: Tensor, y: Tensor, lipschitz: Tensor | float) -> Tensor:
    """(B,): r = relu(M) / (sqrt(2) Lip), M = f_y - max_{j != y} f_j (MATH.md section 6).

    0 for a misclassified point, so the mean is OLSA's average certified radius.
    """
    return F.relu(logit_margin(logits.double(), y)) / (math.sqrt(2.0) * torch.as_tensor(
        lipschitz, dtype=torch.float64, device=logits.device))


def certificate_regulariser(logits: Tensor, y: Tensor, lipschitz: Tensor | float,
                            gamma: float) -> Tensor:
    """-gamma mean(relu(M / (sqrt(2) Lip))): OLSA's -gamma relu(M / sqrt 2) (MATH.md section 7)
    for a network with Lipschitz constant Lip (differentiable in Lip), i.e. the certified radius."""
    margin = logit_margin(logits, y)
    return -gamma * (F.relu(margin) / (math.sqrt(2.0) * lipschitz)).mean()


def gamma_ramp(step: int, total_steps: int, gamma: float, ramp: float = 1.0) -> float:
    """Linear ramp of the regulariser weight: 0 at step 0, ``gamma`` after ``ramp`` x total."""
    if ramp <= 0:
        return gamma
    return gamma * min(1.0, step / max(1.0, ramp * total_steps))


# ---------------------------------------------------------------------------- attention
def _lengths(mask: Tensor) -> Tensor:
    """(B,) number of real tokens."""
    return mask.sum(-1)


def _split_heads(t: Tensor, heads: int) -> Tensor:
    """(B, n, h*d_h) -> (B, h, n, d_h)."""
    return t.unflatten(-1, (heads, -1)).transpose(1, 2)


def _masked_softmax(scores: Tensor, mask: Tensor) -> Tensor:
    """Softmax over the keys of (B, h, n, n) scores, padded keys excluded."""
    return torch.softmax(scores.masked_fill(~mask[:, None, None, :], -math.inf), dim=-1)


class OLSAAttention(nn.Module):
    """OLSA additive multi-head attention (MATH.md section 7) on (B, n, dim) with a mask.

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

    def compute_probs(self, x: Tensor, mask: Tensor) -> Tensor:
        """(B, h, n, n): softmax_j W^S_h MaxMin((W^Q x_i + W^K x_j) / 2) / alpha1.

        For a pair (a, b): max = (a + b)/2 + |a - b|/2 and min = (a + b)/2 - |a - b|/2, so
        w . MaxMin(z) = sum_p (w_p1 + w_p2)(a_p + b_p)/2 + (w_p1 - w_p2)|a_p - b_p|/2. With
        z = (q_i + k_j)/2 the first sum is f(q_i) + g(k_j), and f(q_i), the same for every key,
        cancels in the softmax: only g(k_j) + sum_p c_p |u_ip + u'_jp| is formed, a
        (B, h, n, n, d_h/2) tensor instead of sorting a (B, h, n, n, d_h) one.
        """
        q, k = _split_heads(self.q(x), self.heads), _split_heads(self.k(x), self.heads)
        w = self.score_vector()
        w1, w2 = w[:, 0::2], w[:, 1::2]
        g = torch.einsum("bhjp,hp->bhj", k[..., 0::2] + k[..., 1::2], w1 + w2) / 4
        u = (q[..., 0::2] - q[..., 1::2]) / 4  # (a - b)/2 = u_i + u'_j
        u_k = (k[..., 0::2] - k[..., 1::2]) / 4
        gap = (u.unsqueeze(-2) + u_k.unsqueeze(-3)).abs()  # (B, h, n, n, d_h/2)
        scores = g.unsqueeze(-2) + torch.einsum("bhijp,hp->bhij", gap, w1 - w2)
        return _masked_softmax(scores / self.alpha1, mask)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        p = self.compute_probs(x, mask)
        alpha2 = olsa_alpha2(self.alpha1, self.radius, _lengths(mask)).to(x.dtype)
        y = (p @ _split_heads(self.v(x), self.heads)).transpose(1, 2).flatten(2)
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
                                     for n in range(1, max_len + 1)], dtype=torch.float64)

    def _probs(self, y: Tensor, mask: Tensor) -> Tensor:
        # -||y_i - y_j||^2 = 2 y_i.y_j - ||y_j||^2 - ||y_i||^2; the last term cancels in softmax
        scores = 2 * y @ y.transpose(-1, -2) - y.pow(2).sum(-1).unsqueeze(-2)
        return _masked_softmax(scores / math.sqrt(self.d_head), mask)

    def compute_probs(self, x: Tensor, mask: Tensor) -> Tensor:
        """(B, h, n, n): softmax_j -||x_i W^{Q,h} - x_j W^{Q,h}||^2 / sqrt(d_h), padding masked."""
        return self._probs(_split_heads(x @ self.q.weight_effective().T, self.heads), mask)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        wq = self.q.weight_effective()
        y = _split_heads(x @ wq.T, self.heads)  # (B, h, n, d_h): X W^{Q,h}
        p = self._probs(y, mask)
        # X A_h W^{V,h} = (X W^{Q,h}) (W^{Q,h}^T W^{V,h}) / sqrt(d_h); row blocks of (out, in)
        wq_h = wq.unflatten(0, (self.heads, self.d_head))  # (h, d_h, d) = W^{Q,h}^T
        wv_h = self.v.weight_effective().unflatten(0, (self.heads, self.d_head))
        values = y @ (wq_h @ wv_h.transpose(-1, -2)) / math.sqrt(self.d_head)
        out = self.o((p @ values).transpose(1, 2).flatten(2))
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
    (triangle inequality); OLSA's averaged residual is keep = mix = 0.5 (MATH.md section 4)."""
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

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        (keep_a, mix_a), (keep_f, mix_f) = self.residual_weights()
        x = self.project(x)
        x = keep_a * x + mix_a * self.attn(x, mask)
        return keep_f * x + mix_f * self.ff2(self.act(self.ff1(x)))

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
