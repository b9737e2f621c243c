"""SpecFormer's MSVP: head blocks, power-iteration estimates, gradients and persistence."""

import pytest
import torch
from helpers import gen as _gen
from helpers import randomise
from torch import nn

from attncert.layers import (
    L2MultiHeadAttention,
    LNFormerAttention,
    MultiHeadAttention,
    ScaledCosineAttention,
)
from attncert.models.vit import build_vit
from attncert.msvp import MSVP, exact_head_sigma, find_attention_modules, head_blocks, sigma_rows

F64 = torch.float64
DIM, HEADS = 8, 2


def _mha(seed, lipschitz=False):
    return randomise(MultiHeadAttention(DIM, HEADS, lipschitz=lipschitz), seed, scale=1.0)


def _converge(msvp, steps=80):
    """Power steps; for these seeded weights the estimates are within 1e-6 after ~40."""
    for _ in range(steps):
        msvp.power_step()


def test_penalised_blocks_are_the_heads():
    """After convergence each estimate is ||W^{map,h}|| of the head matrices the bounds
    library uses (MultiHeadAttention.attention_weights, x W convention), to 1e-4; the
    column blocks (SpecFormer's public code) have different norms."""
    model = nn.ModuleDict({"a": _mha(0), "b": _mha(1)})
    msvp = MSVP(model, generator=_gen(2))
    _converge(msvp)
    est, exact_all = msvp.sigma(), exact_head_sigma(model)
    assert list(est) == ["a", "b"]
    for name, att in model.items():
        w = att.attention_weights()
        for m, heads in (("q", w.wq), ("k", w.wk), ("v", w.wv)):
            exact = torch.linalg.matrix_norm(heads, 2)  # (h,), heads (h, d, d_h)
            torch.testing.assert_close(est[name][m], exact, rtol=1e-4, atol=0)
            torch.testing.assert_close(exact_all[name][m], exact)
            columns = getattr(att, m).weight.reshape(DIM, HEADS, DIM // HEADS).transpose(0, 1)
            assert (torch.linalg.matrix_norm(columns, 2) - exact).abs().min() > 1e-2


def test_one_step_per_training_call_and_none_in_eval():
    msvp = MSVP(_mha(3), generator=_gen(4))
    before = {k: v.clone() for k, v in msvp.state_dict().items()}
    msvp()
    after = msvp.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in before)
    ref = MSVP(_mha(3), generator=_gen(4))
    ref.power_step()  # the same single step
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(after[k], v)
    frozen = {k: v.clone() for k, v in after.items()}
    msvp.eval()
    msvp()
    assert all(torch.equal(frozen[k], v) for k, v in msvp.state_dict().items())


def test_penalty_value_and_analytic_gradient():
    """penalty = sum lam s^2 with s = u^T W_h v; d/dW_h = 2 lam s u v^T on the head's rows."""
    att = _mha(5)
    lam = {"q": 0.3, "k": 0.02, "v": 1.5}
    msvp = MSVP(att, lam["q"], lam["k"], lam["v"], generator=_gen(6))
    penalty = msvp()
    s = msvp.sigma()[""]
    expect = sum(lam[m] * s[m].pow(2).sum() for m in ("q", "k", "v"))
    torch.testing.assert_close(penalty.detach(), expect)
    penalty.backward()
    d_h = DIM // HEADS
    vec = msvp.vectors[0]
    for m in ("q", "k", "v"):
        grad = getattr(att, m).weight.grad
        u, v = getattr(vec, f"u_{m}"), getattr(vec, f"v_{m}")
        for h in range(HEADS):
            block = grad[h * d_h:(h + 1) * d_h, :]
            analytic = 2 * lam[m] * s[m][h] * torch.outer(u[h], v[h])
            torch.testing.assert_close(block, analytic)


def test_gradient_matches_exact_norm_at_convergence():
    att = _mha(7)
    msvp = MSVP(att, 1e-2, 2e-2, 3e-2, generator=_gen(8))
    _converge(msvp, 200)  # the vectors (not only the values) must have converged
    msvp.eval()
    msvp().backward()
    grads = {m: getattr(att, m).weight.grad.clone() for m in ("q", "k", "v")}
    att.zero_grad()
    exact = sum(lam * torch.linalg.matrix_norm(head_blocks(att, m), 2).pow(2).sum()
                for m, lam in (("q", 1e-2), ("k", 2e-2), ("v", 3e-2)))
    exact.backward()
    for m in ("q", "k", "v"):
        torch.testing.assert_close(grads[m], getattr(att, m).weight.grad, rtol=1e-6, atol=1e-9)


