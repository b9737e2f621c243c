"""LoFAST local sensitivity bounds (Theorem 1), the naive comparison (eq. 12); docs/math.md sec. 2.

delta(X, eps) = zeta(X) eps + delta2^(k)(X, eps),
delta2^(k) = c sum_l (eps / sqrt(d_h)) (m_l + eps ||B_l||) (||X A_l|| + eps ||A_l||),
m_l = ||M_l(X)|| (k = 1, eq. 27) or xi_l(X) (k = 2, eq. 28), c the softmax Lipschitz constant
(1 in the paper's eq. 20; 1/2 is the tight, still sound value).

Every function is batched over samples: x (B, n, d), eps a float or a (B,) tensor. The
eps-independent part is :func:`lofast_terms` (spectral norms, computed once per sample); the
eps evaluation :func:`lofast_from_terms` is scalar arithmetic, for bisection over eps.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .spectral import (
    CERTIFICATE_FAILURE_PROB,
    LinearOperator,
    SpectralNorm,
    fp_pad,
    norm_of_product,
    spectral_norm,
    top_eigenvalue,
)
from .weights import (
    AttentionWeights,
    a_factors,
    attention_probs,
    b_factors,
    xa_factors,
    xi_factors,
)

__all__ = ["LofastTerms", "zeta", "zeta_operator", "zeta_cheap_upper", "zeta_from_norms",
           "zeta_spectral", "stacked_a_gram", "stacked_p_gram", "m_norm",
           "m_operator", "m_spectral", "xi", "xa_norm", "a_norm", "b_norm", "lofast_terms",
           "lofast_from_terms", "lofast_bound", "naive_terms", "naive_from_terms", "naive_bound",
           "delta21_m", "delta21_xi", "delta22_lofast", "delta22_naive"]


def as_eps(eps: float | Tensor, x: Tensor) -> Tensor:
    """eps as a (B,) tensor on x's device and dtype."""
    e = torch.as_tensor(eps, dtype=x.dtype, device=x.device)
    return e.expand(x.shape[0]) if e.dim() == 0 else e


# -- zeta (eq. 15) ---------------------------------------------------------------------------


def zeta_operator(p: Tensor, w: AttentionWeights, residual: bool) -> LinearOperator:
    """T(G) = H G + sum_l P_l G A_l on G (B, n, d), applied as P_l (G W_l^V) W_l^O.

    Adjoint T*(Y) = H^T Y + sum_l P_l^T (Y W_l^O^T) W_l^V^T. p: (B, h, n, n).
    """
    bsz, h, n, _ = p.shape
    d, d_h = w.d, w.d_h
    wv = w.wv.permute(1, 0, 2).reshape(d, h * d_h)  # (d, h d_h): heads side by side
    wo = w.wo.reshape(h * d_h, d)
    pt = p.transpose(-1, -2)

    def apply(g: Tensor) -> Tensor:
        gv = (g @ wv).view(bsz, n, h, d_h).transpose(1, 2)
        out = (p @ gv).transpose(1, 2).reshape(bsz, n, h * d_h) @ wo
        return out + g if residual else out

    def adjoint(y: Tensor) -> Tensor:
        yo = (y @ wo.T).view(bsz, n, h, d_h).transpose(1, 2)
        out = (pt @ yo).transpose(1, 2).reshape(bsz, n, h * d_h) @ wv.T
        return out + y if residual else out

    return LinearOperator(apply, adjoint, (bsz,), (n, d), p.dtype, p.device)


def a_norm(w: AttentionWeights, mode: str = "upper") -> Tensor:
    """(h,): ||A_l|| = ||W_l^V W_l^O||, exact."""
    return norm_of_product(*a_factors(w), mode)


def b_norm(w: AttentionWeights, mode: str = "upper") -> Tensor:
    """(h,): ||B_l|| = ||W_l^Q W_l^K^T||, exact."""
    return norm_of_product(*b_factors(w), mode)


