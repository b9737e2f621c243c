"""A sound global l2 Lipschitz certificate of a CertViT-adapted ViT (docs/math.md sections 4-6).

Every component of the network is counted, pixels in [0, 1] to the head's input:

    L_feat = 1/min(std)                                  input normalisation (inside the model)
           * ||E||                                       patch embedding (per-patch matrix)
           * 1                                           class token, position embedding
           * prod_blocks (1 + L(norm_attn) L(attn))       prenorm: x + Att(Norm(x))
                         (1 + L(norm_mlp) ||W2|| 1.1289 ||W1||)   x + W2 GELU(W1 Norm(x))
           * L(norm) * L(pool)                            final norm; class token 1, mean 1/sqrt(n)
                                                                 (MeanPooledViT: all n tokens)

with L(attn) Kim et al. (2021), "The Lipschitz constant of self-attention", Theorem 3.2 for
L2 attention with tied W^Q = W^K, applied per head to the factorisation
h(X W^{Q,l}) (W^{Q,l})^T W^{V,l}, with W^O, and tightened on the ball its inputs are confined
to when the norm before it is a ProjectNorm (every token within R max|gamma| of beta, for
clean and perturbed inputs alike, so the product with L(norm_attn) bounds attention o norm)
(:meth:`attncert.layers.L2MultiHeadAttention.lipschitz_bound`), L(norm) the constant of the
LayerNorm replacement (:func:`attncert.certvit.adapt.norm_lipschitz`), 1.1289 = max |GELU'|
(CertViT uses 1.12, which is below the maximum), spectral norms certificate-grade upper bounds
(exact float64 SVD, padded). A "stream" block, x <- Norm(x); x <- x + Att(x), counts
L(norm_attn) (1 + L(attn)) instead. A block with LipsFormer's scaled branches, x + alpha f(x)
(``residual_scale`` > 0), multiplies each branch's constant by max|alpha| (1 + max|alpha| L(f)).
Biases and added constants do not change the constants.

CertViT (Gupta et al. 2023) multiplies the attention and linear constants only, leaving out
LayerNorm (which has no Lipschitz constant), the patch embedding and the input normalisation,
and measures a pixel-space eps on a normalised model: its certificates are unsound
(docs/math.md section 5). Here eps is in pixel space and every factor above is in the product.

Certificate (the pairwise last-layer test, docs/math.md section 6): with logits f = W h + b and
||h(x') - h(x)|| <= L_feat ||x' - x||, the prediction y is certified at every eps below

    r(x) = min_{j != y} (f_y - f_j) / (||w_y - w_j|| L_feat).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attncert.bounds import GELU_LIPSCHITZ, spectral_norm
from attncert.certvit.adapt import norm_lipschitz, output_radius, pool_lipschitz
from attncert.layers import L2MultiHeadAttention, MultiHeadAttention
from attncert.models.vit import MLP, ViT
from attncert.pipeline.batching import in_batches
from attncert.training.precision import require_full_precision

__all__ = [
    "GlobalBound",
    "certified_radius",
    "certify",
    "certify_pairwise",
    "empirical_lipschitz",
    "global_bound",
    "lipschitz_table",
]


def _spectral_upper(w: Tensor) -> float:
    """Certificate-grade upper bound on ||w||_2 (exact float64 SVD, padded)."""
    return float(spectral_norm(w.detach().double(), mode="upper").value)


@dataclass
class GlobalBound:
    """The certificate's constants.

    rows: one dict per component (name, kind, lipschitz, factor), forward order; the rows
    with factor=True multiply to ``features`` (the others detail what a factor is made of);
    features: L_feat, pixels -> head input; head: ||W_head||_2; head_weight: (C, d) rows
    for the pairwise test.
    """

    rows: list[dict]
    features: float
    head: float
    head_weight: Tensor

    @property
    def logits(self) -> float:
        """Global Lipschitz constant of pixels -> logits, L_feat ||W_head||."""
        return self.features * self.head

    @property
    def pairwise(self) -> float:
        """The constant the certificate uses: L_feat max_{j != k} ||w_j - w_k||, the largest
        Lipschitz constant of a logit difference f_j - f_k (the pairwise test's denominator)."""
        w = self.head_weight.double()
        return self.features * float(torch.cdist(w, w).max())


def _check_adapted(model: nn.Module) -> None:
    if not isinstance(model, ViT) or model.config.kind != "standard":
        raise ValueError("expected a standard attncert ViT adapted by attncert.certvit.adapt")
    for name, m in model.named_modules():
        if isinstance(m, nn.LayerNorm):
            raise ValueError(f"{name} is a LayerNorm, which has no global Lipschitz constant: "
                             "adapt the model first (attncert.certvit.adapt)")
        if isinstance(m, MultiHeadAttention):
            raise ValueError(f"{name} is dot-product attention, which is not globally "
                             "Lipschitz: adapt the model first (attncert.certvit.adapt)")
        if isinstance(m, L2MultiHeadAttention) and m.value != "kim":
            raise ValueError(f"{name}: L2 attention with value={m.value!r} has no global "
                             "Lipschitz constant; adapt with value='kim'")
        if isinstance(m, MLP) and not (isinstance(m.act, nn.GELU) and m.act.approximate == "none"):
            raise ValueError(f"{name}.act: the bound uses the exact GELU's constant 1.1289")


def _branch_scale(scale: nn.Module | None, name: str, add) -> float:
    """max|alpha| of a block branch's LipsFormer scale x + alpha f(x) (a row of the bound), 1
    without one."""
    if scale is None:
        return 1.0
    return add(name, "residual_scale", scale.compute_lipschitz(), False)


@torch.no_grad()
def global_bound(model: ViT) -> GlobalBound:
    """The global Lipschitz bound of an adapted ViT, component by component (module docstring).

    Raises ValueError for a model that is not globally Lipschitz (LayerNorm, dot-product
    attention, plain-value L2 attention).
    """
    _check_adapted(model)
    require_full_precision("a certificate (attncert.certvit)")
    cfg = model.config
    n = cfg.n_tokens
    rows: list[dict] = []

    def add(name: str, kind: str, lipschitz: float, factor: bool) -> float:
        rows.append({"name": name, "kind": kind, "lipschitz": lipschitz, "factor": factor})
        return lipschitz

    add("normalize", "normalize", model.normalize.compute_lipschitz(), True)
    add("embed", "patch_embed", _spectral_upper(model.embed.per_patch_matrix()), True)
    add("pos", "tokens", 1.0, True)
    for i, b in enumerate(model.blocks):
        p = f"blocks.{i}"
        l_na = add(f"{p}.norm_attn", "norm", norm_lipschitz(b.norm_attn), b.form == "stream")
        l_att = add(f"{p}.attn", "l2_attention",
                    b.attn.lipschitz_bound(n, output_radius(b.norm_attn)), False)
        a_att = _branch_scale(b.scale_attn, f"{p}.scale_attn", add)
        if b.form == "stream":
            add(f"{p}.attn_residual", "residual", 1.0 + a_att * l_att, True)
        else:
            add(f"{p}.attn_residual", "residual", 1.0 + a_att * l_na * l_att, True)
        l_nm = add(f"{p}.norm_mlp", "norm", norm_lipschitz(b.norm_mlp), False)
        s1 = add(f"{p}.mlp.fc1", "linear", _spectral_upper(b.mlp.fc1.weight), False)
        g = add(f"{p}.mlp.act", "gelu", GELU_LIPSCHITZ, False)
        s2 = add(f"{p}.mlp.fc2", "linear", _spectral_upper(b.mlp.fc2.weight), False)
        a_mlp = _branch_scale(b.scale_mlp, f"{p}.scale_mlp", add)
        add(f"{p}.mlp_residual", "residual", 1.0 + a_mlp * l_nm * s2 * g * s1, True)
    add("norm", "norm", norm_lipschitz(model.norm), True)
    add("pool", "pool", pool_lipschitz(model), True)
    # the rows the certificate's float64 forward applies (unit with head_norm, normalised in
    # float64: rows normalised in float32 differ from them by rounding the test would not see)
    w_head = model.head_weight(torch.float64).detach().clone()
    head = add("head", "linear", _spectral_upper(w_head), False)
    features = math.prod(r["lipschitz"] for r in rows if r["factor"])
    return GlobalBound(rows, features, head, w_head)


def certified_radius(logits: Tensor, head_weight: Tensor, features_lipschitz: float) -> Tensor:
    """(B,) pixel-space l2 radius of the predicted class: min_{j != y} (f_y - f_j) /
    (||w_y - w_j|| L_feat), in float64. inf when a rival row equals w_y and the gap is > 0
    (that logit difference is constant), 0 on ties."""
    f = logits.double()
    pred = f.argmax(1)
    gaps = f.gather(1, pred[:, None]) - f  # (B, C) >= 0
    w = head_weight.double().to(f.device)
    denom = torch.cdist(w, w)[pred] * features_lipschitz
    ratio = torch.where(denom > 0, gaps / denom.clamp_min(torch.finfo(f.dtype).tiny),
                        torch.where(gaps > 0, math.inf, 0.0))
    ratio.scatter_(1, pred[:, None], math.inf)
    return ratio.min(1).values


@torch.no_grad()
def _logits(model: nn.Module, x: Tensor, batch_size: int) -> Tensor:
    """The certificate's forward pass in float64 (a float64 copy of ``model``; the model
    itself is left as it is), batch by batch."""
    model64 = copy.deepcopy(model).double()
    return torch.cat(in_batches(len(x), batch_size, lambda a, b: model64(x[a:b].double()),
                                "certificate forward", device=x.device))


def certify(model: ViT, x: Tensor, y: Tensor, eps_grid: Sequence[float],
            attack_steps: int = 0, attack_restarts: int = 1, batch_size: int = 256,
            seed: int = 0, n_attack: int | None = None,
            attack_batch_size: int | None = None) -> dict:
    """Certify (x, y) (pixels in [0, 1], float) with the global bound; optionally audit it.

    Returns ``bound`` (:class:`GlobalBound`), per-sample ``prediction``, ``correct``,
    ``radius`` (CPU tensors), ``clean_acc``, ``certified_acc`` {eps: fraction correct and
    radius >= eps}, ``seconds_per_sample`` (bound + forward + radii) and, with
    ``attack_steps`` > 0, the L2 PGD audit of :func:`attncert.certify.audit` on the first
    ``n_attack`` points (None: all) in batches of ``attack_batch_size`` (None:
    ``batch_size``; a PGD step keeps activations for the backward pass, so it needs a smaller
    batch than the certificate's forward pass): ``n_attacked``, ``audit`` rows, ``pgd_acc`` {eps:
    accuracy under attack}, ``attacked_certified_acc`` (certified accuracy on the same
    points, the one to set beside ``pgd_acc``) and ``broken`` (certified points PGD broke:
    must be 0).
    """
    model.eval()
    t0 = time.perf_counter()
    bound = global_bound(model)
    return certify_pairwise(model, x, y, bound.head_weight, bound.features, eps_grid,
                            attack_steps, attack_restarts, batch_size, seed, t0,
                            n_attack, attack_batch_size) | {"bound": bound}


def certify_pairwise(model: nn.Module, x: Tensor, y: Tensor, head_weight: Tensor,
                     features_lipschitz: float, eps_grid: Sequence[float],
                     attack_steps: int = 0, attack_restarts: int = 1, batch_size: int = 256,
                     seed: int = 0, started: float | None = None,
                     n_attack: int | None = None, attack_batch_size: int | None = None) -> dict:
    """:func:`certify` for any model whose logits are ``head_weight`` (C, d) applied to
    features with the given global Lipschitz constant (plus a bias): the same report, no
    ``bound`` key. ``started``: the perf_counter time the certificate's cost counts from."""
    if n_attack is not None and n_attack < 1:
        raise ValueError(f"n_attack must be positive or None, got {n_attack!r}")
    from attncert.certify import audit, certified_accuracy

    require_full_precision("a certificate (attncert.certvit)")
    model.eval()
    t0 = time.perf_counter() if started is None else started
    logits = _logits(model, x, batch_size)
    radius = certified_radius(logits, head_weight, features_lipschitz).cpu()
    seconds = (time.perf_counter() - t0) / max(len(y), 1)
    pred = logits.argmax(1).cpu()
    correct = pred == y.cpu()
    out = {"prediction": pred, "correct": correct, "radius": radius,
           "clean_acc": float(correct.double().mean()),
           "certified_acc": certified_accuracy(correct, radius, eps_grid),
           "seconds_per_sample": seconds}
    if attack_steps > 0:
        n = len(y) if n_attack is None else min(n_attack, len(y))
        rows, _ = audit(model, x[:n], y[:n], {"certvit": radius[:n]}, eps_grid, attack_steps,
                        attack_restarts, seed, attack_batch_size or batch_size)
        out["n_attacked"] = n
        out["audit"] = rows
        out["pgd_acc"] = {r["eps"]: r["robust_acc"] for r in rows}
        out["attacked_certified_acc"] = {r["eps"]: r["certified_certvit"] for r in rows}
        out["broken"] = sum(r["broken_certvit"] for r in rows)
    return out


def empirical_lipschitz(model: nn.Module, x: Tensor, steps: int = 20, radius: float = 0.1,
                        generator: torch.Generator | None = None) -> float:
    """A LOWER bound on the global Lipschitz constant of pixels -> logits (sanity check).

    max over pairs of ||f(x') - f(x)|| / ||x' - x||: the pairs (x_i, x_{i+1}) of the batch,
    and x' = x + delta from a random delta of norm ``radius`` moved by ``steps`` normalised
    gradient-ascent steps on the ratio (x' is not kept in [0, 1]: the bound is global).
    """
    model.eval()
    with torch.no_grad():
        fx = model(x)
        best = torch.zeros((), dtype=fx.dtype, device=fx.device)  # on the device: one sync
        if len(x) > 1:
            num = (fx[1:] - fx[:-1]).flatten(1).norm(dim=1)
            best = (num / (x[1:] - x[:-1]).flatten(1).norm(dim=1)).max()
    noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=x.dtype)
    delta = noise * (radius / noise.flatten(1).norm(dim=1)).view(-1, *[1] * (x.dim() - 1))
    step = radius / 4
    for k in range(steps + 1):
        delta.requires_grad_(True)
        ratio = ((model(x + delta) - fx).flatten(1).norm(dim=1)
                 / delta.flatten(1).norm(dim=1))
        best = torch.maximum(best, ratio.detach().max())
        if k == steps:
            break
        (grad,) = torch.autograd.grad(ratio.sum(), delta)
        with torch.no_grad():
            gn = grad.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, *[1] * (x.dim() - 1))
            delta = delta + step * grad / gn
    return float(best)


def lipschitz_table(**bounds: GlobalBound):
    """pandas DataFrame: one row per component, one Lipschitz column per labelled bound
    (e.g. ``lipschitz_table(adapted=b0, constrained=b1)``), then the product rows
    ``features`` (L_feat) and ``logits`` (L_feat ||W_head||)."""
    import pandas as pd

    if not bounds:
        raise ValueError("give at least one labelled GlobalBound")
    first = next(iter(bounds.values()))
    table = pd.DataFrame({"name": [r["name"] for r in first.rows],
                          "kind": [r["kind"] for r in first.rows],
                          "factor": [r["factor"] for r in first.rows]})
    for label, b in bounds.items():
        if [r["name"] for r in b.rows] != list(table["name"]):
            raise ValueError(f"bound {label!r} has other components than {next(iter(bounds))!r}")
        table[label] = [r["lipschitz"] for r in b.rows]
    totals = pd.DataFrame([
        {"name": "features", "kind": "product", "factor": False,
         **{k: b.features for k, b in bounds.items()}},
        {"name": "logits", "kind": "product", "factor": False,
         **{k: b.logits for k, b in bounds.items()}},
    ])
    return pd.concat([table, totals], ignore_index=True)
