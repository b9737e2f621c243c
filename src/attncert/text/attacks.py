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

from attncert.attacks import attack_copy, confirm_l2, eager_fallback, pgd_l2
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
    One row per eps: ``robust_acc``
    (correct and not broken by PGD), ``certified_acc`` (correct and radius >= eps),
    ``attacked`` and ``broken``. The sentences are attacked ``batch_size`` at a time, a batch
    grown on a GPU once for every eps (:class:`attncert.pipeline.batching.BatchSize`).
    """
    g = rng.generator(seed, ids.device)
    correct = torch.cat([model(ids[i:i + batch_size], mask[i:i + batch_size]).argmax(1).cpu()
                         for i in range(0, len(y), batch_size)]) == y.cpu()
    attacker = attack_copy(model)  # float32; every success is confirmed on ``model``
    size = BatchSize(batch_size, "text PGD audit", ids.device)  # grown once, for every eps
    rows = []
    for eps in eps_grid:
        def run(a: int, b: int, eps: float = float(eps)) -> Tensor:
            e, m, yb = model.embed(ids[a:b], mask[a:b]), mask[a:b], y[a:b]

            def attack() -> Tensor:
                with torch.enable_grad(), attack_matmuls(e.device):
                    return pgd_embeddings(lambda z: attacker(z, m), e.float(), yb, eps, steps,
                                          restarts, generator=g)[0]

            e_adv = eager_fallback(attack, attacker, g)
            _, ok = confirm_l2(lambda z: model(z, m), e, e_adv, yb, eps, box=False)
            return ok.cpu()

        success = (torch.cat(in_batches(len(y), size, run)) if len(y)
                   else torch.zeros(0, dtype=torch.bool))
        cert = correct & (radius.cpu() >= eps)
        rows.append({"eps": float(eps), "attacked": len(y),
                     "robust_acc": float((~success).double().mean()),
                     "certified_acc": float(cert.double().mean()),
                     "broken": int((success & cert).sum())})
    return rows
