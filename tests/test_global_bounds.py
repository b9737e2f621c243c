"""Global Lipschitz bounds (docs/math.md section 4) against empirical ratios and Jacobian ascent."""

import math

import pytest
import torch
from helpers import gen as _gen

from attncert.bounds import (
    GELU_LIPSCHITZ,
    averaged_residual,
    compose,
    kim_l2_attention_lipschitz,
    olsa_layer_lipschitz,
    residual,
)
from attncert.bounds.global_bounds import olsa_alpha2

F64 = torch.float64


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _unit_rows(x):
    norm = x.flatten(1).norm(dim=-1).clamp_min(1e-300)
    return x / norm.view(-1, *([1] * (x.dim() - 1)))


def _jacobian_ascent(f, x0, steps=150, lr=0.05, radius=None):
    """Largest ||J_f(X) v|| found by power steps on v and normalised gradient ascent on X
    (projected onto ||X||_F <= radius when given). A lower bound on Lip(f) on that set."""
    x = x0.clone()
    v = torch.randn(x.shape, generator=_gen(0), dtype=x.dtype)
    best = 0.0
    for _ in range(steps):
        x = x.detach().requires_grad_(True)
        v = _unit_rows(v)
        _, jv = torch.func.jvp(f, (x,), (v,))
        val = jv.flatten(1).norm(dim=-1)
        best = max(best, val.max().item())
        (grad,) = torch.autograd.grad(val.sum(), x)
        v = torch.func.vjp(f, x.detach())[1](jv.detach())[0].detach()  # not under no_grad
        with torch.no_grad():
            scale = radius if radius is not None else 1.0
            x = x + lr * scale * _unit_rows(grad)
            if radius is not None:
                x = _project(x, radius)
    return best


def _pair_ratio(f, x0, x1):
    return ((f(x1) - f(x0)).flatten(1).norm(dim=-1) / (x1 - x0).flatten(1).norm(dim=-1)).max()


# -- GELU, composition -----------------------------------------------------------------------


def test_gelu_lipschitz_against_dense_grid():
    x = torch.linspace(-8, 8, 400_001, dtype=F64, requires_grad=True)
    (grad,) = torch.autograd.grad(torch.nn.functional.gelu(x).sum(), x)
    grid_max = grad.abs().max().item()
    assert GELU_LIPSCHITZ >= grid_max
    assert GELU_LIPSCHITZ == pytest.approx(grid_max, abs=1e-9)
    assert GELU_LIPSCHITZ == pytest.approx(1.1289, abs=1e-4)
    assert abs(grad[x.detach().argmax()] - 1.0) < 1e-6  # sanity: slope 1 far right


def test_composition_helpers():
    assert compose(2.0, 3.0, 0.5) == pytest.approx(3.0)
    assert compose() == 1.0
    assert residual(0.25) == pytest.approx(1.25)
    assert averaged_residual(1.0) == pytest.approx(1.0)
    assert averaged_residual(0.0) == pytest.approx(0.5)


# -- Kim et al. L2 multi-head attention --------------------------------------------------------


def l2_mha(x, wq, wv, wo, kim_value=True):
    """L2-MHA with W^Q = W^K: P_ij ~ exp(-||x_i W^Q - x_j W^Q||^2 / sqrt(d_h)).

    kim_value: head h outputs P X A_h W^{V,h}, A_h = W^Q W^Q^T / sqrt(d_h) (Kim et al.'s
    definition, for which Theorem 3.2 is stated); otherwise P X W^{V,h} (plain values).
    Heads concatenated, times W^O.
    """
    d_h = wq.shape[-1]
    y = torch.einsum("bnd,hde->bhne", x, wq)
    sq = (y.unsqueeze(-2) - y.unsqueeze(-3)).pow(2).sum(-1)
    p = torch.softmax(-sq / math.sqrt(d_h), -1)
    if kim_value:
        a = wq @ wq.transpose(-1, -2) / math.sqrt(d_h)
        v = torch.einsum("bnd,hde,hef->bhnf", x, a, wv)
    else:
        v = torch.einsum("bnd,hde->bhne", x, wv)
    return torch.einsum("bhne,hef->bnf", p @ v, wo)


