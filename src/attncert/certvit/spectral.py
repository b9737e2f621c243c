"""Certifiable constraining of an adapted ViT: a spectral-norm ball per linear map.

CertViT's Douglas-Rachford (:mod:`attncert.certvit.douglas_rachford`) minimises ||W||_1
close to the pre-trained outputs: it sparsifies but barely lowers spectral norms, and the
certificate multiplies spectral norms. Here the same splitting keeps the paper's pipeline
(pre-trained ViT, L2 attention, weights constrained close to the pre-trained ones, fine-tune)
with constraint sets that bound the certificate directly:

* every linear map lies in a spectral-norm ball with its own budget (:class:`Budgets`):
  the patch embedding composed with the input normalisation, ||E|| L(normalize) <= embed;
  every head's query map ||W^{Q,l}|| <= q and value map ||W^{V,l}|| <= v; ||W^O|| <= o;
  ||W_1|| <= fc1, ||W_2|| <= fc2 in every MLP; every norm slot's gain max|gamma| <= gain
  (CenterNorm's D/(D-1) included);
* the prox of a ball's indicator is the projection onto it, SVD clipping
  (:func:`clip_spectral`: W = U S V^T -> U min(S, budget) V^T, the nearest point of the ball
  in ||.||_F). Inside Douglas-Rachford it replaces soft-thresholding
  (:func:`constrain_spectral`), so each map ends in its ball as close to the pre-trained
  outputs on training tokens as the splitting gets;
* the fine-tune projects every map back into its set after each optimiser step
  (:func:`projected`), so the sets' bound (:func:`budget_bound`) holds for every iterate and
  for the final model.

The certificate never relies on the projection: :func:`attncert.certvit.global_bound` reads
the final weights. :func:`budget_bound` is the bound every model in the sets satisfies
(each factor of ``global_bound`` at its budget), used for the Lipschitz-margin loss.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from attncert.bounds import GELU_LIPSCHITZ
from attncert.certvit.adapt import ProjectNorm, pool_lipschitz
from attncert.certvit.douglas_rachford import DRConfig, DRResult, Site, constrain
from attncert.layers import CenterNorm, L2MultiHeadAttention
from attncert.layers.attention_variants import l2_attention_domain_constant
from attncert.models.vit import ViT

__all__ = [
    "Budgets",
    "MapSet",
    "budget_bound",
    "clip_spectral",
    "constrain_spectral",
    "map_sets",
    "project_",
    "projected",
]


@dataclass(frozen=True)
class Budgets:
    """Spectral-norm budget of every map (module docstring); all > 0."""

    embed: float = 1.0
    q: float = 0.5
    v: float = 0.5
    o: float = 1.0
    fc1: float = 1.0
    fc2: float = 1.0
    gain: float = 1.0

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"Budgets.{f.name} must be a number > 0, got {v!r}")


@dataclass(frozen=True)
class MapSet:
    """One constraint set: the parameter ``param`` split into ``blocks`` equal row blocks,
    each of spectral norm <= ``budget`` (kind "spectral"), or entries |w| <= ``budget``
    (kind "gain", a norm slot's gamma)."""

    param: str
    budget: float
    blocks: int = 1
    kind: str = "spectral"


def clip_spectral(w: Tensor, budget: float, blocks: int = 1) -> Tensor:
    """Projection of w (out, in) onto {every one of ``blocks`` row blocks has ||.||_2 <= budget}.

    Per block W = U S V^T -> U min(S, budget) V^T: the nearest point in ||.||_F (the norm is
    unitarily invariant and the ball's constraint acts on the singular values only;
    separable over blocks). Computed in float64, returned in w's dtype and device.
    """
    out, inp = w.shape
    if out % blocks:
        raise ValueError(f"{out} rows do not split into {blocks} blocks")
    wb = w.detach().double().reshape(blocks, out // blocks, inp)
    u, s, vh = torch.linalg.svd(wb, full_matrices=False)
    clipped = (u * s.clamp(max=budget).unsqueeze(-2)) @ vh
    return clipped.reshape(out, inp).to(dtype=w.dtype)


def map_sets(model: ViT, budgets: Budgets) -> list[MapSet]:
    """The constraint sets of an adapted ViT (module docstring), in forward order."""
    if getattr(model, "adaptation", None) is None:
        raise ValueError("expected a ViT adapted by attncert.certvit.adapt")
    sets = [MapSet("embed.proj.weight", budgets.embed / model.normalize.compute_lipschitz())]
    for name, m in model.named_modules():
        if isinstance(m, ProjectNorm):
            sets.append(MapSet(f"{name}.weight", budgets.gain, kind="gain"))
        elif isinstance(m, CenterNorm) and m.weight is not None:
            sets.append(MapSet(f"{name}.weight", budgets.gain / m.scale, kind="gain"))
        elif isinstance(m, L2MultiHeadAttention):
            sets += [MapSet(f"{name}.q.weight", budgets.q, m.heads),
                     MapSet(f"{name}.v.weight", budgets.v, m.heads),
                     MapSet(f"{name}.o.weight", budgets.o)]
        elif name.endswith(".mlp.fc1") or name.endswith(".mlp.fc2"):
            sets.append(MapSet(f"{name}.weight", getattr(budgets, name.rsplit(".", 1)[1])))
    return sets


@torch.no_grad()
def project_(model: ViT, sets: list[MapSet]) -> ViT:
    """Project every parameter of ``sets`` onto its set, in place (returned for chaining)."""
    params = dict(model.named_parameters())
    for s in sets:
        p = params[s.param]
        if s.kind == "gain":
            p.clamp_(-s.budget, s.budget)
        else:
            p.copy_(clip_spectral(p, s.budget, s.blocks))
    return model


@contextlib.contextmanager
def projected(model: ViT, sets: list[MapSet]) -> Iterator[ViT]:
    """Inside the ``with`` block, every optimiser step that updates ``model`` is followed by
    :func:`project_` (a global optimiser step hook, removed on exit): the model stays in its
    sets at every step of :func:`attncert.training.train.train` and in every checkpoint."""
    ids = {id(p) for p in model.parameters()}

    def hook(optimizer, _args, _kwargs) -> None:
        if any(id(p) in ids for g in optimizer.param_groups for p in g["params"]):
            project_(model, sets)

    project_(model, sets)
    handle = register_optimizer_step_post_hook(hook)
    try:
        yield model
    finally:
        handle.remove()


def constrain_spectral(model: ViT, images: Tensor, budgets: Budgets,
                       config: DRConfig | None = None, progress: bool = False) -> DRResult:
    """Douglas-Rachford on every linear map but the head, the prox being the projection onto
    the map's spectral ball (:func:`clip_spectral`; per head for W^Q, whose sites are whole
    maps, and for W^V, whose sites are heads). ``model`` is unchanged; apply the result and
    then :func:`project_` (the norm gains are not linear sites)."""
    by_param = {s.param: s for s in map_sets(model, budgets) if s.kind == "spectral"}

    def prox_for(site: Site) -> Callable[[Tensor], Tensor]:
        s = by_param.get(f"{site.module}.weight")
        if s is None:
            raise ValueError(f"{site.module}: no spectral budget for this map")
        blocks = 1 if site.rows is not None else s.blocks
        return lambda w: clip_spectral(w, s.budget, blocks)

    return constrain(model, images, config, include=[k[:-len(".weight")] for k in by_param],
                     progress=progress, prox_for=prox_for)


def budget_bound(model: ViT, budgets: Budgets) -> float:
    """The features' bound of :func:`attncert.certvit.global_bound` with every factor at its
    budget: no model in the sets exceeds it (the attention's constant with c_l <= q^2 v,
    ||W^O|| <= o; :meth:`attncert.layers.L2MultiHeadAttention.lipschitz_bound`)."""
    from attncert.bounds import kim_l2_attention_lipschitz

    cfg = model.config
    n, dh = cfg.n_tokens, cfg.dim // cfg.heads
    eye = torch.eye(dh, dtype=torch.float64)[None]
    k_n = kim_l2_attention_lipschitz(eye, eye, eye[0], n)
    b = budgets
    mlp = b.fc2 * GELU_LIPSCHITZ * b.fc1
    total = b.embed * b.gain * pool_lipschitz(model)
    for blk in model.blocks:
        k = k_n
        if isinstance(blk.norm_attn, ProjectNorm):  # inputs within R gain of beta
            r = torch.tensor([float(blk.norm_attn.radius) * b.gain * b.q], dtype=torch.float64)
            k = min(k_n, float(l2_attention_domain_constant(n, r, dh)[0]))
        attn = k * math.sqrt(cfg.heads) * b.q * b.q * b.v * b.o
        if blk.form == "stream":
            total *= b.gain * (1 + attn) * (1 + b.gain * mlp)
        else:
            total *= (1 + b.gain * attn) * (1 + b.gain * mlp)
    return total