def zeta_cheap_upper(p: Tensor, w: AttentionWeights, residual: bool) -> Tensor:
    """(B,) guaranteed upper bound on zeta from exact small norms (no iteration):
    :func:`zeta_from_norms` of the exact norms, padded by their rounding."""
    a = a_norm(w)
    p_norm = fp_pad(torch.linalg.matrix_norm(p, 2), 2 * p.shape[-1])
    big_p = fp_pad(top_eigenvalue(stacked_p_gram(p, residual)).clamp_min(0), 4 * p.shape[-1])
    big_a = fp_pad(top_eigenvalue(stacked_a_gram(w, residual)).clamp_min(0), 4 * w.d)
    return zeta_from_norms(p_norm, big_p.sqrt(), a, big_a.sqrt(), residual)


def stacked_p_gram(p: Tensor, residual: bool) -> Tensor:
    """(B, n, n): [P_0 .. P_h] [P_0 .. P_h]^T (P_0 = I when residual, else absent)."""
    ppt = (p @ p.transpose(-1, -2)).sum(1)
    return ppt + torch.eye(p.shape[-1], dtype=p.dtype, device=p.device) if residual else ppt


def stacked_a_gram(w: AttentionWeights, residual: bool) -> Tensor:
    """(d, d): [A_0; ..; A_h]^T [A_0; ..; A_h] (A_0 = I when residual, else absent)."""
    ata = (w.A.transpose(-1, -2) @ w.A).sum(0)
    return ata + torch.eye(w.d, dtype=ata.dtype, device=ata.device) if residual else ata


def zeta_from_norms(p_norm: Tensor, big_p: Tensor, a: Tensor, big_a: Tensor, residual: bool
                    ) -> Tensor:
    """(B,) upper bound on zeta from upper bounds of ||P_l|| (B, h), ||[P_0 .. P_h]|| (B,),
    ||A_l|| (h,) and ||[A_0; ..; A_h]|| (): the min of ||H|| + sum_l ||P_l|| ||A_l|| (triangle,
    eq. 12's coefficient), ||[P_0 .. P_h]|| sqrt(sum ||A_l||^2) and
    sqrt(sum ||P_l||^2) ||[A_0; ..; A_h]|| (Cauchy-Schwarz on the stacked blocks; P_0 = A_0 = I
    when residual)."""
    h0 = 1.0 if residual else 0.0
    tri = h0 + (p_norm * a).sum(-1)
    s1 = big_p * (h0 + (a**2).sum()).sqrt()
    s2 = (h0 + (p_norm**2).sum(-1)).sqrt() * big_a
    return torch.minimum(tri, torch.minimum(s1, s2))


def zeta_spectral(
    x: Tensor,
    w: AttentionWeights,
    residual: bool,
    *,
    mode: str = "upper",
    tol: float = 1e-3,
    max_iter: int = 200,
    generator: torch.Generator | None = None,
    p: Tensor | None = None,
    failure_prob: float | None = CERTIFICATE_FAILURE_PROB,
) -> SpectralNorm:
    """zeta(X) of eq. 15 with the full :class:`SpectralNorm` diagnostics (matrix-free Lanczos;
    in mode "upper" held to the KW bound at ``failure_prob``: :mod:`attncert.bounds.spectral`)."""
    w = w.like(x)
    p = attention_probs(x, w) if p is None else p
    op = zeta_operator(p, w, residual)
    return spectral_norm(
        op,
        mode=mode,
        tol=tol,
        max_iter=max_iter,
        generator=generator,
        failure_prob=failure_prob if mode == "upper" else None,
        fallback=lambda: zeta_cheap_upper(p, w, residual),
    )


