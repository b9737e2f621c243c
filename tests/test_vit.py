"""The ViT skeleton: config validation, block forms, the certification interface."""

import math

import pytest
import torch

from attncert.models import Component, ViTConfig, build_vit, lipschitz_product, propagate

TINY = dict(image_size=8, channels=2, patch=4, dim=8, depth=2, heads=2, mlp_hidden=12,
            num_classes=3, mean=(0.4, 0.5), std=(0.2, 0.25))


def tiny(**kw):
    torch.manual_seed(0)
    return build_vit(ViTConfig(**{**TINY, **kw})).double().eval()


def images(b=3, seed=0):
    return torch.rand(b, 2, 8, 8, generator=torch.Generator().manual_seed(seed),
                      dtype=torch.float64)


@pytest.mark.parametrize("bad, match", [
    (dict(dim=10, heads=3), "divisible by heads"),
    (dict(kind="lipshitz"), "kind"),
    (dict(block="post"), "block"),
    (dict(pool="max"), "pool"),
    (dict(image_size=10), "patch"),
    (dict(depth=0), "depth"),
    (dict(dim=8.0), "dim"),
    (dict(radius_attn=0.0), "radius_attn"),
    (dict(gamma_vo=-1.0), "gamma_vo"),
    (dict(mean=(0.5,)), "mean"),
    (dict(std=(0.2, 0.0)), "std"),
    (dict(attn_bias=True), "bias"),
    (dict(head_norm=1), "head_norm"),
])
def test_config_rejects_nonsense(bad, match):
    with pytest.raises(ValueError, match=match):
        ViTConfig(**{**TINY, **bad})


def test_config_from_dict_rejects_unknown_keys_and_roundtrips():
    with pytest.raises(ValueError, match="unknown key"):
        ViTConfig.from_dict({**TINY, "dropout": 0.1})
    cfg = ViTConfig.from_dict({**TINY, "mean": [0.4, 0.5]})
    assert cfg.mean == (0.4, 0.5)
    assert ViTConfig.from_dict(cfg.to_dict()) == cfg
    assert ViTConfig(**{**TINY, "radius_stream": None}).stream_radius == math.sqrt(8)


@pytest.mark.parametrize("kind", ["lipschitz", "standard"])
@pytest.mark.parametrize("block", ["stream", "prenorm"])
@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_forward_shapes_and_attention_inputs(kind, block, pool):
    model = tiny(kind=kind, block=block, pool=pool)
    x = images()
    logits, inputs = model.attention_inputs(x)
    torch.testing.assert_close(logits, model(x))
    n = 4 + (pool == "cls")
    assert list(inputs) == ["blocks.0.attn", "blocks.1.attn"]
    assert all(t.shape == (3, n, 8) and not t.requires_grad for t in inputs.values())
    names = [c.name for c in model.components() if c.kind == "attention"]
    assert names == list(inputs)
    # the taps are what each attention module receives (checked with hooks)
    seen = {}
    handles = [m.register_forward_pre_hook(lambda _m, a, name=name: seen.__setitem__(name, a[0]))
               for name, m in model.attention_modules().items()]
    model(x)
    for h in handles:
        h.remove()
    assert all(torch.equal(seen[name], t) for name, t in inputs.items())


def test_stream_block_is_residual_attention_on_projected_stream():
    model = tiny(radius_attn=0.5)
    x = images()
    _, inputs = model.attention_inputs(x)
    blk = model.blocks[0]
    with torch.no_grad():
        stream = model.tokens(x)
        x0 = inputs["blocks.0.attn"]
        torch.testing.assert_close(x0, blk.norm_attn(stream))  # the projected stream itself
        assert (x0.norm(dim=-1) <= 0.5 + 1e-12).all()
        torch.testing.assert_close(blk(stream), blk.mlp(blk.norm_mlp(x0 + blk.attn(x0))))
    bounds = pytest.importorskip("attncert.bounds")
    w = blk.attn.attention_weights()
    with torch.no_grad():
        torch.testing.assert_close(blk.norm_mlp(bounds.attention_forward(x0, w, residual=True)),
                                   blk.norm_mlp(x0 + blk.attn(x0)))


