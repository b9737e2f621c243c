"""LoFAST / naive / SpecFormer bounds: weight conventions, ordering, soundness against PGD."""

import pytest
import torch
from helpers import gen as _gen
from helpers import random_attention_weights as _weights
from torch import nn

from attncert.bounds import (
    AttentionWeights,
    attention_forward,
    attention_probs,
    delta21_m,
    delta21_xi,
    delta22_lofast,
    delta22_naive,
    lofast_bound,
    lofast_from_terms,
    lofast_terms,
    m_norm,
    naive_bound,
    naive_terms,
    pgd_sensitivity,
    specformer_bound,
    xi,
    zeta,
)

F64 = torch.float64


def _projected_input(b, n, d, g, scale=1.0):
    """Tokens projected to norm <= 1 (LayerProject, R = 1), then scaled."""
    x = torch.randn(b, n, d, generator=g, dtype=F64)
    return scale * x / x.norm(dim=-1, keepdim=True).clamp_min(1.0)


# -- weight conventions ----------------------------------------------------------------------


def _zero_biases(module):
    for name, p in module.named_parameters():
        if "bias" in name:
            nn.init.zeros_(p)


def _reference_forward(x, wq, wk, wv, wo):
    """Dense multi-head attention straight from the per-head matrices (docs/math.md section 1)."""
    d_h = wq.shape[-1]
    out = 0
    for l in range(wq.shape[0]):
        s = (x @ wq[l]) @ (x @ wk[l]).transpose(-1, -2) / d_h**0.5
        out = out + torch.softmax(s, -1) @ x @ wv[l] @ wo[l]
    return out


def test_weights_properties_and_to():
    w = _weights(2, 8, 1.0, _gen(0))
    assert (w.h, w.d, w.d_h) == (2, 8, 4)
    torch.testing.assert_close(w.A[1], w.wv[1] @ w.wo[1])
    torch.testing.assert_close(w.B[0], w.wq[0] @ w.wk[0].T)
    assert w.to(torch.float32).wq.dtype == torch.float32
    with pytest.raises(ValueError):
        AttentionWeights(w.wq, w.wk, w.wv, w.wo[:, :2])
    x = torch.randn(2, 5, 8, dtype=F64)
    torch.testing.assert_close(
        attention_forward(x, w, False), _reference_forward(x, *w.__dict__.values())
    )


@pytest.mark.parametrize("heads", [1, 2, 4])
def test_from_mha_matches_module(heads):
    torch.manual_seed(heads)
    d = 8
    mha = nn.MultiheadAttention(d, heads, batch_first=True).double()
    _zero_biases(mha)
    w = AttentionWeights.from_mha(mha)
    x = torch.randn(3, 6, d, dtype=F64)
    ref, _ = mha(x, x, x, need_weights=False)
    torch.testing.assert_close(attention_forward(x, w, residual=False), ref)
    torch.testing.assert_close(attention_forward(x, w, residual=True), ref + x)


def test_from_linears_matches_manual_heads():
    torch.manual_seed(0)
    d, h = 12, 3
    q, k, v, o = (nn.Linear(d, d, bias=False).double() for _ in range(4))
    w = AttentionWeights.from_linears(q, k, v, o, h)
    torch.testing.assert_close(w.wq[1], q.weight[4:8, :].T)
    torch.testing.assert_close(w.wo[2], o.weight[:, 8:12].T)
    x = torch.randn(2, 5, d, dtype=F64)
    qs, ks, vs = (m(x).view(2, 5, h, 4).transpose(1, 2) for m in (q, k, v))
    att = torch.softmax(qs @ ks.transpose(-1, -2) / 2.0, -1) @ vs
    ref = o(att.transpose(1, 2).reshape(2, 5, d))
    torch.testing.assert_close(attention_forward(x, w, False), ref)


