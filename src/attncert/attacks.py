"""Untargeted evasion attacks in pixel space [0, 1]: PGD-L2, FGSM / PGD / CW-PGD in L_inf.

Every attack returns ``(x_adv, success)``: x_adv lies in the eps-ball around x (per sample)
and in the box [0, 1]; success[i] is True when model(x_adv[i]) does not predict y[i]. A
success is kept once found (over steps and restarts); a clean misclassification counts as
a success with x_adv = x. Unsuccessful samples get their highest-loss iterate. The model is
used as given (call ``model.eval()`` first); gradients are taken w.r.t. the input only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.pipeline import rng

LOSSES = ("ce", "margin")
#: what an attack runs: a module or a function of the input batch (the logits)
Model = nn.Module | Callable[[Tensor], Tensor]


def _per_sample(eps: float | Tensor, x: Tensor) -> Tensor:
    """eps as a (B, 1, ..., 1) tensor broadcasting against x."""
    e = torch.as_tensor(eps, dtype=x.dtype, device=x.device)
    e = e.expand(x.shape[0]) if e.dim() == 0 else e
    return e.reshape(-1, *([1] * (x.dim() - 1)))


def _flat_norm(t: Tensor) -> Tensor:
    return t.flatten(1).norm(dim=1).reshape(-1, *([1] * (t.dim() - 1)))


def attack_loss(logits: Tensor, y: Tensor, kind: str) -> Tensor:
    """(B,) loss to ASCEND: "ce" cross-entropy, "margin" max_{j != y} f_j - f_y (CW)."""
    if kind == "ce":
        return F.cross_entropy(logits, y, reduction="none")
    true = logits.gather(1, y[:, None]).squeeze(1)
    other = logits.masked_fill(F.one_hot(y, logits.shape[1]).bool(), float("-inf"))
    return other.max(dim=1).values - true


def project(delta: Tensor, x: Tensor, eps: Tensor, norm: str) -> Tensor:
    """Onto the eps-ball (l2 or linf), then into the box: x + delta in [0, 1].

    Clamping to the box only shrinks each coordinate of delta (x is in the box), so the
    result stays in the ball.
    """
    if norm == "l2":
        delta = delta * torch.clamp(eps / _flat_norm(delta).clamp_min(1e-12), max=1.0)
    else:
        delta = torch.maximum(torch.minimum(delta, eps), -eps)
    return (x + delta).clamp(0.0, 1.0) - x


def _random_start(x: Tensor, eps: Tensor, norm: str, g: torch.Generator | None) -> Tensor:
    """Drawn on x's device with ``g`` (a generator on that device, see attncert.pipeline.rng)."""
    if norm == "l2":  # uniform in the l2 ball
        d = torch.randn(x.shape, generator=g, device=x.device, dtype=x.dtype)
        u = torch.rand(x.shape[0], generator=g, device=x.device, dtype=x.dtype)
        r = u.pow(1.0 / x[0].numel()).reshape_as(eps)
        return d / _flat_norm(d).clamp_min(1e-12) * eps * r
    u = torch.rand(x.shape, generator=g, device=x.device, dtype=x.dtype)
    return (2 * u - 1) * eps


