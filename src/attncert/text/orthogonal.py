"""OLSA's 1-Lipschitz linear maps and activation: Newton-Schulz orthogonalisation
(:class:`OrthogonalLinear`, re-projected after each step), the spectrally normalised head
(:class:`SpectralNormLinear`) and :class:`GroupSort` (docs/math.md section 7)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.training.precision import AUTOCAST_DEVICES, full_precision


def newton_orthogonalize(v: Tensor, iters: int) -> Tensor:
    """(..., d, d) -> the orthogonal polar factor W = (V V^T)^{-1/2} V by Newton-Schulz.

    X_0 = V / sqrt(s), s the largest absolute row sum of V V^T (>= ||V||_2^2), so every
    singular value of X_0 is in (0, 1]; X_{k+1} = X_k (3I - X_k^T X_k) / 2 maps each singular
    value by f(x) = (3x - x^3) / 2, which keeps (0, 1] inside (0, 1] and converges to 1
    (quadratically near 1) with unchanged singular vectors: the polar factor that the coupled
    iteration of docs/math.md section 7 (Y_0 = V V^T, Z_0 = I) reaches as Z -> (V V^T)^{-1/2}.
    This uncoupled form corrects its own rounding (the coupled one stalls near 4e-4 in
    float32 on an ill-conditioned V), and an unconverged result still has ||W||_2 <= 1 (up to
    rounding). Differentiable. Certificates use the exact spectral norm of the result.
    """
    a = v @ v.transpose(-1, -2)
    x = v / a.abs().sum(-1).amax(-1)[..., None, None].sqrt()
    for _ in range(iters):
        x = 1.5 * x - 0.5 * x @ (x.transpose(-1, -2) @ x)
    return x


def _at_least_float32(t: Tensor) -> Tensor:
    """``t`` in float32, or as it is when wider (a float64 certificate model stays float64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager:
    return (torch.autocast(device.type, enabled=False) if device.type in AUTOCAST_DEVICES
            else contextlib.nullcontext())


def _orthogonalize(v: Tensor, iters: int) -> Tensor:
    """:func:`newton_orthogonalize` of (..., d, d) ``v`` in float32 outside autocast and TF32
    whatever the training precision (:func:`full_precision`); under ``torch.compile`` in
    float64 instead, autocast off: the float32 matmul precision is a global switch that a
    compiled graph cannot set, and float64 products never use TF32."""
    v = _at_least_float32(v)
    if torch.compiler.is_compiling():
        with _no_autocast(v.device):
            return newton_orthogonalize(v.double(), iters).to(v.dtype)
    with full_precision(v.device):
        return newton_orthogonalize(v, iters)


def orthogonal_weights(maps: list[OrthogonalLinear], iters: int | None = None) -> list[Tensor]:
    """Every map's :meth:`OrthogonalLinear.weight_effective` (with ``iters`` iterations instead
    of the map's own when given), the maps of one shape, dtype, device and iteration count as
    one batch: one Newton-Schulz step of batched products for all of them (a training step's
    forward and backward), where one per map launches some 30 kernels each. Equal to the maps'
    own up to float rounding: the training forward takes these, while certificates and
    evaluation take each map's own, so a bound and the logits it certifies use the same
    matrices."""
    groups: dict[tuple, list[int]] = {}
    for i, m in enumerate(maps):
        key = (m.v.shape, m.v.dtype, m.v.device, m.iters if iters is None else iters)
        groups.setdefault(key, []).append(i)
    out: list[Tensor | None] = [None] * len(maps)
    for (*_, k), idx in groups.items():
        ws = _orthogonalize(torch.stack([maps[i].v for i in idx]), k).unbind()
        for i, w in zip(idx, ws, strict=True):
            out[i] = w
    return out


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
        """(dim, dim): the (nearly) orthogonal matrix applied (:func:`_orthogonalize`: float32
        outside autocast and TF32, float64 under ``torch.compile``)."""
        return _orthogonalize(self.v, self.iters)

    def forward(self, x: Tensor, weight: Tensor | None = None) -> Tensor:
        """W x (+ b); ``weight``: W computed already (:func:`orthogonal_weights`)."""
        return F.linear(x, self.weight_effective() if weight is None else weight, self.bias)

    @torch.no_grad()
    def reproject_(self, iters: int = 5) -> None:
        """V <- its polar factor (W unchanged): keeps V near-orthogonal between optimiser steps,
        so the few forward iterations converge (a step moves the singular values little)."""
        self.v.copy_(_orthogonalize(self.v, iters))


@torch.no_grad()
def reproject_orthogonal_(model: nn.Module, iters: int = 5) -> None:
    """:meth:`OrthogonalLinear.reproject_` on every orthogonal map of ``model`` (after a step),
    the maps of one shape, dtype and device as one batch (:func:`orthogonal_weights`): one
    Newton-Schulz iteration of batched products for all of them, not one per map (a deep model
    has 30 maps, and a training step runs this eagerly, outside any compiled graph)."""
    maps = [m for m in model.modules() if isinstance(m, OrthogonalLinear)]
    if maps:
        torch._foreach_copy_([m.v for m in maps], orthogonal_weights(maps, iters))


#: log2 of the Schatten norm's order that normalises a matrix of more than two rows
#: (:func:`schatten_norm`): p = 2^14, within a factor rank^(1/p) (1.0004 at rank 768) of ||W||_2
SCHATTEN_LOG2_P = 14


#: squarings between two rescalings in :func:`schatten_norm`: from a Frobenius norm of 1 the
#: largest eigenvalue is at least rank^(-1/2), so after 4 squarings at least rank^(-8), far
#: above float64's smallest normal number for any rank a matrix here has
RESCALE_EVERY = 4


def schatten_norm(w: Tensor, log2_p: int = SCHATTEN_LOG2_P) -> Tensor:
    """||W||_{S_p} = (sum_i s_i^p)^(1/p), p = 2^log2_p (>= 2), of an (out, in) matrix with
    singular values s_i: an upper bound of ||W||_2 = max_i s_i, above it by at most a factor
    rank^(1/p), differentiable, by matrix products only (no solver, no host round trip: a
    CUDA graph holds it).

    Gram iteration with rescaling: A_0 = W W^T (or W^T W, the smaller) and t = log2_p - 2
    squarings, so that ||A_0^(2^t)||_F = (sum_i s_i^p)^(1/2) and ||W||_{S_p} is that norm to
    the power 2^-(t+1). The matrix is divided by its Frobenius norm s_j first and after every
    :data:`RESCALE_EVERY` squarings (k_j of them done), and log ||A_0^(2^t)||_F is
    sum_j 2^(t - k_j) log s_j, the last s_j taken after the last squaring. A rescaled matrix
    has entries at most 1, so nothing overflows; eigenvalues far below the largest underflow
    to 0, which lowers the sum by less than float64's rounding of its largest term. In float64,
    outside autocast and TF32 (a bf16 or TF32 product would add an error of 1e-3), returned
    in the weight's dtype, float32 at least: the rounding to float32 can put it half a unit in
    the last place below ||W||_2 (W / s(W) of norm 1 + 6e-8), so a certificate never relies
    on it and multiplies in the exact norm instead. docs/math.md section 7."""
    if log2_p < 1:
        raise ValueError(f"log2_p {log2_p}: the order p = 2^log2_p must be at least 2")
    out = torch.promote_types(w.dtype, torch.float32)
    with _no_autocast(w.device):
        v = w.double()
        if log2_p == 1:
            return v.norm().to(out)
        a = v @ v.T if v.shape[0] <= v.shape[1] else v.T @ v
        t = log2_p - 2
        log_norm = v.new_zeros(())
        for k in range(t + 1):  # k: the squarings done
            if k % RESCALE_EVERY == 0 or k == t:
                s = a.norm()
                log_norm = log_norm + s.log() / 2.0 ** (k + 1)  # 2^(t - k) / 2^(t + 1)
                if k == t:
                    break
                a = a / s
            a = a @ a
        return log_norm.exp().to(out)


def head_norm(w: Tensor) -> Tensor:
    """||W||_2 of an (out, in) matrix, differentiable; for out <= 2 exactly, without a
    solver, for more rows an upper bound, its Schatten norm (:func:`schatten_norm`).

    With two rows the largest eigenvalue of the 2 x 2 Gram matrix [[a, b], [b, c]] is
    (a + c) / 2 + sqrt(((a - c) / 2)^2 + b^2): exact, a few elementwise kernels, and no
    SVD, whose CUDA kernels read their status on the host (a CUDA-graph capture of the
    training step fails there). The smallest normal float under the square root keeps the
    gradient finite where the two singular values coincide (orthonormal rows, the
    initialisation: the subgradient of the mean of both), raising the eigenvalue by at most
    its square root, 1e-19 in float32 (an over-estimate: W / ||W||_2 stays in the unit ball).
    Computed in float32 at least and never autocast (no matrix product). More rows (the frozen
    encoder's map to the head's width, a head of more classes) take the Schatten norm of order
    2^14, at most 0.04% above ||W||_2 at rank 768 and below it by float32's rounding at most
    (:func:`schatten_norm`): W divided by it has spectral norm at most 1 + 6e-8, and a CUDA
    graph holds the whole training step.
    """
    if w.shape[0] > 2:
        return schatten_norm(w)
    w = w.to(torch.promote_types(w.dtype, torch.float32))
    if w.shape[0] == 1:
        return w.norm()
    a, c, b = w[0].square().sum(), w[1].square().sum(), (w[0] * w[1]).sum()
    spread = (((a - c) / 2).square() + b.square() + torch.finfo(w.dtype).tiny).sqrt()
    return ((a + c) / 2 + spread).sqrt()


class SpectralNormLinear(nn.Module):
    """y = W x / ||W||_2 (no bias): a 1-Lipschitz linear head, normalised by its spectral norm
    (differentiable; :func:`head_norm`: exact for up to two rows, else its Schatten norm of
    order 2^14, an upper bound within 0.04%), so the certificate regulariser cannot grow the
    radius M / (sqrt(2) Lip) by shrinking the head while the CE loss stays bounded.
    Certificates multiply in the exact spectral norm of :meth:`weight_effective`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        nn.init.orthogonal_(self.weight)

    def weight_effective(self) -> Tensor:
        """(out, in): W / :func:`head_norm` (W)."""
        return self.weight / head_norm(self.weight)

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