def test_prenorm_block():
    model = tiny(block="prenorm")
    blk = model.blocks[0]
    t = model.tokens(images()).detach()
    with torch.no_grad():
        torch.testing.assert_close(blk(t), blk.mlp(blk.norm_mlp(t + blk.attn(blk.norm_attn(t)))))
    att = [c for c in model.components() if c.kind == "attention"]
    assert all(c.residual == "skip" and c.pre_lipschitz == 1.0 for c in att)


def test_components_constants():
    model = tiny(pool="mean")
    comps = {c.name: c for c in model.components()}
    assert comps["normalize"].lipschitz == pytest.approx(1 / 0.2)
    assert model.input_lipschitz() == pytest.approx(1 / 0.2)
    emb = torch.linalg.svdvals(model.embed.per_patch_matrix().detach()).max().item()
    assert comps["embed"].lipschitz == pytest.approx(emb) and emb <= 1 + 1e-9
    assert comps["pool"].lipschitz == pytest.approx(1 / math.sqrt(4))
    head = comps["head"]
    assert head.weight.shape == (3, 8) and head.kind == "head"
    assert head.lipschitz >= torch.linalg.svdvals(model.head.weight.detach()).max().item()
    assert comps["blocks.0.attn"].residual == "identity"
    assert comps["blocks.0.mlp"].kind == "sll" and comps["blocks.0.mlp"].lipschitz == 1.0
    assert model.global_lipschitz_upper() == math.inf  # dot-product attention: no constant
    std = tiny(kind="standard")
    assert [c.lipschitz for c in std.components() if c.kind == "layernorm"] == [math.inf] * 3


def test_head_norm_unit_rows_in_forward_and_components():
    model = tiny(pool="mean", head_norm=True)
    with torch.no_grad():
        model.head.weight.mul_(torch.arange(1, 4, dtype=torch.float64)[:, None] * 5)
    w = model.head_weight()
    assert torch.allclose(w.norm(dim=1), torch.ones(3, dtype=torch.float64))
    x = images()
    feats = model.features(x)
    assert torch.allclose(model(x), feats @ w.T + model.head.bias)
    head = {c.name: c for c in model.components()}["head"]
    assert torch.equal(head.weight, w.detach())
    assert head.lipschitz >= torch.linalg.svdvals(w.detach()).max().item()
    plain = tiny(pool="mean")
    assert torch.equal(plain.head_weight(), plain.head.weight)
    assert ViTConfig.from_dict({**TINY, "head_norm": True}).to_dict()["head_norm"] is True


def _jacobian_norm(f, x):
    """Exact ||J_f(x)|| from the dense Jacobian (small sizes)."""
    jac = torch.autograd.functional.jacobian(f, x)
    return torch.linalg.svdvals(jac.reshape(f(x).numel(), x.numel())).max().item()


def test_product_before_first_attention_bounds_the_jacobian():
    """Pixels -> first attention input: empirical Jacobian norm <= product of constants."""
    model = tiny()
    comps = model.components()
    first = next(i for i, c in enumerate(comps) if c.kind == "attention")
    claim = lipschitz_product(comps[:first])

    def to_x0(x):
        return model.blocks[0].norm_attn(model.tokens(x))

    for seed in range(3):
        assert _jacobian_norm(to_x0, images(1, seed)) <= claim * (1 + 1e-9)
    tail = comps[comps.index(next(c for c in comps if c.name == "norm")):-1]
    assert lipschitz_product(tail) == 1.0  # final projection, cls pooling