def zeta(x: Tensor, w: AttentionWeights, residual: bool, **kwargs) -> Tensor:
    """(B,): zeta(X) = ||H (x) I_d + sum_l P_l(X) (x) A_l^T|| (eq. 15, I_d not I_n).

    Matrix-free Lanczos on T*T (never the nd x nd matrix). In mode="upper" (default) the value
    is a certificate-grade upper bound (see attncert.bounds.spectral); unconverged samples fall
    back to :func:`zeta_cheap_upper`. kwargs: mode, tol, max_iter, generator.
    Also in mode="upper" the value is min(Lanczos upper, zeta_cheap_upper): both are upper
    bounds, and this keeps zeta <= the naive coefficient exactly (e.g. h = 1, H = 0, where
    zeta = ||P|| ||A|| and the Lanczos margin would otherwise exceed it).
    """
    w = w.like(x)
    p = attention_probs(x, w)
    value = zeta_spectral(x, w, residual, p=p, **kwargs).value
    if kwargs.get("mode", "upper") == "upper":
        value = torch.minimum(value, zeta_cheap_upper(p, w, residual))
    return value


# -- ||M_l(X)|| (eq. 25) and xi_l(X) (eq. 26) --------------------------------------------------


def m_operator(x: Tensor, w: AttentionWeights, reduce: bool = False) -> LinearOperator:
    """L_l(G) = G B_l X^T + X B_l G^T on G (B, h, n, d) -> (B, h, n, n), all heads batched.

    Applied as (G W^Q)(X W^K)^T + (X W^Q)(G W^K)^T; adjoint S -> S X B^T + S^T X B
    = (S X W^K) W^Q^T + (S^T X W^Q) W^K^T.

    reduce: L depends on G only through G U, U (d x r) an orthonormal basis of
    range([W^Q, W^K]) (r <= 2 d_h); G (I - U U^T) is annihilated, so the operator restricted
    to G = G_r U^T (G_r: (B, h, n, r), ||G||_F = ||G_r||_F) has the same nonzero singular
    values, on an r/d times smaller space.
    """
    bsz, n, d = x.shape
    xq = torch.einsum("bnd,hde->bhne", x, w.wq)
    xk = torch.einsum("bnd,hde->bhne", x, w.wk)
    wq, wk = w.wq, w.wk
    if reduce and 2 * w.d_h < d:
        u = torch.linalg.qr(torch.cat([wq, wk], dim=-1)).Q  # (h, d, 2 d_h)
        wq, wk = u.transpose(-1, -2) @ wq, u.transpose(-1, -2) @ wk  # (h, r, d_h)

    def apply(g: Tensor) -> Tensor:
        gq = g @ wq
        gk = g @ wk
        return gq @ xk.transpose(-1, -2) + xq @ gk.transpose(-1, -2)

    def adjoint(s: Tensor) -> Tensor:
        return (s @ xk) @ wq.transpose(-1, -2) + (s.transpose(-1, -2) @ xq) @ wk.transpose(-1, -2)

    return LinearOperator(apply, adjoint, (bsz, w.h), (n, wq.shape[-2]), x.dtype, x.device)


def xi(x: Tensor, w: AttentionWeights, mode: str = "upper") -> Tensor:
    """(B, h): xi_l(X) = ||X B_l^T|| + ||X B_l|| (eq. 26), exact via d_h x d_h factors.

    xi_l >= ||M_l(X)|| (triangle inequality on G B X^T + X B G^T).
    """
    kq, qk = xi_factors(x, w)
    return norm_of_product(*kq, mode) + norm_of_product(*qk, mode)


def m_spectral(
    x: Tensor,
    w: AttentionWeights,
    *,
    mode: str = "upper",
    tol: float = 1e-3,
    max_iter: int = 200,
    generator: torch.Generator | None = None,
    failure_prob: float | None = CERTIFICATE_FAILURE_PROB,
) -> SpectralNorm:
    """||M_l(X)|| with diagnostics (in mode "upper" held to the KW bound at
    ``failure_prob``, as :func:`zeta_spectral`); unconverged entries fall back to xi_l(X)."""
    w = w.like(x)
    return spectral_norm(
        m_operator(x, w, reduce=True),
        mode=mode,
        tol=tol,
        max_iter=max_iter,
        generator=generator,
        failure_prob=failure_prob if mode == "upper" else None,
        side="smaller",  # (n, n) outputs: n^2 dimensions, fewer than the n x r inputs if n < r
        fallback=lambda: xi(x, w),
    )


