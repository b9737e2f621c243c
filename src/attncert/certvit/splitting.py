"""CertViT's Algorithms 1 and 2 on one layer: the Douglas-Rachford splitting
(:func:`douglas_rachford`, soft-thresholding as the l1 prox) and the projection onto the
output-deviation constraint set by Haugazeau's method (:func:`project_outputs`). The method and
its references are in :mod:`attncert.certvit.douglas_rachford`."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DRConfig:
    """Settings of :func:`constrain`.

    threshold: tau, relative to the RMS of the layer's weight entries (DR's step on ||.||_1);
    eta: tolerance on the RMS output deviation per mini-batch, relative to the RMS norm of
    the layer's recorded outputs ||W0 x_k||; relaxation: lambda in (0, 2); iterations:
    Douglas-Rachford steps; batch_size: recorded pairs per constraint set C_B; max_pairs:
    recorded pairs kept per layer (a random subset of the tokens); projection_steps: most
    Haugazeau steps per projection; tol: the projection stops once every c_B <= tol * eta,
    DR once ||Z_{n+1} - Z_n|| <= tol ||Z_n||; seed: the token subset.
    """

    threshold: float = 0.05
    eta: float = 0.05
    relaxation: float = 1.0
    iterations: int = 30
    batch_size: int = 256
    max_pairs: int = 8192
    projection_steps: int = 100
    tol: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("iterations", "batch_size", "max_pairs", "projection_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DRConfig.{name} must be a positive int, got {v!r}")
        for name in ("threshold", "eta", "tol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"DRConfig.{name} must be a number > 0, got {v!r}")
        if not 0 < self.relaxation < 2:
            raise ValueError(f"DRConfig.relaxation must be in (0, 2), got {self.relaxation!r}")


def soft_threshold(w: Tensor, tau: float) -> Tensor:
    """prox of tau ||.||_1: sign(w) max(|w| - tau, 0), entrywise."""
    return torch.sign(w) * (w.abs() - tau).clamp_min(0.0)


def haugazeau(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """Q(x, y, z): the projection of x onto {u : <u - y, x - y> <= 0} cap {u : <u - z, y - z> <= 0}.

    Haugazeau's formula (Bauschke & Combettes, ch. 29): with pi = <x - y, y - z>, mu = ||x - y||^2,
    nu = ||y - z||^2, rho = mu nu - pi^2 (>= 0),
        Q = z                                        if rho = 0 and pi >= 0,
        Q = x + (1 + pi / nu) (z - y)                if rho > 0 and pi nu >= rho,
        Q = y + (nu / rho) (pi (x - y) + mu (z - y))  if rho > 0 and pi nu < rho.
    (rho = 0 and pi < 0 means the intersection is empty; z is returned, the caller's sets
    are never disjoint.) rho below 1e-12 mu nu counts as 0 (round-off of parallel vectors).
    """
    xy, yz = x - y, y - z
    pi, mu, nu = float((xy * yz).sum()), float(xy.pow(2).sum()), float(yz.pow(2).sum())
    rho = mu * nu - pi * pi
    if nu == 0.0 or rho <= 1e-12 * mu * nu:
        return z
    if pi * nu >= rho:
        return x - (1.0 + pi / nu) * yz
    return y + (nu / rho) * (pi * xy - mu * yz)


@dataclass(frozen=True)
class ProjectionInfo:
    """steps: Haugazeau steps taken; violation: max_B c_B of the result (<= 0: feasible);
    converged: violation <= tol * eta."""

    steps: int
    violation: float
    converged: bool


def _batch_deviation(delta: Tensor, xb: Tensor) -> Tensor:
    """(nb, bs, out): X_B (W - W0)^T for every mini-batch, delta = W - W0."""
    return xb @ delta.T


def project_outputs(z: Tensor, w0: Tensor, xb: Tensor, eta: float, steps: int = 100,
                    tol: float = 1e-3) -> tuple[Tensor, ProjectionInfo]:
    """Algorithm 2: P_C(z), C = {W : ||X_B (W - W0)^T||_F / sqrt(|B|) <= eta for every B}.

    z, w0: (out, in); xb: (nb, bs, in) recorded inputs in nb mini-batches; eta: absolute.
    Haugazeau's method with one extrapolated parallel subgradient projection over all
    violated mini-batches per step (module docstring). Stops when max_B c_B <= tol * eta or
    after ``steps`` steps. All mini-batches are handled in batched products (on a device the
    nb constraints are evaluated in parallel); one step costs O(nb bs in out) operations
    and nb x out x in memory.
    """
    bs = xb.shape[1]
    root = math.sqrt(bs)
    y, step = z.clone(), 0
    while True:
        dev = _batch_deviation(y - w0, xb)  # (nb, bs, out)
        norm = dev.flatten(1).norm(dim=1)  # ||X_B (y - W0)^T||_F
        c = norm / root - eta
        worst = float(c.max())
        if worst <= tol * eta or step == steps:
            return y, ProjectionInfo(step, worst, worst <= tol * eta)
        v = c > 0
        nv, cv = norm[v], c[v]
        m = dev[v].transpose(1, 2) @ xb[v]  # (nv, out, in): D_B^T X_B = sqrt(bs) ||D_B|| g_B
        g2 = m.flatten(1).pow(2).sum(1) / (bs * nv * nv)  # ||g_B||^2
        w = 1.0 / int(v.sum())
        # sum_B w (p_B - y), p_B - y = -(c_B / ||g_B||^2) g_B
        step_sum = torch.einsum("b,boi->oi", -w * cv / (g2 * root * nv), m)
        extrapolation = float(w * (cv * cv / g2).sum()) / float(step_sum.pow(2).sum())
        y = haugazeau(z, y, y + extrapolation * step_sum)
        step += 1


def _batches(x: Tensor, batch_size: int) -> Tensor:
    """(K, in) -> (nb, bs, in): consecutive mini-batches; a remainder < bs is dropped."""
    bs = min(batch_size, x.shape[0])
    nb = x.shape[0] // bs
    return x[: nb * bs].reshape(nb, bs, x.shape[1])


def _rms_rows(t: Tensor) -> float:
    return float(t.pow(2).sum(-1).mean().sqrt())


def douglas_rachford(w0: Tensor, x: Tensor, config: DRConfig,
                     prox: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, dict]:
    """Algorithm 1 on one layer: (sparse weight (out, in), diagnostics).

    w0: the layer's weight (out, in); x: its recorded inputs (K, in), already shuffled.
    ``prox``: the proximal step in place of soft-thresholding (None: the l1 objective with
    tau = threshold x RMS weight). The projection onto a closed convex set S (e.g. a
    spectral-norm ball, :func:`attncert.certvit.spectral.clip_spectral`) is the prox of its
    indicator: DR then seeks a point of S cap C, and the result prox(Z) always lies in S
    (when S and C do not meet, it tends to a point of S nearest C: Bauschke, Combettes &
    Luke 2004, "Finding best approximation pairs relative to two closed convex sets").
    Computed in float64 on x's device; the result has w0's dtype and device. Diagnostics:
    spectral norms before/after (exact SVD), the output deviation of the result (max over
    mini-batches of the RMS deviation, relative to the RMS output norm; eta for comparison),
    sparsity (fraction of zero entries), DR iterations, Haugazeau steps, seconds.
    """
    t0 = time.perf_counter()
    w0d = w0.detach().to(device=x.device, dtype=torch.float64)
    xb = _batches(x.to(torch.float64), config.batch_size)
    out_rms = _rms_rows(x.to(torch.float64) @ w0d.T)
    eta = config.eta * out_rms
    if prox is None:
        tau = config.threshold * float(w0d.pow(2).mean().sqrt())

        def prox(w: Tensor) -> Tensor:
            return soft_threshold(w, tau)
    z = w0d.clone()
    proj_steps, iterations = 0, 0
    while iterations < config.iterations:
        p = prox(z)
        w, info = project_outputs(2 * p - z, w0d, xb, eta, config.projection_steps, config.tol)
        proj_steps += info.steps
        iterations += 1
        step = config.relaxation * (w - p)
        z = z + step
        if float(step.norm()) <= config.tol * float(z.norm()):
            break
    result = prox(z)
    dev = _batch_deviation(result - w0d, xb).flatten(1).norm(dim=1) / math.sqrt(xb.shape[1])
    diag = {
        "shape": tuple(w0.shape), "pairs": int(xb.shape[0] * xb.shape[1]),
        "sigma_before": float(torch.linalg.matrix_norm(w0d, 2)),
        "sigma_after": float(torch.linalg.matrix_norm(result, 2)),
        "deviation": float(dev.max()) / out_rms if out_rms > 0 else 0.0, "eta": config.eta,
        "sparsity": float((result == 0).double().mean()),
        "dr_iterations": iterations, "projection_steps": proj_steps,
        "seconds": time.perf_counter() - t0,
    }
    return result.to(dtype=w0.dtype, device=w0.device), diag