def test_propagate_arithmetic():
    model = tiny(block="prenorm", pool="mean")
    comps = model.components()
    _, inputs = model.attention_inputs(images())
    seen = []

    def fake_delta(c: Component, x, eps):
        seen.append((c.name, c.residual))
        return 3.0 * eps

    e = propagate(comps, inputs, 0.1, fake_delta)
    l_in = comps[0].lipschitz * comps[1].lipschitz
    want = 0.1 * l_in * 4 * 4 / 2  # two skip blocks (eps + 3 eps), mean pooling 1/sqrt(4)
    torch.testing.assert_close(e, torch.full((3,), want, dtype=torch.float64))
    assert seen == [("blocks.0.attn", "skip"), ("blocks.1.attn", "skip")]


@pytest.mark.parametrize("block", ["stream", "prenorm"])
def test_live_constants_bound_the_exact_ones_and_propagate_needs_them(block):
    """``components(exact=False)`` leaves the constants read from the weights NaN;
    ``live_constants`` gives the normalisation's exactly and an upper bound of the embedding's
    within the factor k^(1/1024) of a Gram matrix's bound; with them ``propagate`` is the exact
    propagation up to that factor, and without them it refuses."""
    model = tiny(block=block, pool="mean")
    with torch.no_grad():  # an embedding whose singular values are far from equal
        e = model.embed.proj.weight
        e.mul_(torch.linspace(0.1, 3.0, e.shape[1], dtype=e.dtype))
    exact = {c.name: c.lipschitz for c in model.components()}
    comps = model.components(exact=False)
    structure = {c.name: c.lipschitz for c in comps}
    assert [n for n, v in structure.items() if math.isnan(v)] == ["normalize", "embed", "head"]
    assert all(structure[n] == exact[n] for n in structure if n not in ("normalize", "embed",
                                                                        "head"))
    live = model.live_constants()
    assert live["normalize"].item() == exact["normalize"]
    m = model.embed.per_patch_matrix().detach().double()
    top, k = torch.linalg.svdvals(m).max().item(), min(m.shape)  # exact's SVD, unpadded
    assert top <= live["embed"].item() <= top * k ** (1 / 1024) * (1 + 1e-9)
    _, inputs = model.attention_inputs(images())

    def delta(c, x, eps):
        return 2.0 * eps

    want = propagate(model.components(), inputs, 0.1, delta)
    got = propagate(comps, inputs, torch.tensor(0.1, dtype=torch.float64), delta, live)
    ratio = got / want
    assert bool((ratio >= 1 - 1e-9).all()) and bool((ratio <= k ** (1 / 512) + 1e-9).all())
    with pytest.raises(ValueError, match="component 'normalize'.*pass it in live"):
        propagate(comps, inputs, 0.1, delta)
    with pytest.raises(ValueError, match=r"live constants of no component: \['embedding'\]"):
        propagate(comps, inputs, 0.1, delta, {**live, "embedding": live["embed"]})


@pytest.mark.parametrize("block", ["stream", "prenorm"])
def test_propagate_with_lofast_is_sound(block):
    """Feature perturbation never exceeds the propagated LoFAST bound (gradient ascent)."""
    bounds = pytest.importorskip("attncert.bounds")
    model = tiny(block=block, gamma_qk=2.0)
    x = images(2)
    _, inputs = model.attention_inputs(x)

    def delta(c, xk, eps):
        return bounds.lofast_bound(xk, c.module.attention_weights(), eps,
                                   residual=c.residual == "identity")

    eps = 0.05
    bound = propagate(model.components(), inputs, eps, delta)
    with torch.no_grad():
        clean = model.features(x)
    g = torch.Generator().manual_seed(0)
    d = torch.randn(x.shape, generator=g, dtype=x.dtype)
    for _ in range(30):
        d = (eps * d / d.flatten(1).norm(dim=1).view(-1, 1, 1, 1)).requires_grad_(True)
        gap = (model.features(x + d) - clean).norm(dim=1)
        (grad,) = torch.autograd.grad(gap.sum(), d)
        assert (gap.detach() <= bound * (1 + 1e-9)).all()
        d = (d + 0.5 * eps * grad / grad.flatten(1).norm(dim=1).view(-1, 1, 1, 1)).detach()


