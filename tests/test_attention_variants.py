"""Lipschitz attention baselines against loop references written from their papers' formulas."""

import math

import pytest
import torch
from helpers import gen as _gen
from helpers import randomise as _randomise
from torch.nn import functional as F

from attncert.bounds import kim_l2_attention_lipschitz
from attncert.layers import (
    CenterNorm,
    L2MultiHeadAttention,
    LNFormerAttention,
    MultiHeadAttention,
    ResidualScale,
    ScaledCosineAttention,
    spectral_init_,
)

F64 = torch.float64


def _head(linear, h, d_h):
    """W^{h} in the x W convention (d, d_h): weight[h*d_h:(h+1)*d_h, :].T."""
    return linear.weight[h * d_h:(h + 1) * d_h, :].T


def _bias(linear, h, d_h):
    return 0.0 if linear.bias is None else linear.bias[h * d_h:(h + 1) * d_h]


@torch.no_grad()
def _loop_attention(x, att, scores, values):
    """Reference multi-head attention with explicit loops: per sample b and head h,
    s = scores(X_b, h) (n, n), P_ij = exp(s_ij) / sum_k exp(s_ik), head output
    sum_j P_ij values(X_b, h)[j]; heads concatenated, then x W^O + b^O."""
    bsz, n, d = x.shape
    d_h = d // att.heads
    out = torch.zeros(bsz, n, d, dtype=x.dtype)
    for b in range(bsz):
        cat = torch.zeros(n, d, dtype=x.dtype)
        for h in range(att.heads):
            s, val = scores(x[b], h), values(x[b], h)
            for i in range(n):
                w = torch.stack([torch.exp(s[i, j]) for j in range(n)])
                w = w / w.sum()
                cat[i, h * d_h:(h + 1) * d_h] = sum(w[j] * val[j] for j in range(n))
        out[b] = cat @ att.o.weight.T + _bias(att.o, 0, d)
    return out


# -- Kim et al. L2 multi-head attention ----------------------------------------------------------


def _l2_reference(x, att):
    d_h = att.d_head

    def scores(xb, h):
        wq = _head(att.q, h, d_h)
        n = xb.shape[0]
        return torch.stack([torch.stack([-((xb[i] @ wq - xb[j] @ wq) ** 2).sum() / math.sqrt(d_h)
                                         for j in range(n)]) for i in range(n)])

    def values(xb, h):
        wq, wv = _head(att.q, h, d_h), _head(att.v, h, d_h)
        if att.value == "kim":
            a = wq @ wq.T / math.sqrt(d_h)  # A_h = W^{Q,h} (W^{Q,h})^T / sqrt(d_h)
            return xb @ a @ wv + _bias(att.v, h, d_h)
        return xb @ wv + _bias(att.v, h, d_h)

    return _loop_attention(x, att, scores, values)


@pytest.mark.parametrize("value", ["kim", "plain"])
@pytest.mark.parametrize("bias", [False, True])
def test_l2_attention_matches_kim_formula(value, bias):
    att = _randomise(L2MultiHeadAttention(4, 2, value=value, bias=bias), seed=1)
    x = torch.randn(2, 3, 4, generator=_gen(2), dtype=F64)
    torch.testing.assert_close(att(x), _l2_reference(x, att))
    assert att.k is att.q and att.q.bias is None  # W^K = W^Q; a query bias would cancel
    assert torch.allclose(att.compute_probs(x).sum(-1), torch.ones(2, 2, 3, dtype=F64))


def test_l2_attention_shapes_gradients_and_validation():
    att = L2MultiHeadAttention(8, 4)
    x = torch.randn(3, 5, 8, generator=_gen(3), requires_grad=True)
    y = att(x)
    assert y.shape == (3, 5, 8) and att.compute_probs(x).shape == (3, 4, 5, 5)
    y.square().sum().backward()
    grads = [x.grad] + [p.grad for p in att.parameters()]
    assert all(g is not None and torch.isfinite(g).all() and g.abs().sum() > 0 for g in grads)
    assert "k.weight" not in att.state_dict()  # tied: one query/key matrix
    with pytest.raises(ValueError, match="value"):
        L2MultiHeadAttention(8, 4, value="dot")
    with pytest.raises(ValueError, match="divisible"):
        L2MultiHeadAttention(8, 3)


