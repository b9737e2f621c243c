"""PGD lower bounds on the local sensitivity and on LoFAST's pieces (docs/math.md section 2).

Projected gradient ASCENT over the Frobenius ball ||G||_F <= eps (per sample), normalised
gradient steps, several restarts; the best value seen over all steps and restarts is
returned. Any feasible G gives a lower bound, so an upper bound below it is a bug.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .lofast import as_eps
from .spectral import LinearOperator, spectral_norm
from .weights import AttentionWeights, attention_forward, attention_probs

__all__ = ["pgd_sensitivity"]


def _objective(target: str, x: Tensor, w: AttentionWeights, residual: bool, head: int | None):
    """Return f(G) -> (R B,) for the chosen target, with x already repeated over restarts."""
    if target == "F":
        ref = attention_forward(x, w, residual)

        def f(g: Tensor) -> Tensor:
            return (attention_forward(x + g, w, residual) - ref).flatten(1).norm(dim=-1)

        return f, lambda z: attention_forward(z, w, residual)
    if head is None:
        if w.h != 1:
            raise ValueError(f"target {target!r} needs head= for {w.h} heads")
        head = 0
    w1 = w.head(head)
    if target == "delta21":
        ref = attention_probs(x, w1)[:, 0]

        def f(g: Tensor) -> Tensor:
            return (attention_probs(x + g, w1)[:, 0] - ref).flatten(1).norm(dim=-1)

        return f, lambda z: attention_probs(z, w1)[:, 0]
    if target == "delta22":
        a = w1.A[0]

        def f(g: Tensor) -> Tensor:
            return torch.linalg.matrix_norm((x + g) @ a, 2)

        return f, None
    raise ValueError(f"target must be 'F', 'delta21' or 'delta22', not {target!r}")


def _jacobian_direction(fn, x: Tensor, generator) -> Tensor:
    """Top right singular vector of the Jacobian of fn at x (Lanczos, matrix-free jvp/vjp)."""
    x = x.detach()
    _, vjp_fn = torch.func.vjp(fn, x)
    op = LinearOperator(
        apply=lambda g: torch.func.jvp(fn, (x,), (g,))[1],
        adjoint=lambda y: vjp_fn(y)[0],
        batch_shape=(x.shape[0],),
        in_shape=tuple(x.shape[1:]),
        dtype=x.dtype,
        device=x.device,
    )
    with torch.no_grad():
        res = spectral_norm(op, mode="estimate", tol=1e-3, max_iter=40, generator=generator)
    return res.vector


def _project(g: Tensor, eps: Tensor) -> Tensor:
    norm = g.flatten(1).norm(dim=-1).clamp_min(torch.finfo(g.dtype).tiny)
    return g * (eps / norm).clamp(max=1.0).view(-1, *([1] * (g.dim() - 1)))


def pgd_sensitivity(
    x: Tensor,
    w: AttentionWeights,
    eps: float | Tensor,
    residual: bool,
    target: str = "F",
    steps: int = 100,
    restarts: int = 4,
    step_size: float = 0.25,
    head: int | None = None,
    generator: torch.Generator | None = None,
    jacobian_init: bool = True,
) -> Tensor:
    """(B,) lower bound on max_{||G||_F <= eps} of ||F(X+G) - F(X)||_F (target "F"),
    ||P(X+G) - P(X)||_F (target "delta21", one head) or ||(X+G) A|| (target "delta22").

    Restarts run batched: restart 0 starts on the sphere along the top Jacobian singular
    direction when jacobian_init (restart 1 along its negative), the others at random on the
    sphere (even restarts) or uniformly inside the ball (odd). Steps are normalised gradient
    steps of length step_size * eps, decayed by a cosine schedule to 2% of it.
    """
    x = x.detach()
    w = w.like(x).to(device=x.device)
    w = type(w)(*(t.detach() for t in (w.wq, w.wk, w.wv, w.wo)))
    bsz = x.shape[0]
    e = as_eps(eps, x)
    xr = x.repeat(restarts, *([1] * (x.dim() - 1)))
    er = e.repeat(restarts)
    f, fn = _objective(target, xr, w, residual, head)
    numel = x[0].numel()

    g = torch.randn(xr.shape, generator=generator, device=x.device, dtype=torch.float64).to(x.dtype)
    g = g / g.flatten(1).norm(dim=-1).view(-1, *([1] * (x.dim() - 1)))
    radius = torch.ones(restarts * bsz, dtype=x.dtype, device=x.device)
    inside = (torch.arange(restarts, device=x.device) % 2 == 1).repeat_interleave(bsz)
    u = torch.rand(restarts * bsz, generator=generator, device=x.device, dtype=torch.float64)
    radius = torch.where(inside, u.to(x.dtype) ** (1.0 / numel), radius)
    if jacobian_init and fn is not None and restarts >= 1:
        with torch.enable_grad():
            v = _jacobian_direction(fn, x, generator)
        v = v / v.flatten(1).norm(dim=-1).view(-1, *([1] * (x.dim() - 1)))
        g[:bsz] = v
        radius[:bsz] = 1.0
        if restarts >= 2:
            g[bsz : 2 * bsz] = -v
            radius[bsz : 2 * bsz] = 1.0
    g = g * (radius * er).view(-1, *([1] * (x.dim() - 1)))

    best = torch.full((restarts * bsz,), -math.inf, dtype=x.dtype, device=x.device)
    for t in range(steps + 1):
        g = g.detach().requires_grad_(True)
        with torch.enable_grad():
            val = f(g)
            grad = torch.autograd.grad(val.sum(), g)[0] if t < steps else None
        best = torch.maximum(best, val.detach())
        if grad is None:
            break
        lr = step_size * (0.02 + 0.98 * 0.5 * (1 + math.cos(math.pi * t / steps)))
        gn = grad.flatten(1).norm(dim=-1).clamp_min(torch.finfo(x.dtype).tiny)
        step = grad / gn.view(-1, *([1] * (x.dim() - 1)))
        g = _project(g.detach() + lr * er.view(-1, *([1] * (x.dim() - 1))) * step, er)
    return best.view(restarts, bsz).max(0).values
