"""The certificate's bound variants, one table (:data:`VARIANTS`): what each computes per
attention layer once per sample (its eps-independent terms), how it turns them into a bound on
the layer's output perturbation at eps, and how the cost model prices the terms. The
certificate (:mod:`attncert.certify`) and the cost model (:mod:`attncert.cost`) read this table
only, so a new variant is one entry here plus its tests; an unknown name fails where it is
asked for, never silently priced or skipped.

Variants (docs/math.md sections 1-4): ``lofast_M`` (LoFAST's Theorem 1 with ||M_l||, eq. 27),
``lofast_xi`` (eq. 28), ``naive`` (eq. 12 + delta2 with xi), ``specformer`` (SpecFormer's local
bound, computed at eps from the layer's input) and ``global`` (a global Lipschitz constant of
dot-product attention on the projected domain, times eps).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from attncert.bounds.dotproduct import dot_product_attention_lipschitz
from attncert.bounds.lofast import lofast_from_terms, lofast_terms, naive_terms
from attncert.bounds.specformer import specformer_bound

__all__ = ["COSTS", "TESTS", "Layer", "Variant", "VARIANTS", "variant"]


@dataclass(frozen=True)
class Layer:
    """One residual attention layer as the certificate sees it: its clean input ``x`` (B, n, d),
    its weights, whether its residual is the identity, the radius its inputs are projected to,
    the softmax's Lipschitz constant, and the seed of the spectral norms' random starts."""

    x: Tensor
    weights: Any
    residual: bool
    radius: float
    softmax_lipschitz: float
    seed: int = 0


@dataclass(frozen=True)
class Variant:
    """A bound variant: ``terms(layer)`` once per sample, ``delta(terms, layer, eps)`` the
    bound on ||f(X') - f(X)|| at eps ((B,) or scalar), ``cost`` how the cost model prices the
    terms (``lofast`` | ``naive``: the counted per-layer terms; ``none``: nothing beyond the
    forward pass)."""

    name: str
    terms: Callable[[Layer], Any]
    delta: Callable[[Any, Layer, Tensor], Tensor]
    cost: str


def _lofast(form: str) -> Callable[[Layer], Any]:
    def terms(layer: Layer):
        from attncert.pipeline import rng

        g = rng.generator(layer.seed, layer.x.device)
        return lofast_terms(layer.x, layer.weights, layer.residual, form, generator=g)
    return terms


def _from_terms(terms: Any, layer: Layer, eps: Tensor) -> Tensor:
    return lofast_from_terms(terms, eps, layer.softmax_lipschitz)


VARIANTS: dict[str, Variant] = {v.name: v for v in (
    Variant("lofast_M", _lofast("M"), _from_terms, "lofast"),
    Variant("lofast_xi", _lofast("xi"), _from_terms, "lofast"),
    Variant("naive", lambda layer: naive_terms(layer.x, layer.weights, layer.residual),
            _from_terms, "naive"),
    Variant("specformer", lambda layer: None,
            lambda terms, layer, eps: specformer_bound(layer.x, layer.weights, eps,
                                                       layer.residual), "none"),
    Variant("global",
            lambda layer: dot_product_attention_lipschitz(
                layer.weights, layer.x.shape[1], layer.radius, layer.residual,
                layer.softmax_lipschitz),
            lambda terms, layer, eps: terms * eps, "none"),
)}
#: the cost model's pricings (tests/test_certify.py holds every variant to one of them)
COSTS = ("lofast", "naive", "none")
#: how a certificate turns the bounded output perturbation into a radius: the pairwise margin
#: test (every other class against the predicted one) or the logit test (docs/math.md)
TESTS = ("pairwise", "logit")


def variant(name: str) -> Variant:
    """The variant ``name`` (ValueError naming the known ones otherwise)."""
    if name not in VARIANTS:
        raise ValueError(f"unknown bound variant {name!r}; choose from {', '.join(VARIANTS)}")
    return VARIANTS[name]