def m_norm(x: Tensor, w: AttentionWeights, **kwargs) -> Tensor:
    """(B, h): ||M_l(X)|| (eq. 25), the norm of G -> G B_l X^T + X B_l G^T, matrix-free.

    kwargs: mode ("upper" default: certificate grade, fallback xi), tol, max_iter, generator.
    In mode "upper" the value is min(Lanczos upper, xi_l(X)) (both upper bounds), so
    ||M_l|| <= xi_l holds exactly and delta2^(1) <= delta2^(2).
    """
    value = m_spectral(x, w, **kwargs).value
    if kwargs.get("mode", "upper") == "upper":
        value = torch.minimum(value, xi(x, w))
    return value


def xa_norm(x: Tensor, w: AttentionWeights, mode: str = "upper") -> Tensor:
    """(B, h): ||X A_l|| = ||(X W_l^V) W_l^O||, exact."""
    return norm_of_product(*xa_factors(x, w), mode)


# -- Theorem 1 --------------------------------------------------------------------------------


class LofastTerms(NamedTuple):
    """eps-independent pieces of a LoFAST (or naive) bound, per sample.

    zeta: (B,) first-term coefficient (zeta(X) for LoFAST; ||H|| + sum ||A_l|| ||P_l|| for
    naive); m: (B, h) ||M_l(X)|| or xi_l(X); xa: (B, h) ||X A_l||; a: (h,) ||A_l||;
    b: (h,) ||B_l||; d_h: head dimension.
    """

    zeta: Tensor
    m: Tensor
    xa: Tensor
    a: Tensor
    b: Tensor
    d_h: int


# tol = 1e-3: the certified value sqrt(rho + r) exceeds the singular value it bounds by at most
# tol / 2 relative (plus the margin), and the residual test needs far fewer Lanczos steps than 1e-4.


def lofast_terms(
    x: Tensor,
    w: AttentionWeights,
    residual: bool,
    variant: str = "M",
    *,
    mode: str = "upper",
    tol: float = 1e-3,
    max_iter: int = 200,
    generator: torch.Generator | None = None,
) -> LofastTerms:
    """Theorem 1's terms: variant "M" (delta2^(1), eq. 27) or "xi" (delta2^(2), eq. 28)."""
    if variant not in ("M", "xi"):
        raise ValueError(f"variant must be 'M' or 'xi', not {variant!r}")
    w = w.like(x)
    kw = dict(mode=mode, tol=tol, max_iter=max_iter, generator=generator)
    z = zeta(x, w, residual, **kw)
    m = m_norm(x, w, **kw) if variant == "M" else xi(x, w, mode)
    return LofastTerms(z, m, xa_norm(x, w, mode), a_norm(w, mode), b_norm(w, mode), w.d_h)


def lofast_from_terms(terms: LofastTerms, eps: float | Tensor, softmax_lipschitz: float = 1.0):
    """(B,): zeta eps + c sum_l (eps/sqrt(d_h)) (m_l + eps ||B_l||) (||X A_l|| + eps ||A_l||)."""
    e = as_eps(eps, terms.zeta)
    ec = e[:, None]
    d21 = (ec / math.sqrt(terms.d_h)) * (terms.m + ec * terms.b)
    d22 = terms.xa + ec * terms.a
    return terms.zeta * e + softmax_lipschitz * (d21 * d22).sum(-1)