def test_from_hf_bert_and_vit():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    common = dict(
        hidden_size=16,
        num_attention_heads=4,
        num_hidden_layers=1,
        intermediate_size=8,
        attn_implementation="eager",
    )
    x = torch.randn(2, 7, 16, dtype=F64)

    bert = transformers.BertModel(transformers.BertConfig(**common)).double().eval()
    att = bert.encoder.layer[0].attention
    _zero_biases(att)
    w = AttentionWeights.from_hf(att.self, att.output.dense)
    ref = att.output.dense(att.self(x)[0])
    torch.testing.assert_close(attention_forward(x, w, False), ref)

    vit = transformers.ViTModel(transformers.ViTConfig(image_size=8, patch_size=4, **common))
    vit = vit.double().eval()
    layers = vit.layers if hasattr(vit, "layers") else vit.encoder.layer
    vatt = layers[0].attention
    _zero_biases(vatt)
    self_att = getattr(
        vatt, "attention", vatt
    )  # ViTSelfAttention (transformers 4) or ViTAttention (5)
    dense = vatt.output.dense if hasattr(vatt, "output") else None
    w = AttentionWeights.from_hf(self_att, dense)
    out = self_att(x)[0]
    ref = dense(out) if dense is not None else out
    torch.testing.assert_close(attention_forward(x, w, False), ref)


# -- orderings and soundness -----------------------------------------------------------------

SOUND_CASES = [
    # (seed, n, d, h, weight scale, input scale, residual)
    (0, 5, 8, 2, 1.0, 1.0, True),
    (1, 4, 8, 1, 2.0, 1.0, False),
    (2, 6, 8, 4, 0.7, 3.0, True),
    (3, 5, 12, 2, 1.5, 0.3, False),
]
EPS = [0.02, 0.1, 0.4]


def _stack_eps(x, eps_list):
    """Repeat the samples once per eps so that one batched PGD run covers every eps."""
    eps = torch.tensor(eps_list, dtype=x.dtype).repeat_interleave(x.shape[0])
    return x.repeat(len(eps_list), 1, 1), eps


@pytest.mark.parametrize("case", SOUND_CASES)
def test_ordering_and_soundness_against_pgd(case):
    seed, n, d, h, ws, xs, residual = case
    g = _gen(seed)
    w = _weights(h, d, ws, g)
    x, eps = _stack_eps(_projected_input(3, n, d, g, xs), EPS)
    t_m = lofast_terms(x, w, residual, "M", generator=g)
    t_xi = lofast_terms(x, w, residual, "xi", generator=g)
    t_nv = naive_terms(x, w, residual)
    assert torch.all(t_m.zeta <= t_nv.zeta) and torch.all(t_m.m <= t_xi.m)
    pgd = pgd_sensitivity(x, w, eps, residual, steps=300, restarts=8, generator=g)
    assert torch.all(pgd > 0)
    for c in (1.0, 0.5):
        lm = lofast_from_terms(t_m, eps, c)
        lx = lofast_from_terms(t_xi, eps, c)
        nv = lofast_from_terms(t_nv, eps, c)
        assert torch.all(lm <= lx) and torch.all(lx <= nv)
        assert torch.all(lm >= pgd), (c, lm, pgd)
    assert torch.all(specformer_bound(x, w, eps, residual) >= pgd)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_single_head_pieces_against_pgd(seed):
    g = _gen(seed)
    n, d, h = 5, 8, 2
    w = _weights(h, d, 1.0 + seed * 0.5, g)
    x, eps = _stack_eps(_projected_input(3, n, d, g, 1.0 + seed), [0.05, 0.3])
    for head in range(h):
        kw = dict(head=head, steps=300, restarts=8, generator=g)
        p21 = pgd_sensitivity(x, w, eps, True, target="delta21", **kw)
        p22 = pgd_sensitivity(x, w, eps, True, target="delta22", **kw)
        for c in (1.0, 0.5):
            dm = delta21_m(x, w, eps, head=head, softmax_lipschitz=c, generator=g)
            dx = delta21_xi(x, w, eps, head=head, softmax_lipschitz=c)
            assert torch.all(dm <= dx)
            assert torch.all(dm >= p21), (head, c, dm, p21)
        d22 = delta22_lofast(x, w, eps, head=head)
        assert torch.all(d22 <= delta22_naive(x, w, eps, head=head) * (1 + 1e-9))
        assert torch.all(d22 >= p22)
        # ||X' A|| at G = 0 is ||X A||: PGD must at least reach it
        xa = torch.linalg.matrix_norm(x @ w.A[head], 2)
        assert torch.all(p22 >= xa * (1 - 1e-9))


