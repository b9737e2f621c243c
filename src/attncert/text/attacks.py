"""l2 PGD on embeddings and the soundness audit of text certificates.

:func:`pgd_embeddings` reuses :func:`attncert.attacks.pgd_l2`, which works in the pixel box
[0, 1], through an affine change of variables: with S_i = 2 eps_i per sample,

    u = 1/2 + (e' - e) / S_i,   ||e' - e||_F <= eps_i  <=>  ||u - 1/2||_F <= 1/2,

and ||u - 1/2||_F <= 1/2 implies every coordinate of u lies in [0, 1], so the box never
binds: PGD on g(u) = f(e + S (u - 1/2)) from u = 1/2 with radius 1/2 is exactly l2 PGD on the
embeddings with radius eps (same normalised steps, same 2.5 eps / steps default step size).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from attncert.attacks import (
    attack_by_radius,
    attack_copy,
    confirm_l2,
    eager_fallback,
    pgd_l2,
)
from attncert.pipeline import rng
from attncert.pipeline.batching import BatchSize, in_batches
from attncert.training.precision import attack_matmuls


def pgd_embeddings(f: Callable[[Tensor], Tensor], e: Tensor, y: Tensor, eps: float | Tensor,
                   steps: int = 100, restarts: int = 10, loss: str = "margin",
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Untargeted l2 PGD in embedding space: max over ||e' - e||_F <= eps of ``loss``.

    ``f``: embeddings (B, L, dim) -> logits (e.g. ``lambda e: model(e, mask)``); ``eps``: a
    float or (B,). Returns (e_adv, success) as :func:`attncert.attacks.pgd_l2` does (success:
    f(e_adv) does not predict y; a clean misclassification counts, with e_adv = e).
    """
    e = e.detach()
    scale = torch.as_tensor(eps, dtype=e.dtype, device=e.device).expand(len(e)) * 2.0
    scale = scale.reshape(-1, *([1] * (e.dim() - 1)))
    centre = torch.full_like(e, 0.5)

    def g(u: Tensor) -> Tensor:
        return f(e + scale * (u - 0.5))

    u_adv, success = pgd_l2(g, centre, y, 0.5, steps, restarts, loss=loss, generator=generator)
    return e + scale * (u_adv - 0.5), success


@torch.no_grad()
def audit_embeddings(model, ids: Tensor, mask: Tensor, y: Tensor, radius: Tensor,
                     eps_grid: Sequence[float], steps: int = 100, restarts: int = 10,
                     seed: int = 0, batch_size: int = 100) -> list[dict]:
    """PGD on the embeddings at every eps: empirical robust accuracy and the soundness audit.

    ``model``: a text model of :mod:`attncert.text.models` (``embed``, ``model(e, mask)``);
    ``radius``: (N,) certified radii. A PGD success on a correctly classified point with
    radius >= eps is a broken certificate (a soundness bug). PGD runs on a float32 copy of
    the model; a success counts only when ``model`` itself, in the embeddings' dtype,
    misclassifies the candidate inside the eps-ball (:func:`attncert.attacks.confirm_l2`).

    The radii run in ascending order, and each attacks only the sentences still standing: a
    misclassified sentence is not attacked (it counts as a success, as
    :func:`attncert.certify.audit` counts it), and an adversarial example found at a smaller eps
    lies inside every larger ball, so its sentence counts as a success there without another
    attack (robust accuracy never grows with eps). Every certificate is still attacked at every
    eps it claims, unless an attack already broke it at a smaller one. One row per eps, in the
    order of ``eps_grid``: ``robust_acc`` (correct and no adversarial example found),
    ``certified_acc`` (correct and radius >= eps), ``attacked`` (the sentences PGD ran on at
    that eps) and ``broken``. The sentences are attacked ``batch_size`` at a time, a batch
    grown on a GPU once for every eps (:class:`attncert.pipeline.batching.BatchSize`).
    """
    g = rng.generator(seed, ids.device)
    correct = torch.cat([model(ids[i:i + batch_size], mask[i:i + batch_size]).argmax(1).cpu()
                         for i in range(0, len(y), batch_size)]) == y.cpu()
    attacker = attack_copy(model)  # float32; every success is confirmed on ``model``
    size = BatchSize(batch_size, "text PGD audit", ids.device)  # grown once, for every eps

    def attack(eps: float, idx: Tensor) -> Tensor:
        def part(a: int, b: int) -> Tensor:
            sub = idx[a:b].to(ids.device)
            m, yb = mask[sub], y[sub]
            e = model.embed(ids[sub], m)

            def pgd() -> Tensor:
                with torch.enable_grad(), attack_matmuls(e.device):
                    return pgd_embeddings(lambda z: attacker(z, m), e.float(), yb, eps, steps,
                                          restarts, generator=g)[0]

            e_adv = eager_fallback(pgd, attacker, g)
            _, ok = confirm_l2(lambda z: model(z, m), e, e_adv, yb, eps, box=False)
            return ok.cpu()

        return torch.cat(in_batches(len(idx), size, part))

    rows = []
    for eps, (attacked, fooled) in zip(eps_grid, attack_by_radius(correct, eps_grid, attack),
                                       strict=True):
        cert = correct & (radius.cpu() >= eps)
        rows.append({"eps": float(eps), "attacked": attacked,
                     "robust_acc": float((~fooled).double().mean()),
                     "certified_acc": float(cert.double().mean()),
                     "broken": int((fooled & cert).sum())})
    return rows
