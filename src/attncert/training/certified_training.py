"""Certified training with the local bound: the ``lofast`` training margin.

A Lipschitz ViT trained with a fixed logit offset (``margin: lmt``) learns margins sized for
one global constant, which dot-product attention does not have; its certificates then stop far
below its empirical robustness. This margin trains against the bound the certifier uses
(LoFAST section 4, "large margin and small local sensitivity at once"): for each training input
x with label y and a training radius eps,

    delta = delta_feat(x, eps)     the end-to-end bound on the head input's perturbation
    need_j = ||w_y - w_j|| delta   the pairwise certificate's requirement on rival j
    loss = (1 - mix) CE(s f, y) + mix CE(s (f + need (1 - onehot(y))), y)

so a term near 0 means f_y - f_j > need_j for every j, the pairwise test at eps. delta_feat is
:func:`feature_delta`: the certifier's recurrence (eq. 9, :func:`attncert.models.vit.propagate`)
with every attention layer bounded by LoFAST's Theorem 1 in its xi form (eq. 28) and zeta
(eq. 15) replaced by its closed-form upper bound :func:`attncert.bounds.lofast.zeta_cheap_upper`,
every small-matrix norm taken as its matrix-power upper bound (:mod:`attncert.bounds.schatten`:
matrix products only, above the norm by at most a factor k^(1/1024) for a k x k Gram matrix,
k up to the width d: 0.5% at d = 128, 0.6% at d = 384, and for the r x r product G_u G_v of
two Gram matrices by (sqrt(r) ||G_u|| ||G_v|| / ||u v^T||^2)^(1/512), the 512th root of how far
from normal it is), differentiable in the weights and in
the clean activations, with no solver and no detached vectors: the whole loss, forward pass,
bound and backward, compiles to one graph (:func:`attncert.training.compiled.compiled_loss`;
a CUDA graph holds it). It is an upper bound on the certifier's ``lofast_xi`` (whose zeta is
the smaller Lanczos value and whose norms are exact) up to rounding (1e-12 relative in
float64; in training float32, and 5e-4 where TF32 is on), so a training margin positive by
more than that at eps is a certificate at eps (:func:`surrogate_certifies` checks it against
:mod:`attncert.certify`). Certificates after training are unchanged: the float64 certifier
decides, never this surrogate.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor
from torch.nn import functional as F

from attncert.bounds import lofast as lb
from attncert.bounds.schatten import eigenvalues_upper, gram, product_gram
from attncert.bounds.weights import (
    AttentionWeights,
    a_factors,
    attention_probs,
    b_factors,
    probs_of,
    xa_factors,
    xi_factors,
)
from attncert.models.vit import Component, propagate
from attncert.training import compiled

__all__ = ["attention_entropy", "entropy_forward", "feature_delta", "lofast_loss", "margin_eps",
           "margin_loss", "surrogate_certifies", "surrogate_terms"]


def surrogate_terms(layers: Mapping[str, tuple[Tensor, AttentionWeights, bool]]
                    ) -> dict[str, lb.LofastTerms]:
    """Theorem 1's terms of each attention layer, ``layers`` {name: (its clean input X
    (B, n, d), its weights, residual)}, xi form, with the closed-form zeta
    (:func:`attncert.bounds.lofast.zeta_from_norms`) and every norm bounded through a Gram
    matrix or the product of its factors' Gram matrices (:mod:`attncert.bounds.schatten`):
    differentiable, by matrix products only, and >= the certifier's
    ``lofast_xi`` terms. The Gram matrices of all layers are bounded together, one batched
    call per matrix size (:func:`attncert.bounds.schatten.eigenvalues_upper`)."""
    grams, shapes = [], {}
    for name, (x, w, residual) in layers.items():
        w = w.like(x)
        kq, qk = xi_factors(x, w)  # (X W^K, W^Q), (X W^Q, W^K)
        p = probs_of(qk[0], kq[0])
        pairs = (kq, qk, xa_factors(x, w), a_factors(w), b_factors(w))  # as the certifier's
        layer = [gram(p), lb.stacked_p_gram(p, residual), lb.stacked_a_gram(w, residual),
                 *(product_gram(*pair) for pair in pairs)]
        shapes[name] = (len(grams), w.d_h, residual)
        grams += layer
    norms = [t.sqrt() for t in eigenvalues_upper(grams)]
    out = {}
    for name, (i, d_h, residual) in shapes.items():
        p_norm, big_p, big_a, xk_q, xq_k, xa, a, b = norms[i:i + 8]
        out[name] = lb.LofastTerms(lb.zeta_from_norms(p_norm, big_p, a, big_a, residual),
                                   xk_q + xq_k, xa, a, b, d_h)
    return out


def feature_delta(components: list[Component], inputs: Mapping[str, Tensor],
                  weights: Mapping[str, AttentionWeights], eps: float | Tensor,
                  softmax_lipschitz: float = 1.0, live: Mapping[str, Tensor] | None = None
                  ) -> Tensor:
    """(B,): the surrogate bound on the head input's perturbation for input perturbations
    <= eps (pixel l2): the certifier's recurrence with :func:`surrogate_terms` per attention
    layer. ``inputs``/``weights``: every attention layer's clean input and weights, in the
    graph when the bound is to be trained against; ``live``: constants on the device in place
    of the components' floats (:func:`attncert.models.vit.propagate`)."""
    terms = surrogate_terms({c.name: (inputs[c.name], weights[c.name], c.residual == "identity")
                             for c in components if c.kind == "attention"})

    def attention_delta(c: Component, xk: Tensor, e: Tensor) -> Tensor:
        return lb.lofast_from_terms(terms[c.name], e, softmax_lipschitz)

    return propagate(components, inputs, eps, attention_delta, live)