def _kim_weights(h, d, q_norm, g):
    d_h = d // h
    wq = torch.randn(h, d, d_h, generator=g, dtype=F64)
    wq = wq / torch.linalg.matrix_norm(wq, 2)[:, None, None] * q_norm
    wv = torch.randn(h, d, d_h, generator=g, dtype=F64) / math.sqrt(d)
    wo = torch.randn(h, d_h, d, generator=g, dtype=F64) / math.sqrt(d)
    return wq, wv, wo


@pytest.mark.parametrize(
    "n,d,h,q_norm,x_scale",
    [(4, 8, 2, 1.0, 1.0), (6, 8, 1, 1.0, 3.0), (5, 8, 4, 0.5, 1.0), (3, 6, 3, 1.0, 0.3)],
)
def test_kim_bound_holds_for_kim_l2_mha(n, d, h, q_norm, x_scale):
    g = _gen(n * 100 + d)
    wq, wv, wo = _kim_weights(h, d, q_norm, g)
    bound = kim_l2_attention_lipschitz(wq, wv, wo, n)
    assert bound == pytest.approx(kim_l2_attention_lipschitz(wq, wv, wo.reshape(-1, d), n))
    f = lambda z: l2_mha(z, wq, wv, wo)  # noqa: E731
    x0 = torch.randn(32, n, d, generator=g, dtype=F64) * x_scale
    for step in (1e-4, 0.1, 1.0, 10.0):
        x1 = x0 + step * torch.randn(32, n, d, generator=g, dtype=F64)
        assert _pair_ratio(f, x0, x1) <= bound
    assert _jacobian_ascent(f, x0[:8]) <= bound


def _jacobian_norm(f, x):
    jac = torch.autograd.functional.jacobian(f, x)
    return torch.linalg.matrix_norm(jac.reshape(x.numel(), x.numel()), 2).item()


def test_kim_formula_limits():
    """Where docs/math.md's form of Theorem 3.2 is NOT a bound (findings, kept as regressions):
    (a) ||W^Q|| >> 1: with identical tokens dP = 0 and the Jacobian is P (x) (A W^V W^O)^T,
    of norm ~||W^Q||^2, while the formula grows like ||W^Q||; (b) plain values P X W^V (no
    A_h) with d_h < d: tokens far apart along null(W^Q) keep the same attention scores, and
    the Jacobian grows linearly with that distance (not globally Lipschitz at all)."""
    g = _gen(11)
    n, d = 2, 4
    wq, wv, wo = _kim_weights(1, d, 30.0, g)
    bound = kim_l2_attention_lipschitz(wq, wv, wo, n)
    same = torch.zeros(1, n, d, dtype=F64) + torch.randn(1, 1, d, generator=g, dtype=F64)
    a = (wq[0] @ wq[0].T / math.sqrt(d)) @ wv[0] @ wo[0]
    jac = _jacobian_norm(lambda z: l2_mha(z, wq, wv, wo), same)
    assert jac == pytest.approx(torch.linalg.matrix_norm(a, 2).item(), rel=1e-9)
    assert jac > 2 * bound

    wq = torch.zeros(1, d, 2, dtype=F64)
    wq[0, 0, 0] = wq[0, 1, 1] = 1.0  # ||W^Q|| = 1, null space spanned by e_3, e_4
    wv = torch.randn(1, d, 2, generator=g, dtype=F64) / 2
    wo = torch.randn(1, 2, d, generator=g, dtype=F64) / 2
    bound = kim_l2_attention_lipschitz(wq, wv, wo, n)
    jacs = []
    for far in (1e3, 1e4):  # far away along null(W^Q): the scores do not see it
        x = torch.zeros(1, n, d, dtype=F64)
        x[0, 0, 0] = 0.5
        x[0, 1, 2] = far
        jacs.append(_jacobian_norm(lambda z: l2_mha(z, wq, wv, wo, kim_value=False), x))
        assert _jacobian_norm(lambda z: l2_mha(z, wq, wv, wo), x) <= bound
    assert jacs[1] > 9 * jacs[0] and jacs[1] > 10 * bound