# -- the baselines of the SpecFormer study (standard ViT only) ------------------------------

BASELINES = {
    "l2former": dict(attention="l2"),
    "lnformer": dict(attention="lnformer"),
    "lipsformer": dict(attention="cosine", norm="center", residual_scale=0.5,
                       spectral_init=True),
}


@pytest.mark.parametrize("block", ["stream", "prenorm"])
@pytest.mark.parametrize("name", sorted(BASELINES))
def test_baselines_build_forward_and_roundtrip(tmp_path, name, block):
    from attncert.layers import (
        CenterNorm,
        L2MultiHeadAttention,
        LNFormerAttention,
        ResidualScale,
        ScaledCosineAttention,
    )
    from attncert.models import load_vit, save_vit

    model = tiny(kind="standard", block=block, attn_bias=True, **BASELINES[name])
    cls = {"l2former": L2MultiHeadAttention, "lnformer": LNFormerAttention,
           "lipsformer": ScaledCosineAttention}[name]
    assert all(isinstance(b.attn, cls) for b in model.blocks)
    x = images()
    logits, inputs = model.attention_inputs(x)
    assert logits.shape == (3, 3) and torch.isfinite(logits).all()
    assert set(inputs) == {"blocks.0.attn", "blocks.1.attn"}
    if name == "lipsformer":
        assert isinstance(model.norm, CenterNorm)
        assert isinstance(model.blocks[0].norm_mlp, CenterNorm)
        assert isinstance(model.blocks[0].scale_attn, ResidualScale)
        for m in (model.blocks[0].attn.q, model.blocks[1].mlp.fc2):  # spectral_init: ||W|| = 1
            assert torch.linalg.matrix_norm(m.weight, 2).item() == pytest.approx(1.0, abs=1e-6)
    path = tmp_path / "m.pt"
    save_vit(model, path)
    again = load_vit(path).double()
    assert again.config == model.config
    torch.testing.assert_close(again(x), model(x))
    # no local bound exists for these attentions: the certification interface says so
    comps = model.components()
    assert [c.kind for c in comps].count("attention_variant") == 2
    assert "attention" not in [c.kind for c in comps]
    assert math.isinf(model.global_lipschitz_upper())


def test_default_config_builds_the_plain_standard_vit_identically():
    """The baseline options at their defaults change nothing (weights, outputs, components)."""
    plain = tiny(kind="standard", block="prenorm")
    explicit = tiny(kind="standard", block="prenorm", attention="dot", norm="layernorm",
                    residual_scale=0.0, spectral_init=False)
    for (k, a), (_, b) in zip(plain.state_dict().items(), explicit.state_dict().items(),
                              strict=True):
        torch.testing.assert_close(a, b, msg=k)
    assert [c.kind for c in plain.components()] == [c.kind for c in explicit.components()]
    assert not plain.config.baseline


def test_centernorm_components_have_finite_constants():
    model = tiny(kind="standard", block="stream", norm="center")
    kinds = {c.name: (c.kind, c.lipschitz) for c in model.components()}
    assert kinds["norm"][0] == "centernorm" and kinds["norm"][1] == pytest.approx(8 / 7)
    assert kinds["blocks.0.norm_attn"][0] == "centernorm"


@pytest.mark.parametrize("bad, match", [
    (dict(attention="l2"), "kind = 'standard'"),
    (dict(kind="standard", attention="flash"), "attention"),
    (dict(kind="standard", norm="batch"), "norm"),
    (dict(kind="standard", residual_scale=-0.1), "residual_scale"),
    (dict(kind="standard", spectral_init=1), "spectral_init"),
])
def test_baseline_options_are_validated(bad, match):
    with pytest.raises(ValueError, match=match):
        ViTConfig(**{**TINY, **bad})