def margin_eps(eps: float, ramp: float, step: int, total_steps: int, start: float = 0.0
               ) -> float:
    """The training radius at ``step``: 0 for the first ``start`` share of all ``total_steps``
    (plain cross-entropy: the attention can learn a pattern before the bound prices it), then
    ``eps`` after a linear ramp from 0 over a ``ramp`` share of all steps (0: eps at once)."""
    first = start * total_steps
    if step < first:
        return 0.0
    if ramp <= 0 or total_steps <= 0:
        return eps
    return eps * min(1.0, (step - first + 1) / (ramp * total_steps))


def attention_entropy(model, inputs: Mapping[str, Tensor],
                      components: list[Component] | None = None) -> Tensor:
    """The mean over the model's dot-product attention layers, heads, rows and the batch of
    each attention row's entropy / log n (1: uniform rows, 0: one-hot), differentiable in the
    weights and in the clean inputs ``inputs`` (:meth:`ViT.attention_inputs`, in the graph).
    Computed in float32 outside autocast. Only the attention layers' modules are read: by
    default from ``model.components(exact=False)`` (no SVD), else from ``components``."""
    from attncert.diagnostics import row_entropy

    comps = model.components(exact=False) if components is None else components
    layers = [c for c in comps if c.kind == "attention"]
    if not layers:
        raise ValueError("attn_entropy: the model has no dot-product attention layer")
    with torch.autocast(next(iter(inputs.values())).device.type, enabled=False):
        total = 0.0
        for c in layers:
            x = inputs[c.name].float()
            p = attention_probs(x, c.module.attention_weights(detach=False).like(x))
            total = total + row_entropy(p).mean()
    return total / len(layers)


