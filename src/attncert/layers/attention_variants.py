"""Lipschitz-motivated attention baselines with the interface of ``MultiHeadAttention``.

Every attention module here maps (B, n, dim) -> (B, n, dim), is built as ``Cls(dim, heads,
...)``, exposes its projections as ``q``, ``k``, ``v``, ``o`` (``nn.Linear(dim, dim)``,
head l = output features l*d_h:(l+1)*d_h, docs/math.md section 1) and its per-head attention
matrix as ``compute_probs(x) -> (B, h, n, n)``; the transformer block adds the residual.

* :class:`L2MultiHeadAttention`: Kim et al. (2021), "The Lipschitz constant of
  self-attention", L2-MHA with W^K = W^Q (docs/math.md section 4); also the attention CertViT
  puts into pre-trained ViTs (:meth:`L2MultiHeadAttention.from_dot_product`).
* :class:`LNFormerAttention`: dot-product attention with the LipschitzNorm of Dasoulas,
  Scaman & Virmaux (ICML 2021), ported from graph attention to token attention.
* LipsFormer (Qi et al., ICLR 2023): :class:`ScaledCosineAttention`, :class:`CenterNorm`,
  :class:`ResidualScale` (the weighted residual shortcut) and :func:`spectral_init_`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from ..pipeline import rng
from .attention import MultiHeadAttention, linear_weight, probs_replaced
from .embed import SVD_PAD

VALUE_MAPS = ("kim", "plain")


class _HeadedAttention(nn.Module):
    """Shared skeleton: Att(X) = concat_l(P_l(X) V_l) W^O, with P_l from :meth:`compute_probs`.

    Projections are ``nn.Linear(dim, dim)``; ``qk_bias``/``vo_bias``: biases of W^Q, W^K /
    W^V, W^O; ``keys=False`` leaves out W^K (a subclass ties it to W^Q).
    """

    def __init__(self, dim: int, heads: int, qk_bias: bool, vo_bias: bool, keys: bool = True):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} is not divisible by heads {heads}")
        self.dim, self.heads, self.d_head = dim, heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=qk_bias)
        if keys:
            self.k = nn.Linear(dim, dim, bias=qk_bias)
        self.v, self.o = nn.Linear(dim, dim, bias=vo_bias), nn.Linear(dim, dim, bias=vo_bias)

    def _split(self, t: Tensor) -> Tensor:
        """(B, n, h*d_h) -> (B, h, n, d_h): head l is features l*d_h:(l+1)*d_h."""
        b, n, _ = t.shape
        return t.reshape(b, n, self.heads, self.d_head).transpose(1, 2)

    def _merge(self, heads: Tensor) -> Tensor:
        """(B, h, n, d_h) -> (B, n, dim) concatenated heads, then W^O."""
        b, _, n, _ = heads.shape
        return self.o(heads.transpose(1, 2).reshape(b, n, self.dim))

    def compute_probs(self, x: Tensor) -> Tensor:
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        return self._merge(self.compute_probs(x) @ self._split(self.v(x)))

    def extra_repr(self) -> str:
        return f"dim={self.dim}, heads={self.heads}"


def l2_attention_domain_constant(n: int, radius: Tensor, d_head: int) -> Tensor:
    """D(n, rho) / sqrt(d_h), rho = radius / d_h^(1/4): the Lipschitz constant of Kim's
    single-head L2 attention h(Y) = P(Y) Y / sqrt(d_h) (W^Q = W^V = I) on n tokens that all lie
    in one ball of the given radius (:meth:`L2MultiHeadAttention.lipschitz_bound` has the
    proof). ``radius``: a float64 tensor of radii, one constant each."""
    rho2 = radius.double().pow(2) / math.sqrt(d_head)
    p = 1.0 / (1.0 + (n - 1) * torch.exp(-4.0 * rho2))
    return ((n * p).sqrt() * (1.0 + 8.0 * rho2) + 2.0 * rho2) / math.sqrt(d_head)


class L2MultiHeadAttention(_HeadedAttention):
    """Kim et al. (2021) L2 multi-head self-attention, keys tied to queries (W^K = W^Q).

    Per head l, with q_i = x_i W^{Q,l} (d_h features):
        P^l_ij = softmax_j( -||q_i - q_j||^2 / sqrt(d_h) ),
    and the head's output is
        value="kim":   P^l X A_l W^{V,l},  A_l = W^{Q,l} (W^{Q,l})^T / sqrt(d_h)   (Kim et al.)
        value="plain": P^l X W^{V,l}                                 (CertViT's public code)
    Heads are concatenated and multiplied by W^O. Only ``value="kim"`` is globally Lipschitz
    (Kim et al. Theorem 3.2, :meth:`lipschitz_bound`): with plain values and d_h < d, tokens
    far apart along null(W^Q) keep their scores while the Jacobian grows with their distance
    (tests/test_global_bounds.py::test_kim_formula_limits).

    ``k`` is ``q`` (tied keys), so code that walks q/k/v maps sees W^K = W^Q. W^Q has no bias:
    a query bias cancels in q_i - q_j. ``bias`` applies to W^V and W^O (constant shifts of the
    output, which do not change the Lipschitz constant).
    """

    def __init__(self, dim: int, heads: int, value: str = "kim", bias: bool = False):
        if value not in VALUE_MAPS:
            raise ValueError(f"value must be one of {VALUE_MAPS}, got {value!r}")
        super().__init__(dim, heads, qk_bias=False, vo_bias=bias, keys=False)
        self.value = value

    @property
    def k(self) -> nn.Linear:
        """The key map: tied to the query map (W^K = W^Q)."""
        return self.q

    @staticmethod
    def _probs(q: Tensor, d_head: int) -> Tensor:
        # -||q_i - q_j||^2 = 2 q_i.q_j - ||q_j||^2 - ||q_i||^2; the last term is constant
        # along the softmax row, so it is dropped (no cancellation of large squares)
        logits = 2.0 * q @ q.transpose(-1, -2) - q.pow(2).sum(-1).unsqueeze(-2)
        return torch.softmax(logits / math.sqrt(d_head), dim=-1)

    def compute_probs(self, x: Tensor) -> Tensor:
        """(B, h, n, n): P^l_ij = softmax_j(-||x_i W^{Q,l} - x_j W^{Q,l}||^2 / sqrt(d_h))."""
        return self._probs(self._split(self.q(x)), self.d_head)

    def forward(self, x: Tensor) -> Tensor:
        q = self._split(self.q(x))  # (B, h, n, d_h): X W^{Q,l}
        if self.value == "kim":
            h, dh = self.heads, self.d_head
            wq, wv = self.q.weight.view(h, dh, self.dim), self.v.weight.view(h, dh, self.dim)
            # X A_l W^{V,l} = (X W^{Q,l}) (W^{Q,l})^T W^{V,l} / sqrt(d_h), a d_h x d_h product
            values = q @ (wq @ wv.transpose(1, 2)) / math.sqrt(dh)
            if self.v.bias is not None:
                values = values + self.v.bias.view(h, 1, dh)
        else:
            values = self._split(self.v(x))
        if probs_replaced(self, L2MultiHeadAttention):
            probs = self.compute_probs(x)  # replaced (diagnostics.override_attention) or redefined
        else:  # compute_probs(x) from the queries already projected
            probs = self._probs(q, self.d_head)
        return self._merge(probs @ values)

    def lipschitz_bound(self, n: int, radius: float | None = None) -> float:
        """Global L2 (Frobenius) Lipschitz bound of this layer (no residual) on n tokens:

            L = min( ||W^O|| sqrt(sum_l (k_l c_l)^2),  sum_l k_l c_l ||W^{O,l}|| ),
            c_l = ||W^{Q,l}|| ||(W^{Q,l})^T W^{V,l}||,  K_n = sqrt(n / d_h) (4 W0((n-1)/e) + 1),
            k_l = K_n, or min(K_n, D(n, rho_l) / sqrt(d_h)) when every input token lies in one
            ball of radius ``radius`` (rho_l = radius ||W^{Q,l}|| / d_h^(1/4)),
            D(n, rho) = sqrt(n p) (1 + 8 rho^2) + 2 rho^2,  p = 1 / (1 + (n-1) exp(-4 rho^2)),

        W^{O,l} the d_h rows of W^O (x W convention) that head l's output meets, W0 Lambert's W.
        With ``radius`` the bound holds on that domain only: on the image of a norm whose
        outputs are confined to such a ball (ProjectNorm: radius R max|gamma|, around beta),
        so it bounds attention o norm with the norm's own constant.

        Proof. Let h(Y) = P(Y) Y / sqrt(d_h) on n tokens Y (n x d_h), P(Y)_ij =
        softmax_j(-||y_i - y_j||^2 / sqrt(d_h)): Kim et al.'s single-head L2 attention on
        d_h-dimensional tokens with W^Q = W^V = I (and W^O = I), whose constant their Theorem
        3.2 bounds by K_n (docs/math.md section 4; at ||W^Q|| = 1 the printed form is the theorem,
        tests/test_global_bounds.py). Head l of this layer is
            P^l X A_l W^{V,l} = P(X W^{Q,l}) (X W^{Q,l}) (W^{Q,l})^T W^{V,l} / sqrt(d_h)
                              = h(X W^{Q,l}) M_l,   M_l = (W^{Q,l})^T W^{V,l}  (d_h x d_h),
        because P^l depends on X only through X W^{Q,l}. X -> X W^{Q,l} is ||W^{Q,l}||-Lipschitz
        in ||.||_F and right-multiplication by M_l is ||M_l||-Lipschitz, so head l is
        c_l-Lipschitz with K_n c_l. The layer is concat_l(head_l) W^O (+ a constant bias): the
        concatenation's perturbation has ||.||_F^2 = sum_l ||delta_l||_F^2, giving the first
        term; writing it as sum_l head_l W^{O,l} and the triangle inequality gives the second.

        Consequences. c_l <= ||W^{Q,l}||^2 ||W^{V,l}||, so this is never above the printed bound
        evaluated at W^{Q,l} max(1, ||W^{Q,l}||) (the degree correction: a head's constant is
        homogeneous of degree 2 in W^{Q,l}, f(X; c W^Q) = c f(cX; W^Q)), and below it whenever
        ||W^{Q,l}|| < 1 (the max(1, .) is not needed: the factorisation holds for every scale)
        or W^{Q,l} and W^{V,l} are not aligned.

        The domain constant (tokens in a ball). With Z = Y / d_h^(1/4), h(Y) = g(Z) / d_h^(1/4)
        for g(Z) = P Z, P_ij = softmax_j(-||z_i - z_j||^2), so Lip(h) = Lip(g) / sqrt(d_h); the
        rows z_i lie in a ball of radius rho (translate it to 0: g(Z + 1 c^T) = g(Z) + 1 c^T).
        For a perturbation E (rows e_j), with zbar_i = sum_j P_ij z_j and
        ds_ij = -2 (z_i - z_j)^T (e_i - e_j), dP_ij = P_ij (ds_ij - sum_l P_il ds_il), so
            dg_i = sum_j P_ij e_j + sum_j P_ij (z_j - zbar_i) ds_ij
                 = (P E)_i + 2 C_i e_i + 2 sum_j P_ij (z_j - zbar_i)(z_i - z_j)^T e_j,
        C_i = sum_j P_ij (z_j - zbar_i)(z_j - zbar_i)^T (the terms in z_i cancel because
        sum_j P_ij (z_j - zbar_i) = 0). (i) ||P||_2^2 <= max column sum x max row sum, and
        P_ij <= 1 / (1 + (n-1) exp(-4 rho^2)) = p (the own term of the denominator is 1, the
        others >= exp(-(2 rho)^2)), so ||P E||_F <= sqrt(n p) ||E||_F. (ii) C_i is the
        covariance of a distribution on the ball: ||C_i|| <= rho^2, a block-diagonal map of
        norm <= 2 rho^2. (iii) The blocks B_ij = 2 P_ij (z_j - zbar_i)(z_i - z_j)^T have
        ||B_ij|| <= 8 rho^2 P_ij (zbar_i is in the ball); a block operator's norm is at most
        that of the matrix of block norms, and for nonnegative matrices entrywise domination
        bounds the spectral norm, so this term is <= 8 rho^2 sqrt(n p). The Jacobian of g is
        bounded by D(n, rho) on the (convex) domain, hence so is Lip(g) there. X -> X W^{Q,l}
        maps a ball of radius r into one of radius r ||W^{Q,l}||, which gives rho_l.

        Spectral norms are exact float64 SVDs, padded by SVD_PAD per factor. Raises for
        ``value="plain"`` (no global Lipschitz constant) and for a negative ``radius``.
        """
        from attncert.bounds import kim_l2_attention_lipschitz

        if self.value != "kim":
            raise ValueError("L2 attention with plain values (P X W^V) has no global Lipschitz "
                             "constant; use value='kim'")
        h, dh, d = self.heads, self.d_head, self.dim
        wq = self.q.weight.detach().double().view(h, dh, d)  # (h, d_h, d): (W^{Q,l})^T
        wv = self.v.weight.detach().double().view(h, dh, d)
        wo = self.o.weight.detach().double()  # (d, h d_h): W^O^T
        eye = torch.eye(dh, dtype=torch.float64, device=wq.device)[None]
        k_n = kim_l2_attention_lipschitz(eye, eye, eye[0], n)  # K_n: W^Q = W^V = W^O = I
        q = torch.linalg.matrix_norm(wq, 2)
        m = torch.linalg.matrix_norm(wq @ wv.transpose(1, 2), 2)  # ||(W^{Q,l})^T W^{V,l}||
        c = q * m * k_n
        if radius is not None:
            if not radius >= 0:
                raise ValueError(f"radius must be >= 0, got {radius!r}")
            c = q * m * torch.minimum(torch.full_like(q, k_n),
                                      l2_attention_domain_constant(n, radius * q, dh))
        o_heads = torch.linalg.matrix_norm(wo.view(d, h, dh).transpose(0, 1), 2)
        concat = float(torch.linalg.matrix_norm(wo, 2)) * float(c.pow(2).sum().sqrt())
        split = float((c * o_heads).sum())
        return min(concat, split) * (1.0 + SVD_PAD) ** 3

    def lipschitz_bound_printed(self, n: int) -> float:
        """Kim et al. Theorem 3.2 as printed, with the degree correction (each head evaluated
        at W^{Q,l} max(1, ||W^{Q,l}||)): the form :meth:`lipschitz_bound` tightens, kept for
        comparison."""
        from attncert.bounds import kim_l2_attention_lipschitz

        h, dh, d = self.heads, self.d_head, self.dim
        wq, wv, wo = (t.detach().double() for t in (self.q.weight, self.v.weight, self.o.weight))
        wq = wq.view(h, dh, d).transpose(1, 2)
        wv = wv.view(h, dh, d).transpose(1, 2)
        m = torch.linalg.matrix_norm(wq, 2).clamp_min(1.0)
        return kim_l2_attention_lipschitz(wq * m[:, None, None], wv, wo.T, n) * (1.0 + SVD_PAD) ** 4

    @classmethod
    def from_dot_product(cls, mha: MultiHeadAttention, value: str = "kim") -> L2MultiHeadAttention:
        """L2 attention initialised from a dot-product layer (CertViT's adaptation step).

        W^Q := the dot-product layer's query map, and W^K is tied to it (the key map is
        discarded: L2 attention needs W^K = W^Q to be Lipschitz); W^V, W^O and their biases
        are copied; a query bias is dropped (it cancels in ||q_i - q_j||). With
        ``value="kim"`` the copied W^V acts on X A_l, so the layer's function changes more
        than with ``value="plain"``; fine-tuning follows in either case. Same device and
        dtype as ``mha``; the effective (constrained) matrices are copied when ``mha`` is a
        Lipschitz layer.
        """
        ref = linear_weight(mha.q)
        out = cls(mha.dim, mha.heads, value=value, bias=mha.has_bias)
        out = out.to(device=ref.device, dtype=ref.dtype)
        with torch.no_grad():
            out.q.weight.copy_(ref)
            for dst, src in ((out.v, mha.v), (out.o, mha.o)):
                dst.weight.copy_(linear_weight(src))
                if dst.bias is not None:
                    if src.bias is None:
                        dst.bias.zero_()
                    else:
                        dst.bias.copy_(src.bias)
        return out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, value={self.value}"


class LNFormerAttention(_HeadedAttention):
    """Dot-product attention with LipschitzNorm (Dasoulas, Scaman & Virmaux, ICML 2021).

    Per head l, with Q = X W^{Q,l}, K = X W^{K,l}, V = X W^{V,l} (n x d_h, one sample):
        P^l = softmax_rows( Q K^T / max(u v, u w, v w) ),
        u = ||Q||_F,  v = ||K||_(inf,2) = max_j ||k_j||,  w = ||V||_(inf,2) = max_j ||v_j||,
    output concat_l(P^l V) W^O. This is the paper's LipschitzNorm for scaled dot-product
    attention with every token attending to every token (the graph neighbourhood of a node
    is the whole sequence); the normaliser replaces the 1/sqrt(d_h) temperature. (The
    authors' graph-transformer code keeps 1/sqrt(d_h) and takes ||Q||_F over edges; the
    paper's definition is used here.) ``eps`` keeps the normaliser away from 0.
    """

    def __init__(self, dim: int, heads: int, bias: bool = False, eps: float = 1e-12):
        super().__init__(dim, heads, qk_bias=bias, vo_bias=bias)
        self.eps = float(eps)

    def _probs(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        u = q.flatten(-2).norm(dim=-1)  # (B, h): ||Q||_F
        kv = k.norm(dim=-1).amax(dim=-1)  # ||K||_(inf,2)
        vw = v.norm(dim=-1).amax(dim=-1)  # ||V||_(inf,2)
        scale = torch.stack([u * kv, u * vw, kv * vw]).amax(dim=0).clamp_min(self.eps)
        return torch.softmax(q @ k.transpose(-1, -2) / scale[..., None, None], dim=-1)

    def compute_probs(self, x: Tensor) -> Tensor:
        """(B, h, n, n): softmax(Q K^T / max(u v, u w, v w)) per head."""
        q, k, v = (self._split(m(x)) for m in (self.q, self.k, self.v))
        return self._probs(q, k, v)

    def forward(self, x: Tensor) -> Tensor:
        # the matrix through compute_probs (replaceable by an ablation): the same numbers
        return self._merge(self.compute_probs(x) @ self._split(self.v(x)))


class ScaledCosineAttention(_HeadedAttention):
    """LipsFormer's scaled cosine similarity attention (Qi et al., ICLR 2023).

    Per head l, with q_i = x_i W^{Q,l}, k_j = x_j W^{K,l}:
        P^l_ij = softmax_j( tau * <q_i / s(q_i), k_j / s(k_j)> ),  s(z) = sqrt(||z||^2 + eps),
    output concat_l(P^l X W^{V,l}) W^O. With eps = 0 the score is tau cos(q_i, k_j); eps > 0
    (this implementation's smoothing; the authors' code divides by max(||z||, 1e-12)) keeps
    z -> z / s(z) Lipschitz, constant 1/sqrt(eps) (at z = 0). tau is the fixed temperature
    (10 in the authors' code), or a learnable scalar with ``learn_tau=True``.
    """

    def __init__(self, dim: int, heads: int, tau: float = 10.0, learn_tau: bool = False,
                 eps: float = 1e-6, bias: bool = False):
        super().__init__(dim, heads, qk_bias=bias, vo_bias=bias)
        if not tau > 0:
            raise ValueError(f"tau must be > 0, got {tau!r}")
        t = torch.tensor(float(tau))
        if learn_tau:
            self.tau = nn.Parameter(t)
        else:
            self.register_buffer("tau", t)
        self.eps = float(eps)

    def _unit(self, z: Tensor) -> Tensor:
        return z * torch.rsqrt(z.pow(2).sum(-1, keepdim=True) + self.eps)

    def compute_probs(self, x: Tensor) -> Tensor:
        """(B, h, n, n): softmax(tau * cos_eps(q_i, k_j)) per head."""
        q, k = self._unit(self._split(self.q(x))), self._unit(self._split(self.k(x)))
        return torch.softmax(self.tau * (q @ k.transpose(-1, -2)), dim=-1)

    def extra_repr(self) -> str:
        learn = isinstance(self.tau, nn.Parameter)
        return f"{super().extra_repr()}, tau={float(self.tau):g}, learn_tau={learn}"


class CenterNorm(nn.Module):
    """LipsFormer's CenterNorm, per token: y = gamma * (D / (D-1)) (x - mean(x)) + beta.

    The LayerNorm replacement of Qi et al. (2023): centring only, no division by the
    standard deviation, so it is Lipschitz with constant (D / (D-1)) max|gamma| (the
    centring projection I - 1 1^T / D has norm 1). ``affine=False``: gamma = 1, beta = 0.
    """

    def __init__(self, dim: int, affine: bool = True):
        super().__init__()
        if dim < 2:
            raise ValueError(f"CenterNorm needs dim >= 2, got {dim}")
        self.dim, self.scale = dim, dim / (dim - 1)
        self.weight = nn.Parameter(torch.ones(dim)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim)) if affine else None

    def compute_lipschitz(self) -> float:
        """(D / (D-1)) max|gamma|, per token and hence in ||.||_F on the token matrix."""
        gain = 1.0 if self.weight is None else float(self.weight.detach().abs().max())
        return self.scale * gain

    def forward(self, x: Tensor) -> Tensor:
        y = self.scale * (x - x.mean(dim=-1, keepdim=True))
        return y if self.weight is None else y * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"dim={self.dim}, affine={self.weight is not None}"


class ResidualScale(nn.Module):
    """LipsFormer's weighted residual shortcut: the branch is scaled, x + alpha * f(x).

    Returns alpha * y per channel (``dim`` values, initialised to ``alpha``; LipsFormer's
    code uses 1 / depth), learnable unless ``learnable=False``. The block adds x. The
    residual's Lipschitz constant is then 1 + max|alpha| Lip(f).
    """

    def __init__(self, dim: int, alpha: float = 0.1, learnable: bool = True):
        super().__init__()
        a = torch.full((dim,), float(alpha))
        if learnable:
            self.alpha = nn.Parameter(a)
        else:
            self.register_buffer("alpha", a)

    def compute_lipschitz(self) -> float:
        """max|alpha|: the constant of y -> alpha * y."""
        return float(self.alpha.detach().abs().max())

    def forward(self, y: Tensor) -> Tensor:
        return self.alpha * y


@torch.no_grad()
def spectral_init_(weight: Tensor, gain: float = 1.0,
                   generator: torch.Generator | None = None) -> Tensor:
    """LipsFormer-style spectral initialisation, in place: ||weight||_2 = gain.

    The variant implemented: a Xavier-normal draw W, then W <- gain W / sigma_max(W) with the
    exact largest singular value (Qi et al. 2023 normalise the initial weights by their
    spectral norm so that every linear map starts with Lipschitz constant ``gain``).
    ``weight``: a 2-D tensor (out, in), e.g. ``linear.weight``; returned for chaining.
    """
    if weight.dim() != 2:
        raise ValueError(f"spectral_init_ expects a 2-D weight, got shape {tuple(weight.shape)}")
    rng.check(generator, weight.device, "spectral_init_")
    nn.init.xavier_normal_(weight, generator=generator)
    sigma = torch.linalg.matrix_norm(weight.double(), 2)
    return weight.mul_((gain / sigma).to(weight.dtype))
