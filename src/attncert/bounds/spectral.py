"""Spectral norms of batched matrices and matrix-free linear operators.

One routine, :func:`spectral_norm`, for both. Small dense matrices get an exact SVD; operators
given as (apply, adjoint) get Lanczos with full reorthogonalisation on A*A.

What mode="upper" (the certificate mode) guarantees, per batch entry:

* exact path (a dense matrix): the largest singular value from ``torch.linalg.svdvals``,
  padded by ``4 * (m + n) * eps_machine`` relative (the backward error of the SVD).
* Lanczos path: with y the final top Ritz vector (unit), rho = y^T A*A y and
  r = ||A*A y - rho y|| computed explicitly after the iteration, A*A (symmetric PSD) has an
  eigenvalue in [rho - r, rho + r]. The value returned is sqrt(rho + r) (1 + margin + fp),
  fp = 16 sqrt(N) eps_machine, so it is a guaranteed upper bound on the singular value that
  the Ritz pair approximates. That need not be the largest: the residual says only that
  *some* eigenvalue lies within r of rho, and when the start vector's component along the
  top singular vector is small for the gap to the next singular value, the iteration can stop
  on a lower pair with a small residual (seen: 1% below ||M_l|| after 11 steps, the top two
  singular values 1% apart). No residual test closes that gap. The Kuczynski-Wozniakowski
  (1992, Thm 4.2) bound does, in probability over the Gaussian start and whatever the
  spectrum: P(theta_k < (1 - e) ||A||^2) <= 1.648 sqrt(N) exp(-sqrt(e) (2k - 1)) for the top
  Ritz value theta_k after k steps. ``failure_prob`` reports it at e = 1 - theta_k / value^2
  (vacuous, 1, at tight margins). Pass ``failure_prob=p``: the iteration then runs at least
  the :func:`kw_steps` that bring e down to ``kw_looseness``, and the value is raised to
  sqrt(theta_k / (1 - e)) where that is larger, so value >= ||A|| with probability >= 1 - p
  (after N steps the Krylov space is the whole space and the Ritz values are the eigenvalues:
  no raise). The LoFAST certificates do (:data:`CERTIFICATE_FAILURE_PROB`).
  An entry counts as converged when r <= tol * rho. Unconverged entries get ``fallback()``
  (a cheap guaranteed bound supplied by the caller) or raise; never the unconverged estimate.

mode="estimate" returns sqrt(rho): a lower bound on ||A|| (Rayleigh quotient), for plots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "LinearOperator",
    "SpectralNorm",
    "spectral_norm",
    "norm_of_product",
    "fp_pad",
    "kw_failure_prob",
    "kw_steps",
    "CERTIFICATE_FAILURE_PROB",
]

_KW_CONST = 1.648  # Kuczynski & Wozniakowski (1992), Lanczos with a random start, Thm 4.2
#: the probability, per Lanczos norm, that a certificate's value is below the norm (the
#: Kuczynski-Wozniakowski bound over the random start; module docstring): the LoFAST
#: certificates' zeta and ||M_l|| (:mod:`attncert.bounds.lofast`, mode "upper")
CERTIFICATE_FAILURE_PROB = 1e-9
#: the relative looseness e of theta_k / (1 - e) the certificates' iterations run down to
KW_LOOSENESS = 0.02


def kw_steps(dim: int, failure_prob: float, looseness: float = KW_LOOSENESS) -> int:
    """The fewest Lanczos steps k after which theta_k / (1 - ``looseness``) bounds ||A||^2 of
    an operator on ``dim`` dimensions with probability >= 1 - ``failure_prob`` (the KW bound
    1.648 sqrt(dim) exp(-sqrt(looseness) (2k - 1)) <= failure_prob)."""
    if not (0 < failure_prob < 1 and 0 < looseness < 1):
        raise ValueError(f"kw_steps: failure_prob {failure_prob!r} and looseness {looseness!r} "
                         "must lie in (0, 1)")
    t = math.log(_KW_CONST * math.sqrt(dim) / failure_prob) / math.sqrt(looseness)
    return max(1, math.ceil((t + 1) / 2))


@dataclass(frozen=True)
class LinearOperator:
    """A batched linear map given matrix-free.

    apply: (*batch_shape, *in_shape) -> (*batch_shape, *out_shape); adjoint: the reverse.
    """

    apply: Callable[[Tensor], Tensor]
    adjoint: Callable[[Tensor], Tensor]
    batch_shape: tuple[int, ...]
    in_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def from_matrix(cls, a: Tensor) -> LinearOperator:
        """Wrap a (*batch, m, n) tensor."""
        return cls(
            apply=lambda v: (a @ v.unsqueeze(-1)).squeeze(-1),
            adjoint=lambda u: (a.transpose(-1, -2) @ u.unsqueeze(-1)).squeeze(-1),
            batch_shape=tuple(a.shape[:-2]),
            in_shape=(a.shape[-1],),
            dtype=a.dtype,
            device=a.device,
        )


class SpectralNorm(NamedTuple):
    """Result of :func:`spectral_norm` (all tensors have the operator's batch shape).

    value: what the mode promises (see the module docstring); estimate: sqrt(rho), a lower
    bound; residual: r = ||A*A y - rho y||; converged: r <= tol * rho; iterations: Lanczos
    steps (0 for the exact path); failure_prob: KW bound on P(value < ||A||) (0 when exact);
    vector: the top right singular vector estimate y (*batch, *in_shape), None when exact.
    """

    value: Tensor
    estimate: Tensor
    residual: Tensor
    converged: Tensor
    iterations: int
    failure_prob: Tensor
    vector: Tensor | None


def fp_pad(value: Tensor, size: int) -> Tensor:
    """Pad an exactly computed norm by its floating-point backward error, 4 size eps relative."""
    return value * (1.0 + 4.0 * size * torch.finfo(value.dtype).eps)


def kw_failure_prob(theta: Tensor, upper_sq: Tensor, k: int, dim: int) -> Tensor:
    """KW bound on P(lambda_max(A*A) > upper_sq) after k Lanczos steps from a random start."""
    e = (1.0 - theta / upper_sq.clamp_min(torch.finfo(upper_sq.dtype).tiny)).clamp(0.0, 1.0)
    p = _KW_CONST * math.sqrt(dim) * torch.exp(-e.sqrt() * (2 * k - 1))
    return p.clamp(max=1.0)


#: symmetric matrices up to this size go to the host's LAPACK in :func:`top_eigenvalue` when
#: they live on CUDA and come in a batch: CUDA's eigensolver takes them one at a time, a few
#: kernels each (the ``lofast`` training margin's step of the grid's ViT at batch 128 spent 90%
#: of 1.66 s in it on an H200, when it took exact norms); 0 keeps every matrix on its device
HOST_EIGH_MAX = 64
#: the device types whose small batched eigenproblems go to the host
HOST_EIGH_DEVICES = ("cuda",)


def top_eigenvalue(sym: Tensor) -> Tensor:
    """(...,): the largest eigenvalue of symmetric (..., k, k), differentiable (eigvalsh). A
    batch of small matrices on CUDA (k <= :data:`HOST_EIGH_MAX`) is solved on the host and the
    result moved back (the same LAPACK-grade eigenvalues; a host sync, never inside a
    captured graph: the certificates that call it run eager; a training loss takes
    :func:`attncert.bounds.schatten.eigenvalue_upper`)."""
    if (sym.device.type in HOST_EIGH_DEVICES and sym.shape[-1] <= HOST_EIGH_MAX
            and sym[..., 0, 0].numel() > 1):
        return torch.linalg.eigvalsh(sym.cpu())[..., -1].to(sym.device)
    return torch.linalg.eigvalsh(sym)[..., -1]


def norm_of_product(u: Tensor, v: Tensor, mode: str = "upper") -> Tensor:
    """||u v^T|| for u (..., n, r), v (..., m, r) with small r, via R_u R_v^T (r x r).

    Batch dims broadcast. Used for ||X B_l^T|| = ||(X W^K)(W^Q)^T||, ||X A_l||, ||A_l||, ||B_l||.
    ``mode``: "upper" the exact norm padded by its rounding (certificates), "estimate" unpadded.
    Differentiable at factors of full rank; not for a training loss: QR's derivative is NaN at
    a rank-deficient factor (a trained attention's X W^K), and a solver on CUDA reads its
    status on the host; a loss takes :func:`attncert.bounds.schatten.product_gram`'s bound.
    """
    how = "reduced" if torch.is_grad_enabled() and (u.requires_grad or v.requires_grad) else "r"
    r_u = torch.linalg.qr(u, mode=how).R  # "r" has no derivative
    r_v = torch.linalg.qr(v, mode=how).R
    s = torch.linalg.svdvals(r_u @ r_v.transpose(-1, -2))[..., 0]
    return fp_pad(s, u.shape[-2] + v.shape[-2] + u.shape[-1]) if mode == "upper" else s


#: a second Gram-Schmidt pass runs when the first leaves less than this share of w's norm
_DGKS = 0.5 ** 0.5


def _remove(vs: Tensor, w: Tensor) -> Tensor:
    """w - V V^T w per batch entry; vs (M, k, N) orthonormal rows, w (M, N)."""
    # row-vector bmm forms: several times faster on CPU than (M, k, N) @ (M, N, 1)
    coef = torch.bmm(w.unsqueeze(1), vs.transpose(1, 2))  # (M, 1, k)
    return torch.baddbmm(w.unsqueeze(1), coef, vs, alpha=-1).squeeze(1)


def _reorthogonalise(vs: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """(w - V V^T w, its norm) to working precision, per batch entry: a classical
    Gram-Schmidt pass, and a second where the first left less than :data:`_DGKS` of w's norm
    (Daniel, Gragg, Kaufman and Stewart's criterion; "twice is enough"). In the Lanczos step w
    has had the three-term recurrence taken out, so one pass removes rounding-level components
    only and the second rarely runs: reading the basis is the iteration's main memory
    traffic on a CPU, and two unconditional passes read it twice. On CUDA the test is a host
    read and a few more small kernels than the pass it saves (the cost model counts them:
    ``certify_vit`` 1% more at the paper params, 2026-12-01)."""
    before = w.norm(dim=-1)
    w = _remove(vs, w)
    after = w.norm(dim=-1)
    if bool((after < _DGKS * before).any()):
        w = _remove(vs, w)
        after = w.norm(dim=-1)
    return w, after


def _exact(a: Tensor, mode: str) -> SpectralNorm:
    s = torch.linalg.svdvals(a)[..., 0]
    value = fp_pad(s, a.shape[-1] + a.shape[-2]) if mode == "upper" else s
    zero = torch.zeros_like(s)
    conv = torch.ones_like(s, dtype=torch.bool)
    return SpectralNorm(value, s, zero.detach(), conv, 0, zero.detach(), None)


def _smaller_side(op: LinearOperator) -> LinearOperator:
    """``op``, or its adjoint where that acts on fewer dimensions (the same singular values)."""
    with torch.no_grad():
        out = op.apply(torch.zeros(*op.batch_shape, *op.in_shape, dtype=op.dtype,
                                   device=op.device))
    out_shape = tuple(out.shape[len(op.batch_shape):])
    if math.prod(out_shape) >= math.prod(op.in_shape):
        return op
    return LinearOperator(op.adjoint, op.apply, op.batch_shape, out_shape, op.dtype, op.device)


def spectral_norm(
    a: Tensor | LinearOperator,
    *,
    mode: str = "upper",
    method: str = "auto",
    tol: float = 1e-4,
    max_iter: int = 200,
    min_iter: int = 2,
    check_every: int = 3,
    margin: float = 1e-4,
    failure_prob: float | None = None,
    kw_looseness: float = KW_LOOSENESS,
    fallback: Callable[[], Tensor] | None = None,
    on_fail: str = "fallback",
    generator: torch.Generator | None = None,
    x0: Tensor | None = None,
    side: str = "input",
) -> SpectralNorm:
    """Spectral norm of a batched matrix (exact SVD) or operator (Lanczos on A*A).

    a: a (*batch, m, n) tensor or a :class:`LinearOperator`. method: "auto" (exact for
    tensors, Lanczos for operators), "exact" or "lanczos". mode: "upper" (certificate, the
    default; see the module docstring for the exact guarantee) or "estimate". tol: relative
    eigen-residual r / rho of A*A at which an entry counts as converged. margin: extra
    relative padding of the upper value. failure_prob: if given, also raise the value to the
    KW bound at this probability, after at least :func:`kw_steps` (``kw_looseness``) steps
    (fewer when the operator has fewer dimensions: its Krylov space is then whole).
    fallback: a callable returning a guaranteed upper bound (batch shape), used for
    unconverged entries in mode "upper"; without it, or with
    on_fail="raise", an unconverged entry raises RuntimeError. check_every: Lanczos steps
    between convergence tests (after min_iter). x0: optional warm start
    (*batch, *in_shape); it voids the KW statement (failure_prob then reports 1). side:
    "input" (Lanczos on A*A) or "smaller" (on A A* when A's output has fewer dimensions: the
    same singular values, a Krylov space that fills sooner, so its Ritz values become exact
    in at most that many steps and need no KW raise; ``vector`` is then a left singular
    vector). x0 keeps the input side.

    The value is differentiable: its gradient is that of ||A y|| at the final Ritz vector y
    (exact at convergence), or the fallback's gradient where the fallback is used.
    """
    if mode not in ("upper", "estimate"):
        raise ValueError(f"mode must be 'upper' or 'estimate', not {mode!r}")
    if isinstance(a, Tensor):
        if method in ("auto", "exact"):
            return _exact(a, mode)
        a = LinearOperator.from_matrix(a)
    elif method == "exact":
        raise ValueError("method='exact' needs a dense tensor")

    if side not in ("input", "smaller"):
        raise ValueError(f"side must be 'input' or 'smaller', not {side!r}")
    op = _smaller_side(a) if side == "smaller" and x0 is None else a
    batch, shape = op.batch_shape, op.in_shape
    m_b = math.prod(batch)
    dim = math.prod(shape)
    dt, dev = op.dtype, op.device
    feps = torch.finfo(dt).eps

    def gram(v: Tensor) -> Tensor:  # (M, N) -> (M, N): A*A v
        return op.adjoint(op.apply(v.reshape(*batch, *shape))).reshape(m_b, dim)

    def randn(rows: int) -> Tensor:
        g = torch.randn(rows, dim, generator=generator, device=dev, dtype=torch.float64)
        return g.to(dt)

    k_max = max(1, min(max_iter, dim))
    if failure_prob is not None:  # the KW bound's steps (or the whole space, if smaller)
        min_iter = max(min_iter, min(kw_steps(dim, failure_prob, kw_looseness), k_max))
    with torch.no_grad():
        v = x0.detach().reshape(m_b, dim).to(dt) if x0 is not None else randn(m_b)
        v = v / v.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)
        cap = min(k_max, 32)
        basis = torch.empty(m_b, cap, dim, dtype=dt, device=dev)  # (M, k, N): one gemv per entry
        alpha = torch.zeros(m_b, k_max, dtype=torch.float64, device=dev)
        beta = torch.zeros(m_b, k_max, dtype=torch.float64, device=dev)
        k = 0
        for j in range(k_max):
            if j == cap:  # grow the Krylov basis storage geometrically
                cap = min(2 * cap, k_max)
                grown = torch.empty(m_b, cap, dim, dtype=dt, device=dev)
                grown[:, :j] = basis[:, :j]
                basis = grown
            basis[:, j] = v
            w = gram(v)
            alpha[:, j] = (v * w).sum(-1).double()
            w = w - alpha[:, j].to(dt)[:, None] * v
            if j > 0:
                w = w - beta[:, j - 1].to(dt)[:, None] * basis[:, j - 1]
            vs = basis[:, : j + 1]
            w, b = _reorthogonalise(vs, w)
            b = b.double()
            k = j + 1
            # the tridiagonal eigen-solve costs about one operator application for many small
            # batch entries: test convergence every check_every steps only
            if k == k_max or (k >= min_iter and (k - min_iter) % check_every == 0):
                t = (
                    torch.diag_embed(alpha[:, :k])
                    + torch.diag_embed(beta[:, : k - 1], 1)
                    + torch.diag_embed(beta[:, : k - 1], -1)
                )
                theta_all, s_all = torch.linalg.eigh(t)
                theta = theta_all[:, -1]
                res_est = b * s_all[:, -1, -1].abs()
                if k == k_max or bool((res_est <= tol * theta.clamp_min(0.0) * 0.5).all()):
                    break
            # breakdown: the Krylov space is invariant; restart with a fresh orthogonal vector
            scale = alpha[:, :k].abs().amax(-1).clamp_min(torch.finfo(dt).tiny)
            broke = b <= 64 * feps * scale
            if bool(broke.any()):
                fresh = randn(m_b)
                for _ in range(2):
                    fresh = _remove(vs, fresh)
                w = torch.where(broke[:, None], fresh, w)
                b = torch.where(broke, torch.zeros_like(b), b)
            beta[:, j] = b
            v = w / w.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)
        s_top = s_all[:, :, -1].to(dt)  # (M, k)
        y = torch.bmm(s_top.unsqueeze(1), basis[:, :k]).squeeze(1)
        y = y / y.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(dt).tiny)

    # one more application, with autograd, for the explicit residual and the gradient
    ay = op.apply(y.reshape(*batch, *shape))
    sigma_diff = ay.reshape(m_b, -1).norm(dim=-1)
    with torch.no_grad():
        cy = op.adjoint(ay.detach()).reshape(m_b, dim)
        rho = (y * cy).sum(-1).clamp_min(0.0)
        r = (cy - rho[:, None] * y).norm(dim=-1)
        converged = r <= tol * rho
        converged |= (rho == 0) & (r == 0)
        estimate = rho.sqrt()
        upper_sq = (rho + r) * (1.0 + margin + 16.0 * math.sqrt(dim) * feps) ** 2
        theta_k = theta.to(dt).clamp_min(0.0)
        if failure_prob is not None and k < dim:  # k = dim: the Ritz values are exact
            e_star = (math.log(_KW_CONST * math.sqrt(dim) / failure_prob) / (2 * k - 1)) ** 2
            if e_star < 1.0:
                upper_sq = torch.maximum(upper_sq, theta_k / (1.0 - e_star))
            else:
                converged = torch.zeros_like(converged)
        fprob = kw_failure_prob(theta_k, upper_sq, k, dim)
        if k >= dim:  # the Krylov space is the whole space: no probability left
            fprob = torch.zeros_like(fprob)
        if x0 is not None:
            fprob = torch.ones_like(fprob)
        upper = upper_sq.sqrt()

    grad_part = sigma_diff - sigma_diff.detach()
    if mode == "estimate":
        value = estimate + grad_part
    else:
        value = upper + grad_part
        if not bool(converged.all()):
            bad = int((~converged).sum())
            if on_fail == "raise" or fallback is None:
                raise RuntimeError(
                    f"spectral_norm: {bad} of {m_b} entries not converged to tol={tol} in "
                    f"{k} Lanczos steps (max rel. residual "
                    f"{float((r / rho.clamp_min(1e-300)).max()):.2e})"
                    "; raise max_iter or pass a fallback"
                )
            fb = fallback().reshape(m_b).to(dt)
            value = torch.where(converged, value, fb)
            fprob = torch.where(converged, fprob, torch.zeros_like(fprob))
    return SpectralNorm(
        value=value.reshape(batch),
        estimate=estimate.reshape(batch),
        residual=r.reshape(batch),
        converged=converged.reshape(batch),
        iterations=k,
        failure_prob=fprob.reshape(batch),
        vector=y.reshape(*batch, *shape),
    )