def lofast_bound(
    x: Tensor,
    w: AttentionWeights,
    eps: float | Tensor,
    residual: bool,
    variant: str = "M",
    softmax_lipschitz: float = 1.0,
    **kwargs,
) -> Tensor:
    """(B,): LoFAST Theorem 1, delta(X, eps) >= max_{||X'-X||_F <= eps} ||F(X') - F(X)||_F.

    kwargs go to :func:`lofast_terms` (mode, tol, max_iter, generator).
    """
    return lofast_from_terms(
        lofast_terms(x, w, residual, variant, **kwargs), eps, softmax_lipschitz
    )


def naive_terms(x: Tensor, w: AttentionWeights, residual: bool, mode: str = "upper"):
    """Terms of the naive bound: eq. 12's coefficient ||H|| + sum_l ||A_l|| ||P_l(X)||, with xi."""
    w = w.like(x)
    p = attention_probs(x, w)
    a = a_norm(w, mode)
    p_norm = torch.linalg.matrix_norm(p, 2)
    if mode == "upper":
        p_norm = fp_pad(p_norm, 2 * p.shape[-1])
    first = (1.0 if residual else 0.0) + (p_norm * a).sum(-1)
    return LofastTerms(first, xi(x, w, mode), xa_norm(x, w, mode), a, b_norm(w, mode), w.d_h)


naive_from_terms = lofast_from_terms


def naive_bound(
    x: Tensor,
    w: AttentionWeights,
    eps: float | Tensor,
    residual: bool,
    softmax_lipschitz: float = 1.0,
    mode: str = "upper",
) -> Tensor:
    """(B,): naive bound, eq. 12 first term plus delta2^(2) (with xi)."""
    return naive_from_terms(naive_terms(x, w, residual, mode), eps, softmax_lipschitz)


# -- single-head pieces of LoFAST section 5.1 -------------------------------------------------


def _one_head(w: AttentionWeights, head: int | None) -> AttentionWeights:
    if head is not None:
        return w.head(head)
    if w.h != 1:
        raise ValueError(f"the weights have {w.h} heads: pass head=")
    return w


def delta21_m(x, w, eps, head: int | None = None, softmax_lipschitz: float = 1.0, **kwargs):
    """(B,): delta_{2,1}^(1) = c (eps/sqrt(d_h)) (||M(X)|| + eps ||B||) >= ||P(X') - P(X)||_F."""
    w1 = _one_head(w.like(x), head)
    e = as_eps(eps, x)
    m = m_norm(x, w1, **kwargs)[:, 0]
    return softmax_lipschitz * e / math.sqrt(w1.d_h) * (m + e * b_norm(w1)[0])


def delta21_xi(x, w, eps, head: int | None = None, softmax_lipschitz: float = 1.0):
    """(B,): delta_{2,1}^(2) = c (eps/sqrt(d_h)) (xi(X) + eps ||B||) >= ||P(X') - P(X)||_F."""
    w1 = _one_head(w.like(x), head)
    e = as_eps(eps, x)
    return softmax_lipschitz * e / math.sqrt(w1.d_h) * (xi(x, w1)[:, 0] + e * b_norm(w1)[0])


def delta22_lofast(x, w, eps, head: int | None = None):
    """(B,): delta_{2,2}^(1) = ||X A|| + eps ||A|| >= ||X' A|| (LoFAST's second factor)."""
    w1 = _one_head(w.like(x), head)
    return xa_norm(x, w1)[:, 0] + as_eps(eps, x) * a_norm(w1)[0]


def delta22_naive(x, w, eps, head: int | None = None):
    """(B,): delta_{2,2}^(2) = ||A|| (||X|| + eps) >= ||X' A|| (the naive second factor)."""
    w1 = _one_head(w.like(x), head)
    x_norm = fp_pad(torch.linalg.matrix_norm(x, 2), x.shape[-1] + x.shape[-2])
    return a_norm(w1)[0] * (x_norm + as_eps(eps, x))
