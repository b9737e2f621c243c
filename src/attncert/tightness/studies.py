"""The tightness study's measurements as long DataFrames: LoFAST's Table 3 (and the paper's
values in the same format), Figures 1, 3 and 4, and the headline metrics; every bound is
measured against PGD on the same inputs."""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from attncert.bounds import (
    AttentionWeights,
    delta21_m,
    delta21_xi,
    delta22_lofast,
    delta22_naive,
    lofast_from_terms,
    lofast_terms,
    naive_bound,
    pgd_sensitivity,
    specformer_bound,
)
from attncert.bounds.dotproduct import dot_product_attention_lipschitz
from attncert.bounds.lofast import b_norm
from attncert.bounds.weights import attention_probs
from attncert.diagnostics import row_entropy
from attncert.pipeline import rng
from attncert.report import paper

#: LoFAST Table 3 (:data:`attncert.report.paper.LOFAST_TABLE3`)
PAPER_TABLE3 = paper.LOFAST_TABLE3
#: our name of each Table 3 row: the paper's LoFAST row is the xi form (eq. 28)
PAPER_TABLE3_METHODS = {"PGD": "PGD", "LoFAST": "LoFAST(xi)", "SpecFormer": "SpecFormer"}


def paper_table3_frame() -> pd.DataFrame:
    """PAPER_TABLE3 in the long format of :func:`table3` (source = "paper")."""
    rows = []
    for i, eps in enumerate(PAPER_TABLE3["eps"]):
        pgd = PAPER_TABLE3["PGD"][i]
        for key, method in PAPER_TABLE3_METHODS.items():
            value = PAPER_TABLE3[key][i]
            rows.append(
                dict(
                    eps=eps,
                    method=method,
                    value=value,
                    ratio_to_pgd=value / pgd,
                    ratio_max=np.nan,
                    source="paper",
                )
            )
    return pd.DataFrame(rows)


def _stack_eps(x: Tensor, eps_list) -> tuple[Tensor, Tensor]:
    eps = torch.tensor(list(eps_list), dtype=x.dtype, device=x.device).repeat_interleave(x.shape[0])
    return x.repeat(len(eps_list), 1, 1), eps


def _gen(seed: int, like: Tensor) -> torch.Generator:
    """A generator on the device of ``like`` (the tensors it draws for)."""
    return rng.generator(seed, like.device)


def table3(
    w: AttentionWeights,
    x: Tensor,
    eps_list=(0.01, 0.03, 0.05, 0.07, 0.09, 0.10),
    attack_steps: int = 100,
    attack_restarts: int = 4,
    residual: bool = True,
    softmax_lipschitz: float = 1.0,
    seed: int = 0,
) -> pd.DataFrame:
    """LoFAST Table 3: PGD, LoFAST(M), LoFAST(xi), naive, SpecFormer per eps (mean over samples).

    Columns: eps, method, value (mean), ratio_to_pgd (mean value / mean PGD), ratio_max
    (largest per-sample value / PGD), source = "ours".
    """
    xs, eps = _stack_eps(x, eps_list)
    t_m = lofast_terms(x, w, residual, "M", generator=_gen(seed, x))
    t_xi = lofast_terms(x, w, residual, "xi", generator=_gen(seed, x))
    rep = len(eps_list)

    def tile(t):
        return t._replace(zeta=t.zeta.repeat(rep), m=t.m.repeat(rep, 1), xa=t.xa.repeat(rep, 1))

    values = {
        "PGD": pgd_sensitivity(
            xs, w, eps, residual, steps=attack_steps, restarts=attack_restarts,
            generator=_gen(seed, x),
        ),
        "LoFAST(M)": lofast_from_terms(tile(t_m), eps, softmax_lipschitz),
        "LoFAST(xi)": lofast_from_terms(tile(t_xi), eps, softmax_lipschitz),
        "naive": naive_bound(xs, w, eps, residual, softmax_lipschitz),
        "SpecFormer": specformer_bound(xs, w, eps, residual),
    }
    return _summarise(values, eps_list, x.shape[0], "eps")


def _summarise(values: dict, keys, per_key: int, key_name: str, extra: dict | None = None):
    """Long frame: mean per (key, method), ratio of means to PGD and max per-sample ratio."""
    rows = []
    pgd = values["PGD"].detach().double().view(len(keys), per_key)
    for method, val in values.items():
        v = val.detach().double().view(len(keys), per_key)
        for i, key in enumerate(keys):
            row = {
                key_name: float(key),
                "method": method,
                "value": float(v[i].mean()),
                "ratio_to_pgd": float(v[i].mean() / pgd[i].mean()),
                "ratio_max": float((v[i] / pgd[i]).max()),
                "source": "ours",
            }
            if extra:
                row.update({k: float(e[i]) for k, e in extra.items()})
            rows.append(row)
    return pd.DataFrame(rows)


