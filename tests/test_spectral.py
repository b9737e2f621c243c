"""Spectral norms: exact and Lanczos paths, certificate mode, zeta and ||M_l|| vs dense."""

import pytest
import torch
from helpers import gen as _gen
from helpers import random_attention_weights as _weights

from attncert.bounds import (
    LinearOperator,
    attention_probs,
    m_operator,
    m_spectral,
    norm_of_product,
    spectral_norm,
    xi,
    zeta_cheap_upper,
    zeta_operator,
    zeta_spectral,
)
from attncert.bounds.spectral import KW_LOOSENESS, kw_steps

F64 = torch.float64


def _dense(op: LinearOperator) -> torch.Tensor:
    """Materialise a batched operator by applying it to every basis vector (tests only)."""
    numel = 1
    for s in op.in_shape:
        numel *= s
    eye = torch.eye(numel, dtype=op.dtype).reshape(numel, *op.in_shape)
    cols = []
    for i in range(numel):
        e = eye[i].expand(*op.batch_shape, *op.in_shape)
        cols.append(op.apply(e).reshape(*op.batch_shape, -1))
    return torch.stack(cols, -1)


def _spectrum_matrix(svals, m, n, g):
    u, _ = torch.linalg.qr(torch.randn(m, m, generator=g, dtype=F64))
    v, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    k = len(svals)
    return u[:, :k] @ torch.diag(torch.tensor(svals, dtype=F64)) @ v[:, :k].T


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("shape", [(7, 5), (3, 20), (30, 30)])
def test_exact_path_matches_svd_and_pads_up(seed, shape):
    a = torch.randn(4, *shape, generator=_gen(seed), dtype=F64)
    ref = torch.linalg.svdvals(a)[..., 0]
    res = spectral_norm(a)
    assert torch.all(res.value >= ref)
    torch.testing.assert_close(res.value, ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(spectral_norm(a, mode="estimate").value, ref)


@pytest.mark.parametrize("gap", [0.0, 1e-10, 1e-6, 1e-3, 1e-1, 0.5])
@pytest.mark.parametrize("seed", range(4))
def test_lanczos_upper_is_sound_near_degenerate(gap, seed):
    """Certificate mode >= exact SVD for top singular values that (nearly) coincide."""
    g = _gen(seed)
    m, n = 40, 30
    rest = torch.rand(25, generator=g, dtype=F64).sort(descending=True).values * 0.99
    svals = [1.0, 1.0 - gap, 1.0 - 2 * gap] + rest.tolist()
    a = torch.stack([_spectrum_matrix(svals, m, n, g) for _ in range(3)])
    ref = torch.linalg.svdvals(a)[..., 0]
    res = spectral_norm(a, method="lanczos", generator=g)
    assert bool(res.converged.all())
    assert torch.all(res.value >= ref), res.value - ref
    assert torch.all(res.value <= ref * (1 + 5e-4))
    assert torch.all(res.estimate <= ref * (1 + 1e-12))


@pytest.mark.parametrize("seed", range(10))
def test_lanczos_upper_random_cases_both_dtypes(seed):
    g = _gen(seed)
    for dtype in (torch.float32, F64):
        a = torch.randn(2, 3, 50, 16, generator=g, dtype=F64) * 10 ** (seed % 3 - 1)
        ref = torch.linalg.svdvals(a)[..., 0]
        res = spectral_norm(a.to(dtype), method="lanczos", generator=g)
        assert res.value.shape == (2, 3)
        assert torch.all(res.value.double() >= ref), (dtype, res.value.double() - ref)


def test_reorthogonalisation_reaches_working_precision_when_the_first_pass_cancels(monkeypatch):
    # w almost inside span(V): one classical Gram-Schmidt pass leaves components along V of
    # order eps ||w|| against a remainder 1e-9 ||w|| (relative orthogonality about 1e-7); the
    # criterion's second pass brings it to working precision, also when only one entry of the
    # batch cancels. A batch of w far from span(V) takes one pass.
    from attncert.bounds import spectral

    g = _gen(2)
    vs = torch.linalg.qr(torch.randn(3, 200, 20, generator=g, dtype=F64)).Q.transpose(1, 2)
    inside = vs[:, 0] + vs[:, 7] + 1e-9 * torch.randn(3, 200, generator=g, dtype=F64)
    inside[1] = torch.randn(200, generator=g, dtype=F64)  # a mixed batch: entry 1 does not cancel
    w, norm = spectral._reorthogonalise(vs, inside)
    torch.testing.assert_close(norm, w.norm(dim=-1), rtol=1e-15, atol=0)
    leak = (vs @ w.unsqueeze(-1)).squeeze(-1).abs().amax(-1) / norm
    assert bool((leak < 1e-13).all()), leak
    calls, real = [], spectral._remove
    monkeypatch.setattr(spectral, "_remove", lambda v, x: calls.append(1) or real(v, x))
    spectral._reorthogonalise(vs, torch.randn(3, 200, generator=g, dtype=F64))
    assert len(calls) == 1


def test_unconverged_uses_fallback_or_raises():
    g = _gen(0)
    a = torch.randn(3, 60, 60, generator=g, dtype=F64)
    fb = torch.linalg.matrix_norm(a, "fro")
    res = spectral_norm(a, method="lanczos", max_iter=2, fallback=lambda: fb, generator=g)
    assert not bool(res.converged.any())
    torch.testing.assert_close(res.value, fb)
    with pytest.raises(RuntimeError, match="not converged"):
        spectral_norm(a, method="lanczos", max_iter=2, generator=g)
    with pytest.raises(RuntimeError):
        spectral_norm(a, method="lanczos", max_iter=2, fallback=lambda: fb, on_fail="raise")
    # estimate mode reports the lower estimate and the flag instead
    est = spectral_norm(a, method="lanczos", max_iter=2, mode="estimate", generator=g)
    assert torch.all(est.value <= torch.linalg.svdvals(a)[..., 0] * (1 + 1e-12))


def test_failure_prob_option_enlarges_value():
    g = _gen(1)
    a = torch.randn(2, 200, 100, generator=g, dtype=F64)
    plain = spectral_norm(a, method="lanczos", generator=_gen(3))
    kw = spectral_norm(a, method="lanczos", failure_prob=1e-3, max_iter=100, generator=_gen(3))
    assert torch.all(kw.value >= plain.value * (1 - 1e-12))
    assert torch.all(kw.failure_prob <= 1e-3 * (1 + 1e-9))
    assert torch.all(kw.value >= torch.linalg.svdvals(a)[..., 0])


def test_m_norm_runs_on_its_smaller_side_exactly_without_a_kw_raise():
    # ||M_l|| maps n x r to n x n: Lanczos on the n^2 side fills its Krylov space in n^2 steps
    g = _gen(5)
    w = _weights(2, 16, 1.0, g)
    x = torch.randn(3, 3, 16, generator=g, dtype=F64)
    res = m_spectral(x, w, tol=1e-12, generator=g)
    dense = torch.linalg.svdvals(_dense(m_operator(x, w)))[..., 0]
    assert res.iterations <= 9 and bool((res.failure_prob == 0).all())
    assert torch.all(res.value >= dense) and torch.all(res.value <= dense * (1 + 2e-4))  # margin
    with pytest.raises(ValueError, match="side"):
        spectral_norm(m_operator(x, w), side="left")


def test_kw_steps_is_the_fewest_that_reach_the_probability():
    import math

    def kw(k, dim=640, e=0.02):
        return 1.648 * math.sqrt(dim) * math.exp(-math.sqrt(e) * (2 * k - 1))

    k = kw_steps(640, 1e-9, 0.02)
    assert kw(k) <= 1e-9 < kw(k - 1)
    with pytest.raises(ValueError, match="failure_prob"):
        kw_steps(640, 0.0)


def test_a_lower_pair_with_a_small_residual_is_caught_by_the_kw_steps():
    # the top two singular values 0.5% apart and a start almost blind to the top one: the
    # residual test alone stops on the second pair below ||A||; held to the KW bound, the
    # iteration runs its steps and the value bounds ||A||
    n = 300
    s = torch.cat([torch.tensor([1.0, 0.995]), torch.linspace(0.5, 0.01, n - 2)]).to(F64)
    a = torch.diag(s)[None]
    x0 = torch.ones(1, n, dtype=F64)
    x0[0, 0] = 1e-6
    plain = spectral_norm(a, method="lanczos", tol=1e-3, x0=x0)
    assert bool(plain.converged.all()) and float(plain.value) < 1.0  # the trap
    held = spectral_norm(a, method="lanczos", tol=1e-3, failure_prob=1e-9, x0=x0)
    assert held.iterations >= kw_steps(n, 1e-9) and float(held.value) >= 1.0


@pytest.mark.parametrize("seed", range(3))
def test_norm_of_product_exact(seed):
    g = _gen(seed)
    u = torch.randn(5, 9, 3, generator=g, dtype=F64)
    v = torch.randn(7, 3, generator=g, dtype=F64)
    ref = torch.linalg.svdvals(u @ v.T)[..., 0]
    torch.testing.assert_close(norm_of_product(u, v, "estimate"), ref)
    assert torch.all(norm_of_product(u, v) >= ref)


CASES = [
    # (n, d, h, weight scale, input scale)
    (4, 8, 1, 1.0, 1.0),
    (6, 8, 2, 0.5, 0.1),
    (8, 12, 4, 1.0, 3.0),
    (5, 12, 2, 0.3, 10.0),
    (8, 8, 4, 2.0, 0.01),
]


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_zeta_matches_dense_operator(case, residual):
    n, d, h, ws, xs = case
    g = _gen(hash(case) % 1000)
    w = _weights(h, d, ws, g)
    x = torch.randn(3, n, d, generator=g, dtype=F64) * xs
    dense = _dense(zeta_operator(attention_probs(x, w), w, residual))
    ref = torch.linalg.svdvals(dense)[..., 0]
    est = zeta_spectral(x, w, residual, mode="estimate", tol=1e-11, max_iter=n * d, generator=g)
    torch.testing.assert_close(est.value, ref, rtol=1e-6, atol=1e-12)
    up = zeta_spectral(x, w, residual, generator=g)
    assert bool(up.converged.all())
    assert torch.all(up.value >= ref)
    # the KW raise: at most 1 / sqrt(1 - KW_LOOSENESS) above the converged value
    assert torch.all(up.value <= ref * (1 + 1e-3) / (1 - KW_LOOSENESS) ** 0.5)
    cheap = zeta_cheap_upper(attention_probs(x, w), w, residual)
    assert torch.all(cheap >= ref * (1 - 1e-12))
    # a forced fallback is still an upper bound
    fb = zeta_spectral(x, w, residual, max_iter=1, generator=g)
    assert torch.all(fb.value >= ref * (1 - 1e-12))


@pytest.mark.parametrize("case", CASES)
def test_m_norm_matches_dense_operator(case):
    n, d, h, ws, xs = case
    g = _gen(hash(case) % 997)
    w = _weights(h, d, ws, g)
    x = torch.randn(3, n, d, generator=g, dtype=F64) * xs
    dense = _dense(m_operator(x, w))  # (B, h, n*n, n*d)
    ref = torch.linalg.svdvals(dense)[..., 0]
    est = m_spectral(x, w, mode="estimate", tol=1e-11, max_iter=n * d, generator=g)
    torch.testing.assert_close(est.value, ref, rtol=1e-6, atol=1e-12)
    up = m_spectral(x, w, generator=g)
    assert torch.all(up.value >= ref)
    assert torch.all(xi(x, w) >= ref * (1 - 1e-12))


def test_zeta_gradient_matches_finite_difference():
    g = _gen(7)
    w = _weights(2, 8, 0.7, g)
    x = torch.randn(2, 5, 8, generator=g, dtype=F64, requires_grad=True)
    kw = dict(mode="estimate", tol=1e-12, max_iter=40)
    val = zeta_spectral(x, w, True, generator=_gen(0), **kw).value
    (grad,) = torch.autograd.grad(val.sum(), x)
    direction = torch.randn(x.shape, generator=g, dtype=F64)
    h = 1e-6
    with torch.no_grad():
        up = zeta_spectral(x + h * direction, w, True, generator=_gen(0), **kw).value.sum()
        dn = zeta_spectral(x - h * direction, w, True, generator=_gen(0), **kw).value.sum()
    torch.testing.assert_close((grad * direction).sum(), (up - dn) / (2 * h), rtol=1e-4, atol=1e-8)


def test_top_eigenvalue_routes_small_device_batches_to_the_host(monkeypatch):
    """Many small symmetric matrices on an accelerator are solved on the host: the same
    largest eigenvalues, the result on the device, in the autograd graph."""
    from simdevice import simulated_device

    from attncert.bounds import spectral

    g = torch.Generator().manual_seed(0)
    a = torch.randn(6, 5, 5, generator=g, dtype=torch.float64)
    sym = a @ a.transpose(-1, -2)
    want = torch.linalg.eigvalsh(sym)[..., -1]
    monkeypatch.setattr(spectral, "HOST_EIGH_DEVICES", ("simdev",))
    with simulated_device() as sim:
        on_dev = torch.tensor(sym.tolist(), dtype=torch.float64,
                              device=sim.device).detach().requires_grad_(True)
        top = spectral.top_eigenvalue(on_dev)
        assert top.device == sim.device and sim.host_syncs == 1  # the one copy to the host
        assert top.requires_grad
        assert torch.allclose(top.detach().cpu(), want, rtol=1e-12)