def test_single_head_needs_head_argument():
    g = _gen(0)
    w = _weights(2, 8, 1.0, g)
    x = _projected_input(2, 4, 8, g)
    with pytest.raises(ValueError, match="head"):
        delta22_lofast(x, w, 0.1)
    w1 = w.head(1)
    torch.testing.assert_close(delta22_lofast(x, w1, 0.1), delta22_lofast(x, w, 0.1, head=1))


def test_softmax_half_is_tight_on_two_tokens():
    """The softmax constant 1/2 is attained: diag(p) - pp^T at p = (1/2, 1/2)."""
    p = torch.tensor([0.5, 0.5], dtype=F64)
    jac = torch.diag(p) - torch.outer(p, p)
    assert torch.linalg.matrix_norm(jac, 2).item() == pytest.approx(0.5)


# -- batching, dtypes, eps forms -------------------------------------------------------------


@pytest.mark.parametrize("variant", ["M", "xi"])
def test_batched_equals_per_sample_and_eps_forms(variant):
    g = _gen(5)
    w = _weights(2, 8, 1.0, g)
    x = _projected_input(4, 6, 8, g, 2.0)
    eps = torch.tensor([0.01, 0.05, 0.1, 0.2], dtype=F64)
    for mode, rtol in (("estimate", 1e-8), ("upper", 2e-4)):  # upper pads by <= tol / 2 + margin
        kw = dict(mode=mode, tol=1e-11 if mode == "estimate" else 1e-4, generator=_gen(1))
        batched = lofast_bound(x, w, eps, True, variant, **kw)
        single = torch.cat(
            [lofast_bound(x[i : i + 1], w, float(eps[i]), True, variant, **kw) for i in range(4)]
        )
        torch.testing.assert_close(batched, single, rtol=rtol, atol=0)
    as_float = lofast_bound(x, w, 0.05, True, variant, generator=_gen(1))
    as_tensor = lofast_bound(
        x, w, torch.full((4,), 0.05, dtype=F64), True, variant, generator=_gen(1)
    )
    torch.testing.assert_close(as_float, as_tensor)
    nb = naive_bound(x, w, eps, False)
    torch.testing.assert_close(
        nb, torch.cat([naive_bound(x[i : i + 1], w, eps[i : i + 1], False) for i in range(4)])
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_dtypes(dtype):
    g = _gen(9)
    w64 = _weights(2, 8, 1.0, g)
    x64 = _projected_input(3, 5, 8, g, 2.0)
    x, w = x64.to(dtype), w64.to(dtype)
    ref = lofast_bound(x64, w64, 0.1, True, "M", generator=_gen(0))
    for variant in ("M", "xi"):
        out = lofast_bound(x, w, 0.1, True, variant, generator=_gen(0))
        assert out.dtype == dtype and out.shape == (3,)
        if variant == "M":
            torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=0)
    for fn in (naive_bound, specformer_bound):
        assert fn(x, w, 0.1, True).dtype == dtype
    assert zeta(x, w, True).dtype == dtype and m_norm(x, w).shape == (3, 2)
    assert xi(x, w).dtype == dtype
    assert attention_probs(x, w.to(F64)).dtype == dtype  # weights follow the input


def test_bounds_are_differentiable():
    g = _gen(3)
    w = _weights(2, 8, 1.0, g)
    x = _projected_input(2, 5, 8, g).requires_grad_(True)
    for variant in ("M", "xi"):
        val = lofast_bound(x, w, 0.1, True, variant, generator=_gen(0)).sum()
        (grad,) = torch.autograd.grad(val, x)
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0
