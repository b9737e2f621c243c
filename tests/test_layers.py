"""Every Lipschitz claim of attncert.layers, checked empirically (float64, seeded, CPU)."""

import math

import pytest
import torch
from torch.func import jvp, vjp

from attncert.layers import (
    LayerProject,
    MultiHeadAttention,
    Normalize,
    NormConstrainedLinear,
    PatchEmbed,
    SLLResidual,
    patchify,
    spectral_norm_exact,
)

TOL = 1e-9


def jacobian_norm(f, x, iters=60, seed=0):
    """Power iteration on J^T J at x (torch.func jvp/vjp): a lower estimate of ||J_f(x)||."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(x.shape, generator=g, dtype=x.dtype)
    v /= v.norm()
    _, pullback = vjp(f, x)
    s = torch.tensor(0.0, dtype=x.dtype)
    for _ in range(iters):
        u = jvp(f, (x,), (v,))[1]
        (w,) = pullback(u)
        s = w.norm().sqrt()
        v = w / w.norm()
    return float(s.detach())


def max_pair_ratio(f, shape, n_pairs=64, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    worst = 0.0
    for _ in range(n_pairs):
        a = scale * torch.randn(shape, generator=g, dtype=torch.float64)
        b = a + scale * 10 ** torch.empty(1).uniform_(-3, 0, generator=g).item() * torch.randn(
            shape, generator=g, dtype=torch.float64)
        worst = max(worst, float((f(a) - f(b)).norm() / (a - b).norm()))
    return worst


def check_lipschitz(f, shape, claim, scale=1.0):
    g = torch.Generator().manual_seed(1)
    for i in range(5):
        x = scale * torch.randn(shape, generator=g, dtype=torch.float64)
        assert jacobian_norm(f, x, seed=i) <= claim * (1 + TOL)
    assert max_pair_ratio(f, shape, scale=scale) <= claim * (1 + TOL)


# -- LayerProject ------------------------------------------------------------------------------


def test_layer_project_multiplies_by_radius():
    proj = LayerProject(2.0)
    x = torch.tensor([[3.0, 4.0], [0.6, 0.8], [0.0, 0.0]], dtype=torch.float64)
    y = proj(x)
    torch.testing.assert_close(y[0], torch.tensor([1.2, 1.6], dtype=torch.float64))  # 2 x / 5
    torch.testing.assert_close(y[1], x[1])  # inside the ball: unchanged
    torch.testing.assert_close(y[2], x[2])
    assert torch.allclose(proj(10 * torch.randn(7, 5)).norm(dim=-1), torch.tensor(2.0))


def test_layer_project_infinite_radius_is_identity():
    x = torch.randn(3, 4)
    assert torch.equal(LayerProject(math.inf)(x), x)
    with pytest.raises(ValueError):
        LayerProject(0.0)


@pytest.mark.parametrize("radius", [1.0, 2.0])
def test_layer_project_is_1_lipschitz(radius):
    check_lipschitz(LayerProject(radius), (6, 5), 1.0, scale=radius)


# -- SLL ---------------------------------------------------------------------------------------


def test_sll_residual_is_1_lipschitz():
    torch.manual_seed(0)
    layer = SLLResidual(6, 10).double()
    with torch.no_grad():  # a non-trivial scaling q and biases
        layer.q.normal_(0, 1)
        layer.bias.normal_(0, 1)
    check_lipschitz(layer, (4, 6), 1.0)


def test_sll_compute_t_formula():
    torch.manual_seed(0)
    layer = SLLResidual(3, 4).double()
    with torch.no_grad():
        layer.q.normal_()
    w, q = layer.weight.detach(), layer.q.detach()
    gram = w @ w.T
    want = torch.stack([1 / sum(abs(math.exp(-q[i]) * gram[i, j] * math.exp(q[j]))
                                for j in range(4)) for i in range(4)])
    torch.testing.assert_close(layer.compute_t().detach(), want)


# -- NormConstrainedLinear ----------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(8, 8), (5, 12), (12, 5)])
@pytest.mark.parametrize("gamma", [0.25, 1.0, 3.0])
def test_norm_constrained_linear_spectral_norm(shape, gamma):
    torch.manual_seed(0)
    layer = NormConstrainedLinear(shape[1], shape[0], gamma).double()
    with torch.no_grad():
        layer.weight.normal_()  # a generic, non-orthogonal weight
    sigma = torch.linalg.svdvals(layer.weight_effective().detach()).max().item()
    assert sigma <= gamma * (1 + TOL)
    x = torch.randn(3, shape[1], dtype=torch.float64)
    torch.testing.assert_close(layer(x), x @ layer.weight_effective().T + layer.bias)
    check_lipschitz(lambda z: layer(z), (3, shape[1]), gamma)


def test_norm_constrained_linear_orthogonal_init_reaches_gamma():
    layer = NormConstrainedLinear(6, 6, 0.5).double()
    sigma = torch.linalg.svdvals(layer.weight_effective().detach()).max().item()
    assert sigma == pytest.approx(0.5)


# -- Patch embedding and normalisation --------------------------------------------------------


def test_patchify_layout():
    x = torch.arange(2 * 2 * 4 * 4, dtype=torch.float64).reshape(2, 2, 4, 4)
    p = patchify(x, 2)
    assert p.shape == (2, 4, 8)
    torch.testing.assert_close(p[1, 1], x[1, :, 0:2, 2:4].reshape(-1))  # second patch of row 0
    torch.testing.assert_close(p[0, 2], x[0, :, 2:4, 0:2].reshape(-1))


@pytest.mark.parametrize("lipschitz", [True, False])
def test_patch_embedding_lipschitz_is_per_patch_norm(lipschitz):
    torch.manual_seed(0)
    emb = PatchEmbed(channels=2, patch=2, dim=5, lipschitz=lipschitz).double()
    with torch.no_grad():
        emb.proj.weight.normal_()
    claim = emb.compute_lipschitz()
    exact = torch.linalg.svdvals(emb.per_patch_matrix().detach()).max().item()
    assert claim == pytest.approx(exact, rel=1e-9) and claim >= exact
    if lipschitz:
        assert claim <= 1 + TOL
    x = torch.randn(1, 2, 4, 4, dtype=torch.float64)
    assert jacobian_norm(emb, x, iters=200) == pytest.approx(exact, rel=1e-6)  # attained
    check_lipschitz(emb, (1, 2, 4, 4), claim)


def test_normalize_lipschitz():
    norm = Normalize([0.5, 0.2, 0.1], [0.25, 0.5, 0.2]).double()
    assert norm.compute_lipschitz() == pytest.approx(5.0)  # 1 / min std
    check_lipschitz(norm, (1, 3, 2, 2), norm.compute_lipschitz())
    with pytest.raises(ValueError):
        Normalize([0.5], [0.0])


def test_spectral_norm_exact_is_upper():
    a = torch.randn(7, 4, dtype=torch.float64)
    s = torch.linalg.svdvals(a).max().item()
    assert s <= spectral_norm_exact(a) <= s * (1 + 1e-9)


# -- attention --------------------------------------------------------------------------------


def _reference_attention(x, wq, wk, wv, wo, heads):
    """Per-head loop: sum_l softmax(X Wq_l (X Wk_l)^T / sqrt(d_h)) X Wv_l Wo_l, (out, in) w."""
    d = x.shape[-1]
    dh = d // heads
    out = torch.zeros_like(x)
    for l in range(heads):
        sl = slice(l * dh, (l + 1) * dh)
        q, k, v = x @ wq[sl].T, x @ wk[sl].T, x @ wv[sl].T
        p = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
        out = out + p @ v @ wo[:, sl].T
    return out


@pytest.mark.parametrize("lipschitz", [True, False])
def test_attention_matches_per_head_reference(lipschitz):
    torch.manual_seed(0)
    att = MultiHeadAttention(8, 2, lipschitz, gamma_qk=2.0, gamma_vo=0.5).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    ws = [m.weight_effective() if lipschitz else m.weight for m in (att.q, att.k, att.v, att.o)]
    torch.testing.assert_close(att(x), _reference_attention(x, *ws, heads=2))
    if lipschitz:
        for m, gamma in ((att.q, 2.0), (att.k, 2.0), (att.v, 0.5), (att.o, 0.5)):
            assert torch.linalg.svdvals(m.weight_effective().detach()).max() <= gamma * (1 + TOL)


@pytest.mark.parametrize("masked", [False, True])
def test_fused_attention_equals_its_matrix_times_the_values(masked):
    """The forward's fused kernel computes P_l(X) X W_l^V W^O from the matrix compute_probs
    gives (the one the bounds and the diagnostics read), padding keys excluded, with the same
    gradients; a matrix replaced on the instance (an ablation) is used instead."""
    torch.manual_seed(0)
    att = MultiHeadAttention(8, 2, lipschitz=False, bias=True).double()
    x = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1] * 5, [1, 0, 0, 0, 0]], dtype=torch.bool)
    mask = mask if masked else None

    def explicit(z):
        heads = att.compute_probs(z, mask) @ att._split(att.v(z))
        return att.o(heads.transpose(1, 2).reshape(3, 5, 8))

    fused = att(x, mask)
    torch.testing.assert_close(fused, explicit(x), rtol=1e-12, atol=1e-12)
    g = torch.randn_like(fused)
    params = [x, *att.parameters()]
    torch.testing.assert_close(torch.autograd.grad(fused, params, g),
                               torch.autograd.grad(explicit(x), params, g),
                               rtol=1e-12, atol=1e-12)
    att.compute_probs = lambda z, m=None: torch.full((3, 2, 5, 5), 0.2, dtype=z.dtype)
    uniform = att(x, mask)
    torch.testing.assert_close(uniform, explicit(x))
    assert not torch.allclose(uniform, fused)
    del att.compute_probs

    class Uniform(MultiHeadAttention):  # a subclass that redefines the matrix: used too
        def compute_probs(self, z, m=None):
            return torch.full((3, 2, 5, 5), 0.2, dtype=z.dtype)

    att.__class__ = Uniform
    torch.testing.assert_close(att(x, mask), uniform)


def test_attention_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible"):
        MultiHeadAttention(10, 3, lipschitz=True)
    with pytest.raises(ValueError, match="bias"):
        MultiHeadAttention(8, 2, lipschitz=True, bias=True)


@pytest.mark.parametrize("lipschitz", [True, False])
def test_attention_weights_match_bounds_library(lipschitz):
    bounds = pytest.importorskip("attncert.bounds")
    torch.manual_seed(0)
    att = MultiHeadAttention(8, 4, lipschitz, gamma_qk=3.0, gamma_vo=0.7).double()
    w = att.attention_weights()
    assert isinstance(w, bounds.AttentionWeights)
    assert tuple(w.wq.shape) == (4, 8, 2) and tuple(w.wo.shape) == (4, 2, 8)
    wq = att.q.weight_effective() if lipschitz else att.q.weight
    torch.testing.assert_close(w.wq[1], wq[2:4, :].T.detach())  # the docs/math.md convention
    x = torch.randn(3, 6, 8, dtype=torch.float64)
    with torch.no_grad():
        torch.testing.assert_close(att(x), bounds.attention_forward(x, w, residual=False))
        torch.testing.assert_close(x + att(x), bounds.attention_forward(x, w, residual=True))


def test_attention_weights_refuse_biases():
    pytest.importorskip("attncert.bounds")
    att = MultiHeadAttention(8, 2, lipschitz=False, bias=True)
    with pytest.raises(ValueError, match="bias"):
        att.attention_weights()