def pgd(model: Model, x: Tensor, y: Tensor, eps: float | Tensor, norm: str, steps: int,
        restarts: int = 1, step_size: float | Tensor | None = None, loss: str = "margin",
        random_start: bool = True, generator: torch.Generator | None = None
        ) -> tuple[Tensor, Tensor]:
    """Projected gradient ascent of ``loss`` over the eps-ball (``norm`` "l2" | "linf") and box.

    Step: l2 normalised gradient, linf sign of the gradient; default step size 2.5 eps / steps.
    """
    if norm not in ("l2", "linf") or loss not in LOSSES:
        raise ValueError(f"norm must be l2|linf and loss ce|margin, got {norm!r}, {loss!r}")
    rng.check(generator, x.device, "pgd random starts")
    x, y = x.detach(), y.detach()
    e = _per_sample(eps, x)
    alpha = 2.5 * e / steps if step_size is None else _per_sample(step_size, x)
    with torch.no_grad():
        logits = model(x)
        success = logits.argmax(1) != y
        best_loss = attack_loss(logits, y, loss)
    best = x.clone()

    def record(cand: Tensor, logits: Tensor) -> None:
        nonlocal success, best_loss
        fooled = logits.argmax(1) != y
        value = attack_loss(logits, y, loss)
        take = (fooled & ~success) | (~success & ~fooled & (value > best_loss))
        # a select, not best[take] = ...: boolean-mask indexing waits for the device
        best.copy_(torch.where(take.reshape(-1, *([1] * (best.dim() - 1))), cand, best))
        best_loss = torch.where(take, value, best_loss)
        success = success | fooled

    for restart in range(restarts):
        delta = _random_start(x, e, norm, generator) if random_start else torch.zeros_like(x)
        delta = project(delta, x, e, norm)
        for _ in range(steps):
            delta.requires_grad_(True)
            with torch.enable_grad():
                logits = model(x + delta)
                (grad,) = torch.autograd.grad(attack_loss(logits, y, loss).sum(), delta)
            with torch.no_grad():
                record(x + delta, logits.detach())
                if norm == "l2":
                    step = grad / _flat_norm(grad).clamp_min(1e-12)
                else:
                    step = grad.sign()
                delta = project(delta.detach() + alpha * step, x, e, norm)
        with torch.no_grad():
            record(x + delta, model(x + delta))
        if restart + 1 < restarts and bool(success.all()):  # a host sync: only between restarts
            break
    return best.detach(), success