def figure1_single_head(
    w: AttentionWeights,
    x: Tensor,
    eps_list=(0.01, 0.03, 0.05, 0.07, 0.09, 0.10),
    head: int = 0,
    attack_steps: int = 100,
    attack_restarts: int = 4,
    softmax_lipschitz: float = 1.0,
    seed: int = 0,
) -> pd.DataFrame:
    """LoFAST Figure 1 (single head): Delta_{2,1} = ||P(X') - P(X)||_F bounded by
    delta_{2,1}^(1) (with ||M||) and delta_{2,1}^(2) (with xi); Delta_{2,2} = ||X' A|| bounded
    by delta_{2,2}^(1) = ||XA|| + eps||A|| and delta_{2,2}^(2) = ||A|| (||X|| + eps); each vs
    PGD. Columns: eps, quantity ("Delta21" / "Delta22"), method, value, ratio_to_pgd, ratio_max.
    """
    xs, eps = _stack_eps(x, eps_list)
    kw = dict(head=head, steps=attack_steps, restarts=attack_restarts, generator=_gen(seed, x))
    frames = []
    d21 = {
        "PGD": pgd_sensitivity(xs, w, eps, True, target="delta21", **kw),
        "delta21 (M)": delta21_m(
            xs, w, eps, head=head, softmax_lipschitz=softmax_lipschitz, generator=_gen(seed, x)
        ),
        "delta21 (xi)": delta21_xi(xs, w, eps, head=head, softmax_lipschitz=softmax_lipschitz),
    }
    frames.append(_summarise(d21, eps_list, x.shape[0], "eps").assign(quantity="Delta21"))
    d22 = {
        "PGD": pgd_sensitivity(xs, w, eps, True, target="delta22", **kw),
        "delta22 (LoFAST)": delta22_lofast(xs, w, eps, head=head),
        "delta22 (naive)": delta22_naive(xs, w, eps, head=head),
    }
    frames.append(_summarise(d22, eps_list, x.shape[0], "eps").assign(quantity="Delta22"))
    return pd.concat(frames, ignore_index=True)


def figure1_multi_head(
    w: AttentionWeights,
    x: Tensor,
    eps_list=(0.01, 0.03, 0.05, 0.07, 0.09, 0.10),
    attack_steps: int = 100,
    attack_restarts: int = 4,
    residual: bool = True,
    softmax_lipschitz: float = 1.0,
    seed: int = 0,
) -> pd.DataFrame:
    """LoFAST Figure 1 (multi-head): LoFAST(M), LoFAST(xi) and naive vs PGD over eps."""
    df = table3(w, x, eps_list, attack_steps, attack_restarts, residual, softmax_lipschitz, seed)
    return df[df.method != "SpecFormer"].reset_index(drop=True)


def _perturb(w: AttentionWeights, which: str, size: float, gen: torch.Generator):
    """W + D with D Gaussian, scaled to ||D||_F = size over the whole (all-heads) matrix."""
    mats = {"W^Q": w.wq, "W^K": w.wk, "W^V": w.wv, "W^O": w.wo}
    m = mats[which]
    noise = torch.randn(m.shape, generator=gen, device=m.device, dtype=torch.float64).to(m.dtype)
    mats[which] = m + noise * (size / noise.norm())
    return AttentionWeights(mats["W^Q"], mats["W^K"], mats["W^V"], mats["W^O"])