def test_l2_attention_forward_uses_a_redefined_matrix():  # (an ablation's: test_diagnostics)
    class Uniform(L2MultiHeadAttention):  # uniform rows: every token's output is the same
        def compute_probs(self, x):
            return torch.full((len(x), 2, 3, 3), 1 / 3, dtype=x.dtype)

    x, att = torch.randn(2, 3, 4, generator=_gen(2), dtype=F64), _randomise(Uniform(4, 2), seed=1)
    out = att(x)
    torch.testing.assert_close(out, out[:, :1].expand_as(out))
    assert not torch.allclose(_l2_reference(x, att), out)


def _jacobian_norm(f, x):
    jac = torch.autograd.functional.jacobian(f, x)
    return torch.linalg.matrix_norm(jac.reshape(x.numel(), x.numel()), 2).item()


def _unit_rows(t):
    return t / t.flatten(1).norm(dim=-1).view(-1, 1, 1)


@pytest.mark.parametrize("q_scale", [0.3, 1.0, 4.0])
def test_l2_lipschitz_bound_holds(q_scale):
    """Random pairs and local Jacobians never exceed the bound, also for ||W^{Q,h}|| > 1."""
    n, d, h = 3, 4, 2
    att = _randomise(L2MultiHeadAttention(d, h), seed=4, scale=0.7)
    with torch.no_grad():
        blocks = att.q.weight.view(h, d // h, d)
        blocks.mul_(q_scale / torch.linalg.matrix_norm(blocks, 2)[:, None, None])
    bound = att.lipschitz_bound(n)
    g = _gen(5)
    x0 = torch.randn(64, n, d, generator=g, dtype=F64)
    for step in (1e-4, 0.1, 1.0):
        x1 = x0 + step * _unit_rows(torch.randn(64, n, d, generator=g, dtype=F64))
        ratio = (att(x1) - att(x0)).flatten(1).norm(dim=-1) / (x1 - x0).flatten(1).norm(dim=-1)
        assert ratio.max() <= bound
    for x in x0[:12] * torch.linspace(0.05, 3.0, 12, dtype=F64).view(-1, 1, 1):
        assert _jacobian_norm(lambda z: att(z[None])[0], x) <= bound


def test_l2_lipschitz_bound_corrects_degree_in_wq():
    """Identical tokens (dP = 0): the Jacobian is ||A W^V W^O|| = c^2 / sqrt(d_h) for
    W^Q = c I, W^V = W^O = I. docs/math.md's form, of degree 1 in ||W^Q||, falls below it for
    c = 5; the layer's bound (degree 2 above ||W^Q|| = 1) does not."""
    n, d, c = 2, 3, 5.0
    att = L2MultiHeadAttention(d, 1).double()
    with torch.no_grad():
        att.q.weight.copy_(c * torch.eye(d, dtype=F64))
        att.v.weight.copy_(torch.eye(d, dtype=F64))
        att.o.weight.copy_(torch.eye(d, dtype=F64))
    x = torch.ones(n, d, dtype=F64)
    jac = _jacobian_norm(lambda z: att(z[None])[0], x)
    assert jac == pytest.approx(c * c / math.sqrt(d), rel=1e-9)
    eye = torch.eye(d, dtype=F64)[None]
    printed = kim_l2_attention_lipschitz(c * eye, eye, eye, n)
    assert printed < jac <= att.lipschitz_bound(n)
    assert att.lipschitz_bound(n) == pytest.approx(c * printed, rel=1e-8)


def _ascent_lipschitz(f, x0, steps=60, radius=0.05, lr=0.02, seed=0):
    """Gradient ascent on ||f(x0 + u) - f(x0)||_F / ||u||_F over u (a LOWER bound on the
    Lipschitz constant near x0), from a random start; returns the largest ratio seen."""
    g = _gen(seed)
    u = torch.randn(x0.shape, generator=g, dtype=F64)
    u = (radius * u / u.norm()).requires_grad_(True)
    fx0, best = f(x0).detach(), 0.0
    for _ in range(steps):
        ratio = (f(x0 + u) - fx0).norm() / u.norm()
        best = max(best, ratio.item())
        (grad,) = torch.autograd.grad(ratio, u)
        with torch.no_grad():
            u += lr * grad / grad.norm().clamp_min(1e-30)
    return best


@pytest.mark.parametrize(("q_scale", "v_scale"), [(0.2, 1.0), (0.6, 0.3), (1.0, 1.0), (3.0, 0.5)])
def test_l2_factored_bound_holds_under_gradient_ascent(q_scale, v_scale):
    """The factored bound K_n min(...) (c_l = ||W^{Q,l}|| ||W^{Q,l T} W^{V,l}||) is never below
    a gradient-ascent lower bound, nor below the local Jacobian norm, at small and large
    ||W^Q||; and it never exceeds the printed bound with the degree correction."""
    n, d, h = 5, 8, 2
    att = _randomise(L2MultiHeadAttention(d, h), seed=11, scale=0.5)
    with torch.no_grad():
        for w, c in ((att.q.weight, q_scale), (att.v.weight, v_scale)):
            blocks = w.view(h, d // h, d)
            blocks.mul_(c / torch.linalg.matrix_norm(blocks, 2)[:, None, None])
    bound = att.lipschitz_bound(n)
    assert bound <= att.lipschitz_bound_printed(n) * (1 + 1e-12)
    g = _gen(12)
    for k, spread in enumerate((0.1, 1.0, 4.0)):
        x0 = spread * torch.randn(n, d, generator=g, dtype=F64)
        ascent = _ascent_lipschitz(lambda z: att(z[None])[0], x0, seed=k)
        jac = _jacobian_norm(lambda z: att(z[None])[0], x0)
        assert 0 < ascent <= bound and jac <= bound


def test_l2_factored_bound_is_tighter_below_unit_queries():
    """||W^Q|| < 1: the factored bound is degree 2 in ||W^Q|| (no max(1, ||W^Q||)), so halving
    W^Q divides it by 4 while the printed form only halves."""
    att = _randomise(L2MultiHeadAttention(8, 2), seed=13, scale=0.1)
    b0, p0 = att.lipschitz_bound(9), att.lipschitz_bound_printed(9)
    with torch.no_grad():
        att.q.weight.mul_(0.5)
    assert att.lipschitz_bound(9) == pytest.approx(b0 / 4, rel=1e-9)
    assert att.lipschitz_bound_printed(9) == pytest.approx(p0 / 2, rel=1e-9)


def _into_ball(x, radius, center):
    """Rows of x moved into the ball (center, radius): the domain of the radius bound."""
    d = x - center
    return center + d * (radius / d.norm(dim=-1, keepdim=True)).clamp(max=1.0)


@pytest.mark.parametrize(("q_scale", "radius"), [(0.3, 1.0), (0.5, 2.0), (1.0, 1.5), (2.0, 3.0)])
def test_l2_domain_bound_holds_inside_the_ball(q_scale, radius):
    """Tokens in one ball: Jacobian norms at points of the ball (boundary and inside) and
    gradient ascent of the ratio over pairs kept inside the ball never exceed the radius
    bound, which is never above the global one; it is far below it for small balls."""
    n, d, h = 6, 8, 2
    att = _randomise(L2MultiHeadAttention(d, h), seed=21, scale=0.6)
    with torch.no_grad():
        blocks = att.q.weight.view(h, d // h, d)
        blocks.mul_(q_scale / torch.linalg.matrix_norm(blocks, 2)[:, None, None])
    bound = att.lipschitz_bound(n, radius)
    assert bound <= att.lipschitz_bound(n) * (1 + 1e-12)
    g = _gen(22)
    center = torch.randn(d, generator=g, dtype=F64)
    f = lambda z: att(z[None])[0]  # noqa: E731
    best = 0.0
    for k in range(6):
        x0 = center + radius * torch.randn(n, d, generator=g, dtype=F64)
        x0 = _into_ball(x0, radius * (0.5 + 0.1 * k), center)
        best = max(best, _jacobian_norm(f, x0))
        # projected gradient ascent on the ratio: x1 = x0 + u stays in the ball
        u = 0.05 * torch.randn(n, d, generator=g, dtype=F64)
        for _ in range(40):
            u.requires_grad_(True)
            x1 = _into_ball(x0 + u, radius, center)
            ratio = (f(x1) - f(x0)).norm() / (x1 - x0).norm().clamp_min(1e-12)
            best = max(best, ratio.item())
            (grad,) = torch.autograd.grad(ratio, u)
            with torch.no_grad():
                u = u + 0.05 * grad / grad.norm().clamp_min(1e-30)
    assert 0 < best <= bound
    if radius * q_scale <= 0.5:
        assert bound < 0.5 * att.lipschitz_bound(n)


def test_l2_domain_bound_through_project_norm():
    """Attention after a ProjectNorm (radius R, gains <= 1): every input reaches the attention
    inside the ball (beta, R max|gamma|), so L(norm) x the radius bound is a global constant
    of the composition; gradient ascent on arbitrary inputs stays below it."""
    from attncert.certvit.adapt import ProjectNorm

    n, d = 5, 8
    norm = ProjectNorm(d, radius=1.2).double()
    att = _randomise(L2MultiHeadAttention(d, 2), seed=23, scale=0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.9, 0.8, d, dtype=F64))
        norm.bias.copy_(torch.randn(d, generator=_gen(24), dtype=F64))
    r = float(norm.radius) * norm.compute_lipschitz()
    bound = norm.compute_lipschitz() * att.lipschitz_bound(n, r)
    f = lambda z: att(norm(z[None]))[0]  # noqa: E731
    g = _gen(25)
    for k in range(4):
        x0 = (0.3 + k) * torch.randn(n, d, generator=g, dtype=F64)
        assert _ascent_lipschitz(f, x0, seed=k) <= bound
        assert _jacobian_norm(f, x0) <= bound


def test_l2_plain_values_have_no_bound():
    with pytest.raises(ValueError, match="no global Lipschitz"):
        L2MultiHeadAttention(4, 2, value="plain").lipschitz_bound(3)


@pytest.mark.parametrize("lipschitz", [False, True])
def test_l2_from_dot_product_ties_queries(lipschitz):
    mha = MultiHeadAttention(4, 2, lipschitz=lipschitz, bias=not lipschitz, gamma_vo=0.5)
    mha = _randomise(mha, seed=6)
    att = L2MultiHeadAttention.from_dot_product(mha, value="plain")
    x = torch.randn(2, 3, 4, generator=_gen(7), dtype=F64)
    assert att.q.weight.dtype == F64 and att.value == "plain"
    if lipschitz:  # effective (constrained) matrices are copied
        w = mha.attention_weights()
        torch.testing.assert_close(att.q.weight.view(2, 2, 4).transpose(1, 2), w.wq)
        torch.testing.assert_close(att.v.weight.view(2, 2, 4).transpose(1, 2), w.wv)
    else:
        for name in ("q", "v", "o"):
            assert torch.equal(getattr(att, name).weight, getattr(mha, name).weight)
        assert torch.equal(att.v.bias, mha.v.bias) and torch.equal(att.o.bias, mha.o.bias)
    torch.testing.assert_close(att(x), _l2_reference(x, att))
    with torch.no_grad():
        mha.k.weight.mul_(3.0)  # the key map is discarded
    torch.testing.assert_close(L2MultiHeadAttention.from_dot_product(mha, "plain")(x), att(x))


# -- LNFormer: LipschitzNorm ---------------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_lnformer_matches_lipschitznorm_formula(bias):
    att = _randomise(LNFormerAttention(4, 2, bias=bias), seed=8, scale=1.5)
    x = torch.randn(2, 3, 4, generator=_gen(9), dtype=F64)
    d_h = att.d_head

    def proj(xb, m, h):
        return xb @ _head(m, h, d_h) + _bias(m, h, d_h)

    def scores(xb, h):
        q, k, v = (proj(xb, m, h) for m in (att.q, att.k, att.v))
        u = math.sqrt(sum(float(q[i] @ q[i]) for i in range(q.shape[0])))  # ||Q||_F
        kk = max(float(k[j].norm()) for j in range(k.shape[0]))  # ||K||_(inf,2)
        w = max(float(v[j].norm()) for j in range(v.shape[0]))  # ||V||_(inf,2)
        return q @ k.T / max(u * kk, u * w, kk * w)

    ref = _loop_attention(x, att, scores, lambda xb, h: proj(xb, att.v, h))
    torch.testing.assert_close(att(x), ref)


def test_lnformer_shapes_and_gradients():
    att = LNFormerAttention(8, 2)
    x = torch.randn(2, 5, 8, generator=_gen(10), requires_grad=True)
    y = att(x)
    assert y.shape == (2, 5, 8) and att.compute_probs(x).shape == (2, 2, 5, 5)
    y.sum().backward()
    assert torch.isfinite(x.grad).all() and all(torch.isfinite(p.grad).all()
                                                 for p in att.parameters())
    assert torch.isfinite(att(torch.zeros(1, 3, 8))).all()  # eps: no 0/0


# -- LipsFormer --------------------------------------------------------------------------------


@pytest.mark.parametrize("tau,eps", [(10.0, 1e-6), (3.0, 0.5)])
def test_scaled_cosine_attention_matches_formula(tau, eps):
    att = _randomise(ScaledCosineAttention(4, 2, tau=tau, eps=eps, bias=True), seed=11)
    x = torch.randn(2, 3, 4, generator=_gen(12), dtype=F64)
    d_h = att.d_head

    def proj(xb, m, h):
        return xb @ _head(m, h, d_h) + _bias(m, h, d_h)

    def scores(xb, h):
        q, k = proj(xb, att.q, h), proj(xb, att.k, h)
        n = xb.shape[0]
        return torch.stack([torch.stack([
            tau * (q[i] @ k[j]) / math.sqrt((float(q[i] @ q[i]) + eps) * (float(k[j] @ k[j]) + eps))
            for j in range(n)]) for i in range(n)])

    ref = _loop_attention(x, att, scores, lambda xb, h: proj(xb, att.v, h))
    torch.testing.assert_close(att(x), ref)


def test_scaled_cosine_attention_tau_and_gradients():
    fixed, learned = ScaledCosineAttention(8, 2), ScaledCosineAttention(8, 2, learn_tau=True)
    assert "tau" not in dict(fixed.named_parameters()) and "tau" in fixed.state_dict()
    x = torch.randn(2, 5, 8, generator=_gen(13))
    y = learned(x)
    assert y.shape == (2, 5, 8)
    y.sum().backward()
    assert learned.tau.grad is not None and torch.isfinite(learned.tau.grad)
    probs = fixed.compute_probs(x)
    assert torch.allclose(probs.sum(-1), torch.ones(2, 2, 5))
    with pytest.raises(ValueError, match="tau"):
        ScaledCosineAttention(8, 2, tau=0.0)


def test_center_norm_matches_formula_and_lipschitz():
    norm = _randomise(CenterNorm(5), seed=14)
    x = torch.randn(2, 3, 5, generator=_gen(15), dtype=F64)
    ref = torch.empty_like(x)
    for b in range(2):
        for i in range(3):
            t = x[b, i]
            ref[b, i] = norm.weight * (5 / 4) * (t - t.sum() / 5) + norm.bias
    torch.testing.assert_close(norm(x), ref)
    jac = _jacobian_norm(norm, x[0])
    assert jac <= norm.compute_lipschitz() * (1 + 1e-12)
    plain = CenterNorm(5, affine=False)
    assert list(plain.parameters()) == [] and plain.compute_lipschitz() == pytest.approx(1.25)
    assert torch.allclose(plain(x).sum(-1), torch.zeros(2, 3, dtype=F64), atol=1e-12)


def test_residual_scale():
    scale = ResidualScale(4, alpha=0.25)
    y = torch.randn(2, 3, 4, generator=_gen(16))
    torch.testing.assert_close(scale(y), 0.25 * y)
    scale(y).sum().backward()
    torch.testing.assert_close(scale.alpha.grad, y.sum(dim=(0, 1)))
    fixed = ResidualScale(4, alpha=-0.5, learnable=False)
    assert list(fixed.parameters()) == [] and fixed.compute_lipschitz() == 0.5


def test_spectral_init_sets_spectral_norm():
    w = torch.empty(6, 4)
    out = spectral_init_(w, gain=0.7, generator=_gen(17))
    assert out is w
    assert torch.linalg.matrix_norm(w.double(), 2).item() == pytest.approx(0.7, rel=1e-6)
    with pytest.raises(ValueError, match="2-D"):
        spectral_init_(torch.empty(3))
    assert F.linear(torch.ones(1, 4), w).shape == (1, 6)