def test_certification_refuses_the_baselines():
    from attncert.certify import precompute

    model = tiny(kind="standard", block="stream", norm="center", attention="cosine")
    with pytest.raises(ValueError, match="no Lipschitz constant"):
        precompute(model, images())


def test_tied_keys_share_the_query_map_and_certify_against_an_attack():
    """qk_tied: one module for W^Q and W^K (B = W^Q W^Q^T), saved and loaded as one; its
    LoFAST(M) certificate survives L2 PGD like the untied model's."""
    from attncert import certify

    with pytest.raises(ValueError, match="qk_tied"):
        ViTConfig(**{**TINY, "kind": "standard", "attention": "l2", "qk_tied": True})
    model = tiny(qk_tied=True, radius_attn=4.0, gamma_qk=2.0)
    for block in model.blocks:
        assert block.attn.k is block.attn.q
        w = block.attn.attention_weights()
        assert torch.equal(w.wq, w.wk)
    x = images(8)
    y = model(x).argmax(1)
    table = certify.certify_table(model, x, y, ["lofast_M"], ["pairwise"], 1.0, 10.0, 8)
    radius = torch.tensor(table["radius_lofast_M_pairwise"].to_numpy())
    rows, _ = certify.audit(model, x, y, {"m": radius}, [float(radius.max()) * 0.99 + 1e-6],
                            steps=20, restarts=2, seed=0)
    assert rows[0]["broken_m"] == 0


def test_orthogonal_attention_keeps_its_paths_and_certifies_against_an_attack(tmp_path):
    """attn_orthogonal: W^V, W^O and W^Q = W^K are gamma times orthogonal maps, so every head's
    ||A_l|| is gamma_vo^2 and B_l is gamma_qk^2 times a rank-d_h projection, after training
    steps too (they cannot be shrunk); saved and loaded; LoFAST(M) survives L2 PGD."""
    from attncert import certify
    from attncert.layers import OrthogonalLinear
    from attncert.models.vit import load_vit, save_vit

    with pytest.raises(ValueError, match="attn_orthogonal"):
        ViTConfig(**{**TINY, "attn_orthogonal": True, "qk_tied": True})
    with pytest.raises(ValueError, match="attn_orthogonal"):
        ViTConfig(**{**TINY, "kind": "standard", "attn_orthogonal": True})
    with pytest.raises(ValueError, match="gamma"):
        OrthogonalLinear(4, 0.0)
    model = tiny(attn_orthogonal=True, radius_attn=4.0, gamma_qk=1.5, gamma_vo=0.5).train()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(3):  # large steps: the structure is a parametrisation, not a projection
        opt.zero_grad()
        model(images(4)).square().sum().backward()
        opt.step()
    model.eval()
    for block in model.blocks:
        attn = block.attn
        assert attn.k is attn.q and isinstance(attn.v, OrthogonalLinear)
        w = attn.attention_weights()
        a = torch.linalg.svdvals(w.wv @ w.wo)[:, : w.d_h]  # (h, d_h): rank d_h, all gamma_vo^2
        b = torch.linalg.svdvals(w.wq @ w.wk.transpose(-1, -2))[:, : w.d_h]
        torch.testing.assert_close(a, torch.full_like(a, 0.25))
        torch.testing.assert_close(b, torch.full_like(b, 2.25))
    save_vit(model, tmp_path / "m.pt")
    loaded = load_vit(tmp_path / "m.pt").double().eval()
    x = images(8)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)  # saved as float32
    y = model(x).argmax(1)
    table = certify.certify_table(model, x, y, ["lofast_M"], ["pairwise"], 1.0, 10.0, 8)
    radius = torch.tensor(table["radius_lofast_M_pairwise"].to_numpy())
    assert (radius > 0).any()
    rows, _ = certify.audit(model, x, y, {"m": radius}, [float(radius.max()) * 0.99 + 1e-6],
                            steps=20, restarts=2, seed=0)
    assert rows[0]["broken_m"] == 0