def lofast_loss(model, x: Tensor, y: Tensor, eps: float, scale: float, mix: float = 1.0,
                softmax_lipschitz: float = 1.0, entropy: float = 0.0) -> tuple[Tensor, Tensor]:
    """(logits, loss) of the ``lofast`` margin (module docstring) on a batch of images ``x``
    (pixels in [0, 1]) with labels ``y``, plus ``entropy`` x :func:`attention_entropy` when
    ``entropy`` > 0. The bound runs in float32 outside autocast. While the training loop
    compiles the model (:func:`attncert.training.compiled.compiled_forward`) the loss is one
    compiled function (:func:`margin_loss`) with the radius a tensor input; what runs before
    it is the components' structure (``model.components(exact=False)``: no SVD, and for the
    Lipschitz ViT, whose norms are projections, no host read) and the radius filled on the
    device: no copy, no synchronisation."""
    if (mix == 0 or eps == 0) and entropy <= 0:  # no bound: the model's own compiled forward
        logits = model(x)
        return logits, F.cross_entropy(scale * logits, y)
    components = model.components(exact=False)
    if mix == 0 or eps == 0:
        logits, ent = compiled.compiled_loss(model, entropy_forward)(model, x, components)
        return logits, F.cross_entropy(scale * logits, y) + entropy * ent
    radius = torch.full((), eps, dtype=torch.float64, device=x.device)
    return compiled.compiled_loss(model, margin_loss)(
        model, x, y, radius, components, scale, mix, softmax_lipschitz, entropy)


def margin_loss(model, x: Tensor, y: Tensor, eps: Tensor, components: list[Component],
                scale: float, mix: float, softmax_lipschitz: float, entropy: float
                ) -> tuple[Tensor, Tensor]:
    """:func:`lofast_loss` at a radius ``eps`` > 0 (a 0-d tensor), ``components`` the model's
    (``components(exact=False)``: the constants it leaves out come from
    :meth:`attncert.models.ViT.live_constants`, upper bounds computed here): matrix products
    and elementwise operations only, no host synchronisation (``tests/test_capture.py``)."""
    logits, inputs = model.attention_inputs(x, detach=False)
    ce = F.cross_entropy(scale * logits, y)
    reg = entropy * attention_entropy(model, inputs, components) if entropy > 0 else 0.0
    # the bound in float32 (a training signal: where TF32 is on, its products round at 5e-4,
    # below which the bound may then fall; float64 cost 1.7x the compiled CPU step)
    with torch.autocast(x.device.type, enabled=False):
        inputs32 = {k: v.float() for k, v in inputs.items()}
        weights = {c.name: c.module.attention_weights(detach=False).like(inputs32[c.name])
                   for c in components if c.kind == "attention"}
        delta = feature_delta(components, inputs32, weights, eps, softmax_lipschitz,
                              model.live_constants())
        head = model.head_weight().float()
        dist = torch.cdist(head, head)[y]  # (B, C): ||w_y - w_j||, 0 at y
        need = dist * delta[:, None]
        margin_ce = F.cross_entropy(scale * (logits.float() + need), y)
    return logits, (1.0 - mix) * ce + mix * margin_ce + reg


def entropy_forward(model, x: Tensor, components: list[Component]) -> tuple[Tensor, Tensor]:
    """(logits, :func:`attention_entropy`) of one forward pass on ``x``, in the autograd graph,
    ``components`` the model's (``components(exact=False)`` will do): a training loss's
    entropy term, compiled with the forward pass while the training loop compiles the model
    (:func:`attncert.training.compiled.compiled_loss`)."""
    logits, inputs = model.attention_inputs(x, detach=False)
    return logits, attention_entropy(model, inputs, components)


def surrogate_certifies(model, x: Tensor, y: Tensor, eps: float,
                        softmax_lipschitz: float = 1.0) -> Tensor:
    """(B,) bool: the pairwise test at ``eps`` with the surrogate bound, for correctly
    classified points (what the training margin asks for). With the model in float64 a True
    whose margin exceeds the test's requirement by more than rounding (1e-12 relative: the
    surrogate's norms are padded by the products' rounding, not by the certifier's own) is
    also certified by :func:`attncert.certify.certified_radius` (``lofast_xi``)."""
    with torch.no_grad():
        logits, inputs = model.attention_inputs(x)
        components = model.components()
        weights = {c.name: c.module.attention_weights().like(inputs[c.name])
                   for c in components if c.kind == "attention"}
        delta = feature_delta(components, inputs, weights, eps, softmax_lipschitz)
        head = model.head_weight()
        gaps = logits.gather(1, y[:, None]) - logits
        need = torch.cdist(head, head)[y] * delta[:, None]
        ok = (gaps > need) | F.one_hot(y, logits.shape[1]).bool()
    return ok.all(1) & (logits.argmax(1) == y)