def figure3_weight_perturbation(
    w: AttentionWeights,
    x: Tensor,
    sizes=(0.1, 0.5, 1.0, 2.0),
    eps: float = 0.1,
    samples: int = 10,
    seed: int = 0,
    attack_steps: int = 100,
    attack_restarts: int = 4,
    residual: bool = True,
) -> pd.DataFrame:
    """LoFAST Figure 3: tightness under random perturbations of W^Q, W^K, W^V, W^O and X.

    Each target is perturbed in turn by a Gaussian matrix D scaled to FROBENIUS norm
    ||D||_F = size (over all heads of that weight; per sample matrix for X, which is not
    re-projected), `samples` draws per size. One row per (target, size, draw): LoFAST(M)
    and PGD (means over the inputs x) and their ratio.
    """
    gen = _gen(seed, x)
    rows = []
    for which in ("W^Q", "W^K", "W^V", "W^O"):
        for size in sizes:
            for k in range(samples):
                wp = _perturb(w, which, size, gen)
                bound = lofast_from_terms(
                    lofast_terms(x, wp, residual, "M", generator=_gen(seed, x)), eps
                )
                pgd = pgd_sensitivity(
                    x,
                    wp,
                    eps,
                    residual,
                    steps=attack_steps,
                    restarts=attack_restarts,
                    generator=_gen(seed + k, x),
                )
                rows.append(
                    dict(
                        target=which,
                        size=float(size),
                        draw=k,
                        eps=eps,
                        lofast=float(bound.mean()),
                        pgd=float(pgd.mean()),
                        ratio=float(bound.mean() / pgd.mean()),
                    )
                )
    # X: every draw for one size in one batch
    for size in sizes:
        noise = torch.randn((samples, *x.shape), generator=gen, device=x.device,
                            dtype=torch.float64).to(x.dtype)
        noise = noise * (size / noise.flatten(2).norm(dim=-1))[..., None, None]
        xp = (x.unsqueeze(0) + noise).reshape(-1, *x.shape[1:])
        bound = lofast_from_terms(lofast_terms(xp, w, residual, "M", generator=_gen(seed, x)), eps)
        pgd = pgd_sensitivity(
            xp, w, eps, residual, steps=attack_steps, restarts=attack_restarts,
            generator=_gen(seed, x),
        )
        bound, pgd = bound.view(samples, -1).mean(1), pgd.view(samples, -1).mean(1)
        for k in range(samples):
            rows.append(
                dict(
                    target="X",
                    size=float(size),
                    draw=k,
                    eps=eps,
                    lofast=float(bound[k]),
                    pgd=float(pgd[k]),
                    ratio=float(bound[k] / pgd[k]),
                )
            )
    return pd.DataFrame(rows)


def figure4_input_norm(
    w: AttentionWeights,
    x: Tensor,
    scales=(0.25, 0.5, 1.0, 2.0, 4.0),
    eps: float = 0.1,
    attack_steps: int = 100,
    attack_restarts: int = 4,
    residual: bool = True,
    seed: int = 0,
) -> pd.DataFrame:
    """LoFAST Figure 4: tightness against the input norm, X -> s X for s in scales.

    Columns: scale, input_norm (mean ||sX||), method (PGD, LoFAST(M), LoFAST(xi), naive),
    value (mean), ratio_to_pgd, ratio_max.
    """
    xs = torch.cat([s * x for s in scales])
    e = torch.full((xs.shape[0],), float(eps), dtype=x.dtype, device=x.device)
    values = {
        "PGD": pgd_sensitivity(
            xs, w, e, residual, steps=attack_steps, restarts=attack_restarts,
            generator=_gen(seed, x),
        ),
        "LoFAST(M)": lofast_from_terms(
            lofast_terms(xs, w, residual, "M", generator=_gen(seed, x)), e
        ),
        "LoFAST(xi)": lofast_from_terms(
            lofast_terms(xs, w, residual, "xi", generator=_gen(seed, x)), e
        ),
        "naive": naive_bound(xs, w, e, residual),
    }
    norms = torch.linalg.matrix_norm(xs, 2).view(len(scales), -1).mean(1)
    df = _summarise(values, scales, x.shape[0], "scale", extra={"input_norm": norms})
    return df.assign(eps=float(eps))


