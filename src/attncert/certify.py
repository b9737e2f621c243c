"""Certification engine: certified radii for every bound variant (docs/math.md section 6).

One forward pass with hooks collects each attention layer's clean input X_k; everything that
does not depend on eps (zeta, ||M_l||, xi_l, ||X A_l||, ||A_l||, ||B_l|| at every layer) is
computed once per sample; a per-sample radius is then found by bisection over a scalar
recurrence (eq. 9): eps_0 = eps in pixel space, a component with Lipschitz constant L maps
eps_k -> L eps_k, an attention layer maps it through its local bound delta(X_k, eps_k).

Variants (:data:`attncert.bounds.variants.VARIANTS`, one table read here and by the cost model):
``lofast_M`` (Theorem 1 with ||M_l||, eq. 27), ``lofast_xi`` (eq. 28), ``naive`` (eq. 12 +
delta2 with xi), ``specformer`` (SpecFormer's local bound, docs/math.md section 3) and
``global`` (a global Lipschitz constant of dot-product attention on the projected domain,
:func:`attncert.bounds.dot_product_attention_lipschitz`, times the other components).

Certificates (Proposition 1 and the pairwise last-layer test): with delta_feat a bound on the
head input's perturbation, the prediction y is certified when, for every j != y,
f_y - f_j > ||w_y - w_j|| delta_feat ("pairwise"), or when the margin exceeds
sqrt(2) ||W_head|| delta_feat ("logit").
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from attncert import bounds
from attncert.bounds.variants import TESTS, Layer, variant
from attncert.bounds.variants import VARIANTS as BOUND_VARIANTS
from attncert.models.vit import Component, propagate
from attncert.pipeline import rng
from attncert.pipeline.batching import BatchSize, in_batches
from attncert.training.precision import require_full_precision


def _clock(on: Tensor) -> float:
    """``time.perf_counter()`` after the device of ``on`` has finished its queued work (CUDA
    kernels run asynchronously: an unsynchronised clock times the launch, not the work)."""
    if on.is_cuda:
        torch.cuda.synchronize(on.device)
    return time.perf_counter()


if TYPE_CHECKING:
    import pandas as pd

VARIANTS = tuple(BOUND_VARIANTS)


@dataclass
class Precomputed:
    """eps-independent state of a batch: logits, attention inputs, per-variant layer terms."""

    components: list[Component]
    logits: Tensor  # (B, C)
    inputs: dict[str, Tensor]
    weights: dict[str, bounds.AttentionWeights]
    terms: dict[str, dict[str, object]]  # variant -> attention name -> terms
    seconds: dict[str, float]  # variant -> time spent precomputing (whole batch)
    layers: dict[str, Layer]  # attention name -> the layer as the variants see it


def _attention_components(components: Sequence[Component]) -> list[Component]:
    return [c for c in components if c.kind == "attention"]


def _check_supported(components: Sequence[Component]) -> None:
    for c in components:
        if c.kind == "head":
            return
        if c.kind != "attention" and not math.isfinite(c.lipschitz):
            raise ValueError(f"component {c.name!r} ({c.kind}) has no Lipschitz constant: the "
                             "model cannot be certified (use the Lipschitz ViT, not LayerNorm)")
    raise ValueError("the model has no linear head component")


def precompute(model, x: Tensor, variants: Sequence[str] = VARIANTS,
               softmax_lipschitz: float = 1.0, seed: int = 0) -> Precomputed:
    """One forward pass and every eps-independent quantity, per variant (timed).

    The Lanczos start vectors of the operator norms are drawn from a generator seeded with
    ``seed``, so a batch's terms are reproducible (every start gives a sound upper bound).
    """
    for v in variants:
        variant(v)  # an unknown name fails here, before any work
    require_full_precision("a certificate (attncert.certify)")
    components = model.components()
    _check_supported(components)
    # every attention input is the output of LayerProject(radius_attn): ||x_i|| <= radius
    attention_radius = float(model.config.radius_attn)
    t0 = _clock(x)
    logits, inputs = model.attention_inputs(x)
    forward_s = _clock(x) - t0
    attn = _attention_components(components)
    weights = {c.name: c.module.attention_weights() for c in attn}
    terms: dict[str, dict[str, object]] = {}
    seconds: dict[str, float] = {}
    layers = {c.name: Layer(inputs[c.name], weights[c.name], c.residual == "identity",
                            attention_radius, softmax_lipschitz, seed) for c in attn}
    for v in variants:
        t0 = _clock(x)
        terms[v] = {name: variant(v).terms(layer) for name, layer in layers.items()}
        seconds[v] = _clock(x) - t0 + forward_s
    return Precomputed(components, logits, inputs, weights, terms, seconds, layers)


def feature_delta(pre: Precomputed, name: str, eps: float | Tensor,
                  softmax_lipschitz: float = 1.0) -> Tensor:
    """(B,): bound on ||features(x') - features(x)|| for ||x' - x|| <= eps (pixel space)."""
    spec, layer_terms = variant(name), pre.terms[name]

    def attention_delta(c: Component, xk: Tensor, e: Tensor) -> Tensor:
        layer = dataclasses.replace(pre.layers[c.name], x=xk,
                                    softmax_lipschitz=softmax_lipschitz)
        return spec.delta(layer_terms[c.name], layer, e)

    return propagate(pre.components, pre.inputs, eps, attention_delta)


def head_of(components: Sequence[Component]) -> Component:
    return next(c for c in components if c.kind == "head")


def pairwise_norms(weight: Tensor) -> Tensor:
    """(C, C): ||w_i - w_j|| for the head's rows."""
    return torch.cdist(weight.double(), weight.double())


def certified(logits: Tensor, delta_feat: Tensor, head: Component, test: str = "pairwise"
              ) -> Tensor:
    """(B,) bool: the PREDICTED class is certified against feature perturbations delta_feat."""
    if test not in TESTS:
        raise ValueError(f"unknown test {test!r}; choose from {TESTS}")
    logits = logits.double()
    pred = logits.argmax(1)
    gaps = logits.gather(1, pred[:, None]) - logits  # (B, C), 0 at pred
    d = delta_feat.double().to(logits.device)[:, None]
    if test == "pairwise":
        need = pairwise_norms(head.weight.to(logits.device))[pred] * d
    else:
        need = math.sqrt(2) * head.lipschitz * d.expand_as(gaps)
    ok = gaps > need
    ok.scatter_(1, pred[:, None], True)
    return ok.all(1)


def certified_radius(pre: Precomputed, variant: str, test: str = "pairwise",
                     softmax_lipschitz: float = 1.0, max_radius: float = 100.0,
                     iters: int = 40) -> Tensor:
    """(B,): the largest eps (pixel-space l2) certified for the prediction, by bisection.

    delta is increasing in eps, so certification is monotone and bisection is exact up to
    ``max_radius * 2**-iters``; the returned value is the certified LOWER end of the bracket.
    """
    head = head_of(pre.components)
    b = pre.logits.shape[0]
    dev = pre.logits.device

    def ok(e: Tensor) -> Tensor:
        return certified(pre.logits, feature_delta(pre, variant, e, softmax_lipschitz), head, test)

    lo = torch.zeros(b, dtype=torch.float64, device=dev)
    hi = torch.full((b,), float(max_radius), dtype=torch.float64, device=dev)
    top = ok(hi)
    lo = torch.where(top, hi, lo)
    for _ in range(iters):
        mid = (lo + hi) / 2
        good = ok(mid) & ~top
        lo = torch.where(good, mid, lo)
        hi = torch.where(good | top, hi, mid)
    lo[~ok(lo) & (lo > 0)] = 0.0  # never report a radius that does not certify
    return lo


def certify_batch(model, x: Tensor, y: Tensor, variants: Sequence[str] = VARIANTS,
                  test: str = "pairwise", softmax_lipschitz: float = 1.0,
                  max_radius: float = 100.0) -> dict[str, Tensor]:
    """Per-sample prediction, margin, radius and seconds for each variant."""
    pre = precompute(model, x, variants, softmax_lipschitz)
    logits = pre.logits.double()
    pred = logits.argmax(1)
    top2 = logits.topk(2, dim=1).values
    out: dict[str, Tensor] = {"label": y.cpu(), "prediction": pred.cpu(),
                              "margin": (top2[:, 0] - top2[:, 1]).cpu()}
    for v in variants:
        t0 = _clock(x)
        r = certified_radius(pre, v, test, softmax_lipschitz, max_radius)
        out[f"radius_{v}"] = r.cpu()
        out[f"seconds_{v}"] = torch.full((len(y),), (pre.seconds[v] + _clock(x) - t0)
                                         / len(y), dtype=torch.float64)
    return out


def certified_accuracy(correct: Tensor, radius: Tensor, eps_grid: Sequence[float]
                       ) -> dict[float, float]:
    """Fraction correct AND certified (radius >= eps) at each eps."""
    return {float(e): float((correct & (radius >= e)).double().mean()) for e in eps_grid}


def certify_table(model, x: Tensor, y: Tensor, variants: Sequence[str] = VARIANTS,
                  tests: Sequence[str] = TESTS, softmax_lipschitz: float = 1.0,
                  max_radius: float = 100.0, batch_size: int = 100, progress: bool = True):
    """One row per example: index, label, prediction, correct, margin, and for each variant and
    test the certified radius and the seconds per sample it cost (the eps-independent
    precomputation of the variant, its share of the forward pass, and the bisection).

    Also ``forward_seconds``: one plain forward pass per sample at the same batch size, the
    unit of the cost ratios. Returns a pandas DataFrame.
    """
    import pandas as pd

    from attncert.pipeline.progress import bar

    unknown = sorted(set(tests) - set(TESTS))
    if unknown:
        raise ValueError(f"unknown test(s) {unknown}; choose from {TESTS}")

    def batch(start: int, stop: int) -> pd.DataFrame:
        xb, yb = x[start:stop], y[start:stop]
        with torch.no_grad():
            t0 = _clock(xb)
            model(xb)
            forward = (_clock(xb) - t0) / len(yb)
        pre = precompute(model, xb, variants, softmax_lipschitz)
        logits = pre.logits.double()
        top2 = logits.topk(2, dim=1).values
        pred = logits.argmax(1)
        cols: dict[str, object] = {
            "index": torch.arange(start, start + len(yb)), "label": yb.cpu(),
            "prediction": pred.cpu(), "correct": (pred == yb).cpu(),
            "margin": (top2[:, 0] - top2[:, 1]).cpu(), "forward_seconds": forward,
        }
        for v in variants:
            for t in tests:
                t0 = _clock(xb)
                cols[f"radius_{v}_{t}"] = certified_radius(pre, v, t, softmax_lipschitz,
                                                           max_radius).cpu()
                cols[f"seconds_{v}_{t}"] = (pre.seconds[v] + _clock(xb) - t0) / len(yb)
        return pd.DataFrame({k: v.numpy() if isinstance(v, Tensor) else v
                             for k, v in cols.items()})

    with bar(total=len(y), desc="certify", enabled=progress, unit="point") as shown:
        rows = in_batches(len(y), batch_size, batch, "certify", device=x.device,
                          done=shown.update)
    return pd.concat(rows, ignore_index=True)


def audit(model, x: Tensor, y: Tensor, radii: Mapping[str, Tensor], eps_grid: Sequence[float],
          steps: int = 100, restarts: int = 10, seed: int = 0, batch_size: int = 100,
          progress: bool = False) -> tuple[list[dict], Tensor]:
    """L2 PGD at each eps on the correctly classified points: empirical robust accuracy and
    the soundness audit in one attack.

    The attack runs on a float32 copy of the model (:func:`attncert.attacks.verified_pgd_l2`);
    a point counts as attacked successfully only when ``model`` in x's dtype (float64 for the
    certificates) misclassifies the candidate moved into the closed eps-ball, its norm
    checked again in that dtype.

    The radii run in ascending order, and each attacks only the points still standing: a
    misclassified point counts as attacked successfully without an attack, and so does a point
    with an adversarial example found at a smaller eps, which lies inside every larger ball
    (robust accuracy never grows with eps). Every certificate is attacked at every eps it
    claims, unless an attack already broke it at a smaller one. A successful attack on a point
    certified at eps (radius >= eps) is a broken certificate (a soundness bug). Returns one
    row per eps, in the order of ``eps_grid`` (``robust_acc``: correct and no adversarial
    example found, ``attacked``: the points PGD ran on at that eps, ``broken_<name>`` and
    ``certified_<name>`` for every entry of ``radii``) and a (len(eps_grid), N) bool tensor: an
    adversarial example within eps is known (or the point is misclassified).
    """
    from attncert.attacks import attack_by_radius, attack_copy, verified_pgd_l2
    from attncert.pipeline.progress import bar

    g = rng.generator(seed, x.device)
    with torch.no_grad():
        correct = torch.cat(in_batches(
            len(y), batch_size, lambda a, b: model(x[a:b]).argmax(1) == y[a:b],
            "audit forward", device=x.device)).cpu()
    attacker = attack_copy(model)
    size = BatchSize(batch_size, "PGD audit", x.device)  # grown once, for every radius
    progress_bar = bar(total=len(eps_grid), desc="PGD audit", enabled=progress)

    def attack(e: float, idx: Tensor) -> Tensor:
        def part(a: int, b: int) -> Tensor:
            sub = idx[a:b]
            return verified_pgd_l2(model, x[sub.to(x.device)], y[sub.to(y.device)], e, steps,
                                   restarts, generator=g, attack_model=attacker)[1].cpu()

        found = torch.cat(in_batches(len(idx), size, part))
        progress_bar.update(1)
        return found

    rows, found = [], []
    for e, (attacked, fooled) in zip(eps_grid, attack_by_radius(correct, eps_grid, attack),
                                     strict=True):
        row = {"eps": float(e), "attacked": attacked,
               "robust_acc": float((~fooled).double().mean())}
        for name, r in radii.items():
            cert = correct & (r.cpu() >= e)
            row[f"certified_{name}"] = float(cert.double().mean())
            row[f"broken_{name}"] = int((fooled & cert).sum())
        rows.append(row)
        found.append(fooled)
    progress_bar.update(len(eps_grid) - progress_bar.n)  # radii with no point left
    progress_bar.close()
    return rows, torch.stack(found) if found else torch.zeros(0, len(y), dtype=torch.bool)


def summarize(table, audit_rows: Sequence[Mapping], eps_grid: Sequence[float],
              variants: Sequence[str], tests: Sequence[str]) -> dict:
    """Headline metrics of a certified test set (from :func:`certify_table` and :func:`audit`).

    Accuracies are fractions. ``seconds_per_sample[v_t]`` is the whole certificate with its
    radius; ``cost_vs_forward[v_t]`` divides it by one forward pass per sample.
    """
    correct = torch.tensor(table["correct"].to_numpy())
    n = len(table)
    forward = float(table["forward_seconds"].mean())
    out: dict = {"n": n, "clean_acc": float(correct.double().mean()),
                 "forward_seconds_per_sample": forward, "certified_acc": {},
                 "median_radius": {}, "seconds_per_sample": {}, "cost_vs_forward": {},
                 "pgd_acc": {str(r["eps"]): r["robust_acc"] for r in audit_rows},
                 "broken": sum(v for r in audit_rows for k, v in r.items()
                               if k.startswith("broken_"))}
    for v in variants:
        for t in tests:
            key = f"{v}_{t}"
            r = torch.tensor(table[f"radius_{key}"].to_numpy())
            out["certified_acc"][key] = {str(k): a for k, a in
                                         certified_accuracy(correct, r, eps_grid).items()}
            out["median_radius"][key] = float(r.median()) if n else 0.0
            s = float(table[f"seconds_{key}"].mean())
            out["seconds_per_sample"][key] = s
            out["cost_vs_forward"][key] = s / forward
    return out


def long_certified_accuracy(summary: Mapping) -> pd.DataFrame:
    """(variant, test, eps, certified_acc) rows plus the PGD accuracy as variant "PGD"."""
    import pandas as pd

    rows = []
    for key, accs in summary["certified_acc"].items():
        variant, test = key.rsplit("_", 1)
        rows += [{"variant": variant, "test": test, "eps": float(e), "accuracy": a}
                 for e, a in accs.items()]
    rows += [{"variant": "PGD (upper bound)", "test": "attack", "eps": float(e), "accuracy": a}
             for e, a in summary["pgd_acc"].items()]
    return pd.DataFrame(rows)