# -- OLSA -------------------------------------------------------------------------------------


def _project(x, c):
    norm = x.flatten(1).norm(dim=-1).view(-1, 1, 1)
    return x * torch.clamp(c / norm, max=1.0)


def _orthogonal(d, g):
    return torch.linalg.qr(torch.randn(d, d, generator=g, dtype=F64))[0]


def _groupsort(z):
    a, b = z[..., 0::2], z[..., 1::2]
    return torch.stack([torch.maximum(a, b), torch.minimum(a, b)], -1).flatten(-2)


def olsa_attention(x, wq, wk, wv, ws, alpha1, alpha2, h):
    """OLSA additive attention (docs/math.md section 7): s_ij = W^S_h sigma((W^Q x_i + W^K x_j)/2)
    / alpha1, y_i = (1/alpha2) sum_j p_ij W^V x_j; W^Q, W^K, W^V orthogonal (heads are row
    blocks), ||W^S_h|| = 1, sigma = GroupSort (1-Lipschitz, sigma(0) = 0)."""
    b, n, d = x.shape
    d_h = d // h
    q, k, v = ((x @ m.T).view(b, n, h, d_h).transpose(1, 2) for m in (wq, wk, wv))
    z = _groupsort((q.unsqueeze(-2) + k.unsqueeze(-3)) / 2)
    p = torch.softmax(torch.einsum("bhijd,hd->bhij", z, ws) / alpha1, -1)
    return (p @ v).transpose(1, 2).reshape(b, n, d) / alpha2


def _olsa_setup(n, d, h, seed):
    g = _gen(seed)
    wq, wk, wv = (_orthogonal(d, g) for _ in range(3))
    ws = torch.randn(h, d // h, generator=g, dtype=F64)
    return g, wq, wk, wv, ws / ws.norm(dim=-1, keepdim=True)


@pytest.mark.parametrize(
    "n,d,h,c,alpha1",
    [(4, 8, 2, 2.0, 1.0), (2, 4, 1, 4.0, 0.5), (8, 8, 2, 4.0, 1.0), (3, 4, 2, 3.0, 0.2)],
)
def test_olsa_sound_bound_holds(n, d, h, c, alpha1):
    g, wq, wk, wv, ws = _olsa_setup(n, d, h, n + d)
    alpha2 = olsa_alpha2(alpha1, c, n)
    bound = olsa_layer_lipschitz(alpha1, alpha2, c, n)
    assert bound == pytest.approx(1.0)  # alpha2 chosen by the sound rule: 1-Lipschitz
    f = lambda z: olsa_attention(z, wq, wk, wv, ws, alpha1, alpha2, h)  # noqa: E731
    x0 = _project(torch.randn(64, n, d, generator=g, dtype=F64) * c, c)
    for step in (1e-4, 0.3, 3.0):
        x1 = _project(x0 + step * torch.randn(64, n, d, generator=g, dtype=F64), c)
        assert _pair_ratio(f, x0, x1) <= bound
    assert _jacobian_ascent(f, x0[:16], radius=c) <= bound


def test_olsa_paper_quarter_constant_is_unsound():
    """The paper's 1/4 softmax constant: Jacobian ascent inside ||X||_F <= c exceeds it."""
    n, d, h, c, alpha1 = 2, 4, 1, 4.0, 0.5
    g, wq, wk, wv, ws = _olsa_setup(n, d, h, n + d)
    paper = olsa_layer_lipschitz(alpha1, 1.0, c, n, softmax_constant=0.25, allow_unsound=True)
    sound = olsa_layer_lipschitz(alpha1, 1.0, c, n)
    f = lambda z: olsa_attention(z, wq, wk, wv, ws, alpha1, 1.0, h)  # noqa: E731
    x0 = _project(torch.randn(64, n, d, generator=g, dtype=F64) * c, c)
    found = _jacobian_ascent(f, x0[:16], radius=c, steps=300)
    assert paper < found <= sound
    with pytest.raises(ValueError, match="unsound"):
        olsa_layer_lipschitz(alpha1, 1.0, c, n, softmax_constant=0.25)