def attention_sharpening(
    w: AttentionWeights,
    x: Tensor,
    caps=(0.01, 0.1, 0.5, 1.0, 2.0, 4.0, 8.0),
    eps: float = 0.1,
    attack_steps: int = 100,
    attack_restarts: int = 4,
    seed: int = 0,
) -> pd.DataFrame:
    """The bound of one residual attention layer against PGD as its attention sharpens.

    Each head's W^Q_l is rescaled so that the logit cap R^2 ||B_l|| / sqrt(d_h) (R the largest
    token norm of ``x``) takes each value of ``caps``; values and inputs stay. Per cap: the
    mean row entropy / log n and the largest |logit| on ``x``, and the sensitivity
    max ||F(X+G) - F(X)||_F over ||G||_F <= eps by PGD (a lower bound), LoFAST(M), LoFAST(xi)
    and the global bound (``dot_product_attention_lipschitz`` on the ball of radius R + eps
    that holds every perturbed token, times eps). Columns: cap, entropy, logit_max, method,
    value (mean), ratio_to_pgd, ratio_max.
    """
    if not caps or min(caps) <= 0:
        raise ValueError(f"caps: positive logit caps, got {caps!r}")
    radius = float(torch.linalg.vector_norm(x, dim=-1).max())
    base = b_norm(w).to(x.dtype)  # (h,)
    if radius <= 0 or not bool((base > 0).all()):
        raise ValueError("attention_sharpening: needs nonzero inputs and every ||B_l|| > 0")
    e = torch.full((x.shape[0],), float(eps), dtype=x.dtype, device=x.device)
    values: dict[str, list[Tensor]] = {m: [] for m in ("PGD", "LoFAST(M)", "LoFAST(xi)",
                                                        "global")}
    entropy, logit_max = [], []
    for cap in caps:
        scale = cap * w.d_h ** 0.5 / (radius**2 * base)  # (h,): B_l -> scale_l B_l
        ws = AttentionWeights(w.wq * scale[:, None, None].to(w.wq), w.wk, w.wv, w.wo)
        p = attention_probs(x, ws.like(x))
        entropy.append(float(row_entropy(p).mean()))
        logits = torch.einsum("bnd,hde->bhne", x, ws.wq.to(x)) @ torch.einsum(
            "bnd,hde->bhne", x, ws.wk.to(x)).transpose(-1, -2) / w.d_h ** 0.5
        logit_max.append(float(logits.abs().max()))
        values["PGD"].append(pgd_sensitivity(x, ws, e, True, steps=attack_steps,
                                             restarts=attack_restarts, generator=_gen(seed, x)))
        for m, mode in (("LoFAST(M)", "M"), ("LoFAST(xi)", "xi")):
            values[m].append(lofast_from_terms(
                lofast_terms(x, ws, True, mode, generator=_gen(seed, x)), e))
        lip = dot_product_attention_lipschitz(ws, x.shape[1], radius + eps, True)
        values["global"].append(torch.full_like(e, lip * eps))
    stacked = {m: torch.cat(v) for m, v in values.items()}
    return _summarise(stacked, caps, x.shape[0], "cap",
                      extra={"entropy": entropy, "logit_max": logit_max}).assign(eps=float(eps))


def summary_metrics(t3: pd.DataFrame, f1_single: pd.DataFrame, f3: pd.DataFrame,
                    f4: pd.DataFrame, layer_source: str) -> dict:
    """Headline numbers of the study for DVC metrics, and the series of Figures 3 and 4 (the
    figures stage draws them from here): LoFAST(M) / PGD per perturbed target and size (mean
    over the random draws), every bound / PGD per input scale, with the mean input norm."""
    def ratios(df, method):
        sel = df[df.method == method]
        return {f"{e:g}": float(r) for e, r in zip(sel.eps, sel.ratio_to_pgd, strict=True)}

    bounds4 = f4[f4.method != "PGD"]

    return {
        "layer": layer_source,
        "table3_lofast_M_over_pgd": ratios(t3, "LoFAST(M)"),
        "table3_lofast_xi_over_pgd": ratios(t3, "LoFAST(xi)"),
        "table3_naive_over_pgd": ratios(t3, "naive"),
        "table3_specformer_over_pgd": ratios(t3, "SpecFormer"),
        "max_lofast_M_over_pgd": float(t3[t3.method == "LoFAST(M)"].ratio_max.max()),
        "fig1_delta21_M_over_pgd_max": float(
            f1_single[(f1_single.quantity == "Delta21") & (f1_single.method == "delta21 (M)")]
            .ratio_max.max()),
        "fig3_ratio_max": float(f3.ratio.max()),
        "fig4_lofast_M_over_pgd_max": float(f4[f4.method == "LoFAST(M)"].ratio_to_pgd.max()),
        "fig3_eps": float(f3.eps.iloc[0]),
        "fig3_ratio": {t: {f"{k:g}": float(r) for k, r in sub.groupby("size").ratio.mean().items()}
                       for t, sub in f3.groupby("target", sort=False)},
        "fig4_input_norm": {f"{k:g}": float(v)
                            for k, v in f4.groupby("scale").input_norm.first().items()},
        "fig4_ratio_to_pgd": {m: {f"{k:g}": float(r)
                                  for k, r in zip(sub.scale, sub.ratio_to_pgd, strict=True)}
                              for m, sub in bounds4.groupby("method", sort=False)},
    }