def test_vectors_persist_in_state_dict():
    att = _mha(9)
    msvp = MSVP(att, generator=_gen(10))
    for _ in range(5):
        msvp()
    state = msvp.state_dict()
    assert sorted(state) == sorted(f"vectors.0.{x}_{m}" for x in "uv" for m in "qkv")
    assert state["vectors.0.u_q"].shape == (HEADS, DIM // HEADS)
    assert state["vectors.0.v_q"].shape == (HEADS, DIM)
    restored = MSVP(att, generator=_gen(11))  # different initial vectors
    restored.load_state_dict(state)
    for m in ("q", "k", "v"):
        torch.testing.assert_close(restored.sigma()[""][m], msvp.sigma()[""][m])
    assert not any(k.endswith("weight") for k in state)  # the model is not registered


def test_finds_every_attention_variant_and_ties_keys():
    torch.manual_seed(13)  # seeded weights: unseeded, a close second singular value kept
    model = nn.ModuleDict({  # one estimate in ten runs from converging in 80 steps
        "mha": MultiHeadAttention(DIM, HEADS, lipschitz=False),
        "lip": MultiHeadAttention(DIM, HEADS, lipschitz=True, gamma_qk=0.5),
        "l2": L2MultiHeadAttention(DIM, HEADS),
        "ln": LNFormerAttention(DIM, HEADS),
        "cos": ScaledCosineAttention(DIM, HEADS),
        "other": nn.Linear(DIM, DIM),
    }).double()
    assert list(find_attention_modules(model)) == ["mha", "lip", "l2", "ln", "cos"]
    msvp = MSVP(model, 1.0, 2.0, 3.0, generator=_gen(12))
    _converge(msvp)
    penalty = msvp()
    est, exact = msvp.sigma(), exact_head_sigma(model)
    assert not hasattr(msvp.vectors[2], "u_k")  # tied keys: one pair of vectors for W^Q = W^K
    torch.testing.assert_close(est["l2"]["k"], est["l2"]["q"])
    for name in est:
        for m in ("q", "k", "v"):
            torch.testing.assert_close(est[name][m], exact[name][m], rtol=1e-4, atol=0)
    # the constrained layer is penalised on its effective matrices (norm <= gamma_qk)
    assert exact["lip"]["q"].max() <= 0.5 + 1e-9
    expect = sum(lam * est[n][m].pow(2).sum() for n in est
                 for m, lam in (("q", 1.0), ("k", 2.0), ("v", 3.0)))
    torch.testing.assert_close(penalty.detach(), expect)


def test_vit_discovery_and_tidy_rows():
    cfg = {"image_size": 8, "patch": 4, "dim": DIM, "depth": 2, "heads": HEADS,
           "mlp_hidden": 8, "kind": "standard"}
    model = build_vit(cfg)
    msvp = MSVP(model)
    assert msvp.names == ["blocks.0.attn", "blocks.1.attn"]
    assert msvp().dim() == 0
    rows = sigma_rows(exact_head_sigma(model))
    assert len(rows) == 2 * 3 * HEADS
    assert rows[0] == {"layer": "blocks.0.attn", "depth": 0, "map": "q", "head": 0,
                       "sigma": pytest.approx(rows[0]["sigma"])}
    assert {r["depth"] for r in rows} == {0, 1} and len(sigma_rows(msvp.sigma())) == len(rows)


def test_rejects_models_without_attention():
    with pytest.raises(ValueError, match="no attention"):
        MSVP(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="exactly one"):
        MSVP()
    with pytest.raises(ValueError, match="not an attention"):
        MSVP(modules={"x": nn.Linear(4, 4)})


@pytest.mark.parametrize("kind", ["standard", "lipschitz"])
def test_a_training_call_batches_the_maps_as_the_loop_computes_them(kind):
    """A training call's penalty, its gradient and the vectors it leaves equal the loop over
    layers and maps (power_step, then s = u^T W_h v per head); its kernels do not grow with
    the depth: one batch per kind of map, not a loop (about 800 kernels at depth 12)."""
    from attncert.cost.counting import count

    def vit(depth):
        torch.manual_seed(0)
        return build_vit({"image_size": 8, "patch": 4, "dim": DIM, "depth": depth,
                          "heads": HEADS, "mlp_hidden": 8, "kind": kind}).double()

    lam = (0.3, 0.02, 1.5)
    model, ref_model = vit(4), vit(4)
    msvp, ref = MSVP(model, *lam, generator=_gen(3)), MSVP(ref_model, *lam, generator=_gen(3))
    for _ in range(3):  # three training calls, the vectors carried between them
        model.zero_grad()
        ref_model.zero_grad()
        penalty = msvp()
        penalty.backward()
        ref.power_step()
        expect = sum(w * s[m].pow(2).sum() for s in ref._sigmas()
                     for m, w in zip(("q", "k", "v"), lam, strict=True))
        expect.backward()
        torch.testing.assert_close(penalty.detach(), expect.detach(), rtol=1e-12, atol=0)
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(msvp.state_dict()[k], v, rtol=1e-12, atol=1e-15)
        for a, b in zip(model.parameters(), ref_model.parameters(), strict=True):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-15)
    kernels, loop = {}, {}
    for depth in (2, 8):
        m = MSVP(vit(depth), *lam, generator=_gen(3))
        kernels[depth] = count(lambda m=m: m().backward())[1]
        loop[depth] = count(lambda m=m: (m.power_step(), sum(
            w * s[k].pow(2).sum() for s in m._sigmas()
            for k, w in zip(("q", "k", "v"), lam, strict=True)).backward()))[1]
    # six more layers, 18 more maps: the batch adds none of its own kernels (a constrained
    # map's effective weight still costs its own, in either form), the loop some 20 a map
    if kind == "standard":
        assert kernels[2] == kernels[8], kernels
    assert loop[8] - loop[2] - (kernels[8] - kernels[2]) >= 10 * 18, (kernels, loop)
    assert kernels[8] * (3 if kind == "standard" else 1.5) < loop[8], (kernels, loop)