def pgd_l2(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor, steps: int = 100,
           restarts: int = 10, step_size: float | Tensor | None = None, loss: str = "margin",
           generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """L2 PGD with random starts in the ball (the audit attack for L2 certificates)."""
    return pgd(model, x, y, eps, "l2", steps, restarts, step_size, loss, True, generator)


def fgsm_linf(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor
              ) -> tuple[Tensor, Tensor]:
    """FGSM: one signed CE-gradient step of size eps from x (SpecFormer's FGSM)."""
    return pgd(model, x, y, eps, "linf", 1, 1, eps, "ce", False, None)


def pgd_linf(model: Model, x: Tensor, y: Tensor, eps: float | Tensor, steps: int = 20,
             restarts: int = 1, step_size: float | Tensor | None = None, loss: str = "ce",
             random_start: bool = True, generator: torch.Generator | None = None
             ) -> tuple[Tensor, Tensor]:
    """L_inf PGD on CE (SpecFormer's PGD-2 / PGD-20: steps = 2 / 20)."""
    return pgd(model, x, y, eps, "linf", steps, restarts, step_size, loss, random_start,
               generator)


def cw_linf(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor, steps: int = 20,
            restarts: int = 1, step_size: float | Tensor | None = None,
            generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """CW-20: L_inf PGD on the CW margin loss max_{j != y} f_j - f_y."""
    return pgd(model, x, y, eps, "linf", steps, restarts, step_size, "margin", True, generator)


# -- audits: attack in float32, count a success only when the certified model confirms it ----


def attack_copy(model: nn.Module, dtype: torch.dtype = torch.float32, mode: str | None = None
                ) -> nn.Module:
    """``model`` itself if its floating parameters and buffers are ``dtype``, else a copy in
    ``dtype`` to attack with (an attack is a lower bound: its precision changes its strength,
    never the soundness of the comparison, see :func:`confirm_l2`). The copy's forward pass
    runs compiled per ``base.compile`` (``mode``: another; :func:`attncert.training.compiled.
    compile_attack_model`: CUDA graphs on a GPU under ``auto``, eager on a CPU); the model
    itself is never changed."""
    import copy

    from attncert.training import compiled

    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    if all(t.dtype == dtype for t in tensors):
        return model
    attacker = copy.deepcopy(model).to(dtype).requires_grad_(False)  # gradients: input only
    compiled.compile_attack_model(attacker, tensors[0].device, mode)
    return attacker


@torch.no_grad()
def confirm_l2(f, x: Tensor, x_adv: Tensor, y: Tensor, eps: float | Tensor, box: bool = True
               ) -> tuple[Tensor, Tensor]:
    """Re-check attack candidates in x's precision (float64 for a certificate).

    ``x_adv`` (any dtype, e.g. found by a float32 attack) is brought to x's dtype, into the box
    [0, 1] (``box``) and into the closed l2 ball of radius eps around x; the norm is computed
    again in x's dtype and a candidate still outside by rounding counts as no success.
    Returns (x_adv', success): success[i] when ``f(x_adv'[i])`` does not predict y[i] and
    ||x_adv'[i] - x[i]|| <= eps[i], so a success is an adversarial example of ``f`` itself.
    """
    e = _per_sample(eps, x)
    cand = x_adv.detach().to(x.dtype)
    if box:
        cand = cand.clamp(0.0, 1.0)
    d = cand - x
    d = d * torch.clamp(e / _flat_norm(d).clamp_min(torch.finfo(x.dtype).tiny), max=1.0)
    d = torch.where(_flat_norm(d) > e, d * (1.0 - 64 * torch.finfo(x.dtype).eps), d)
    cand = x + d
    if box:
        cand = cand.clamp(0.0, 1.0)
    inside = (_flat_norm(cand - x) <= e).flatten()
    return cand, inside & (f(cand).argmax(1) != y)


def verified_pgd_l2(model: nn.Module, x: Tensor, y: Tensor, eps: float | Tensor,
                    steps: int = 100, restarts: int = 10,
                    generator: torch.Generator | None = None,
                    attack_model: nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """L2 PGD on ``attack_model`` (default: :func:`attack_copy` of ``model``, float32; TF32
    matmuls on CUDA), each result confirmed on ``model`` in x's dtype by :func:`confirm_l2`:
    the soundness audit of a float64 certificate at float32 attack cost. Returns (x_adv in
    x's dtype, success)."""
    from attncert.training.precision import attack_matmuls

    attack_model = attack_copy(model) if attack_model is None else attack_model
    dtype = next(t for t in attack_model.parameters() if t.is_floating_point()).dtype

    def attack():
        with attack_matmuls(x.device):
            return pgd_l2(attack_model, x.to(dtype), y, eps, steps, restarts,
                          generator=generator)[0]

    return confirm_l2(model, x, eager_fallback(attack, attack_model, generator), y, eps)


def attack_by_radius(correct: Tensor, eps_grid: Sequence[float],
                     attack: Callable[[float, Tensor], Tensor]) -> list[tuple[int, Tensor]]:
    """The PGD audits' order (:func:`attncert.certify.audit`,
    :func:`attncert.text.attacks.audit_embeddings`): the radii of ``eps_grid`` in ascending
    order, ``attack(eps, idx)`` at each returning (len(idx),) bool successes for the host
    indices ``idx`` of the points still standing: correctly classified (``correct``, (N,) bool
    on the host) and with no adversarial example found at a smaller radius, which lies inside
    every larger ball and so counts there without another attack (robust accuracy never grows
    with eps; a certificate is attacked at every radius it claims unless one already broke
    it). Per entry of ``eps_grid``, in its order: (the points attacked there, (N,) bool: an
    adversarial example within that radius is known, or the point is misclassified)."""
    fooled = ~correct
    out: dict[int, tuple[int, Tensor]] = {}
    for i in sorted(range(len(eps_grid)), key=lambda i: float(eps_grid[i])):
        idx = (~fooled).nonzero().flatten()
        fooled = fooled.clone()
        if len(idx):
            fooled[idx] = attack(float(eps_grid[i]), idx)
        out[i] = (len(idx), fooled)
    return [out[i] for i in range(len(eps_grid))]


def eager_fallback(attack: Callable[[], Any], attack_model: nn.Module,
                   generator: torch.Generator | None) -> Any:
    """``attack()``; when it fails on ``attack_model`` compiled (:func:`attack_copy`), again
    with the model eager from here on (named on the console) and ``generator`` reset to where
    it was, so the same random starts: a capture problem never stops a stage. An eager failure
    and running out of memory (the batch loop halves the batch,
    :mod:`attncert.pipeline.batching`) are raised."""
    from attncert.training import compiled

    state = generator.get_state() if generator is not None else None
    try:
        return attack()
    except torch.OutOfMemoryError:
        raise
    except Exception as exc:
        if not compiled.uncompile(attack_model):
            raise
        print(f"base.compile: the attack model runs eager from here on (compiled: "
              f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]})",
              flush=True)
        if state is not None:
            generator.set_state(state)
        return attack()
