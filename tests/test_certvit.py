"""CertViT: HF loading, adaptation, Douglas-Rachford constraining, the global certificate."""

import copy
import math

import pytest
import torch
from helpers import TINY_VIT, tiny_vit
from torch import nn

from attncert.attacks import pgd_l2
from attncert.certvit import (
    NORMS,
    Adaptation,
    CheckpointUnavailable,
    DRConfig,
    MeanPooledViT,
    ProjectNorm,
    adapt,
    calibrate_radii,
    certified_radius,
    certify,
    constrain,
    douglas_rachford,
    empirical_lipschitz,
    freeze_zeros,
    global_bound,
    haugazeau,
    linear_sites,
    lipschitz_table,
    load_adapted,
    load_model,
    project_outputs,
    save_adapted,
    soft_threshold,
    tiny_hf_vit,
)
from attncert.certvit.spectral import (
    Budgets,
    budget_bound,
    clip_spectral,
    constrain_spectral,
    map_sets,
    project_,
    projected,
)
from attncert.layers import L2MultiHeadAttention
from attncert.models.vit import ViTConfig, build_vit, save_vit
from attncert.training.train import TrainConfig, train


def pixels(b, seed=0, shape=(1, 8, 8)):
    return torch.rand(b, *shape, generator=torch.Generator().manual_seed(seed))


# -- loading --------------------------------------------------------------------------------


def _hf_folder(path, qkv_bias=True):
    """A tiny random HF ViT with non-trivial norms, embeddings and image statistics."""
    from transformers import ViTConfig as HFConfig
    from transformers import ViTForImageClassification, ViTImageProcessor

    cfg = HFConfig(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2,
                   num_attention_heads=2, intermediate_size=64, num_labels=10,
                   qkv_bias=qkv_bias, initializer_range=0.2)
    torch.manual_seed(1)
    hf = ViTForImageClassification(cfg).eval()
    with torch.no_grad():
        for m in hf.modules():
            if isinstance(m, nn.LayerNorm):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.1)
    mean, std = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
    hf.save_pretrained(path)
    ViTImageProcessor(image_mean=mean, image_std=std).save_pretrained(path)
    return hf, torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)


@pytest.mark.parametrize("qkv_bias", [True, False])
def test_hf_folder_maps_exactly(tmp_path, qkv_bias):
    hf, mean, std = _hf_folder(tmp_path, qkv_bias)
    model = load_model(tmp_path)
    cfg = model.config
    assert (cfg.kind, cfg.block, cfg.pool, cfg.attn_bias) == ("standard", "prenorm", "cls", True)
    assert (cfg.patch, cfg.dim, cfg.depth, cfg.heads, cfg.mlp_hidden) == (4, 32, 2, 2, 64)
    assert model.blocks[0].norm_attn.eps == hf.config.layer_norm_eps == 1e-12
    assert model.input_lipschitz() == pytest.approx(1 / 0.224, rel=1e-6)
    x = pixels(5, shape=(3, 16, 16))
    with torch.no_grad():
        ours, theirs = model(x), hf((x - mean) / std).logits
    assert theirs.abs().max() > 0.1  # a non-degenerate comparison
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_save_vit_checkpoint_and_refusals(tmp_path):
    model = tiny_vit()
    save_vit(model, tmp_path / "m.pt")
    x = pixels(3)
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "m.pt")(x), model(x))
    save_vit(build_vit(ViTConfig(**{**TINY_VIT, "kind": "lipschitz", "attn_bias": False})),
             tmp_path / "lip.pt")
    with pytest.raises(ValueError, match="standard"):
        load_model(tmp_path / "lip.pt")
    with pytest.raises(CheckpointUnavailable, match="hub id"):
        load_model("attncert-test/no-such-model", local_files_only=True)


def test_tiny_hf_vit_runs_the_imagenet_route(tmp_path, mirror):
    from attncert.data import as_float, load_sample

    path = tiny_hf_vit(tmp_path / "hf", hidden_size=16, num_layers=1)
    model = load_model(path)
    assert (model.config.image_size, model.config.patch, model.config.num_classes) == \
        (224, 16, 1000)
    x = as_float(load_sample("imagenet_sample", mirror, tmp_path)["test"]["x"])
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (20, 1000) and torch.isfinite(logits).all()


# -- adaptation -----------------------------------------------------------------------------


@pytest.mark.parametrize("norm", NORMS)
def test_adapt_swaps_modules_and_keeps_the_original(norm):
    model = tiny_vit()
    adapted = adapt(model, Adaptation(norm=norm))
    assert isinstance(model.blocks[0].norm_attn, nn.LayerNorm)  # untouched
    for b, ref in zip(adapted.blocks, model.blocks, strict=True):
        assert isinstance(b.attn, L2MultiHeadAttention) and b.attn.k is b.attn.q
        torch.testing.assert_close(b.attn.q.weight, ref.attn.q.weight)
        torch.testing.assert_close(b.attn.o.bias, ref.attn.o.bias)
    assert not any(isinstance(m, nn.LayerNorm) for m in adapted.modules())
    with pytest.raises(ValueError, match="already adapted"):
        adapt(adapted)


def test_project_norm_is_layernorm_for_wide_tokens_and_lipschitz():
    torch.manual_seed(0)
    ln = nn.LayerNorm(16, eps=0.0)
    with torch.no_grad():
        ln.weight.uniform_(-2, 2)
        ln.bias.normal_()
    pn = ProjectNorm.from_layer_norm(ln)
    wide = 3 * torch.randn(64, 16)
    wide = wide[(wide - wide.mean(-1, keepdim=True)).norm(dim=-1) >= 4.0]  # std >= 1
    torch.testing.assert_close(pn(wide), ln(wide))
    a, b = 0.3 * torch.randn(500, 16), 0.3 * torch.randn(500, 16)
    with torch.no_grad():
        ratio = (pn(a) - pn(b)).norm(dim=-1) / (a - b).norm(dim=-1)
    assert float(ratio.max()) <= pn.compute_lipschitz() == pytest.approx(
        float(ln.weight.detach().abs().max()))


def test_calibrated_radii_reproduce_layernorm():
    model = tiny_vit()
    adapted = adapt(model)
    radii = calibrate_radii(adapted, model, pixels(8), quantile=0.0)
    assert set(radii) == {"blocks.0.norm_attn", "blocks.0.norm_mlp", "blocks.1.norm_attn",
                          "blocks.1.norm_mlp", "norm"}
    seen = []
    model.blocks[1].norm_mlp.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    with torch.no_grad():
        model(pixels(8))
        ln, pn = model.blocks[1].norm_mlp, adapted.blocks[1].norm_mlp
        ln.eps = 0.0
        torch.testing.assert_close(pn(seen[0]), ln(seen[0]))  # R = min ||c||: LN on every token
    gain = float(ln.weight.detach().abs().max()) * math.sqrt(16) / radii["blocks.1.norm_mlp"]
    assert pn.compute_lipschitz() == pytest.approx(gain, rel=1e-5)


def test_adapted_model_trains_and_roundtrips(tmp_path):
    model = tiny_vit()
    adapted = adapt(model)
    calibrate_radii(adapted, model, pixels(8), quantile=0.2)  # radii are saved buffers
    data = {"x": (pixels(32) * 255).to(torch.uint8), "y": torch.arange(32) % 4}
    before = adapted.blocks[0].attn.q.weight.detach().clone()
    train(adapted, data, data, TrainConfig(epochs=1, batch_size=16), tmp_path / "ft",
          device="cpu", progress=False)
    assert not torch.equal(before, adapted.blocks[0].attn.q.weight)
    save_adapted(adapted, tmp_path / "a.pt")
    x = pixels(3)
    with torch.no_grad():
        torch.testing.assert_close(load_adapted(tmp_path / "a.pt")(x), adapted.eval()(x))


# -- Douglas-Rachford -------------------------------------------------------------------------


def test_soft_threshold_and_haugazeau():
    w = torch.tensor([-2.0, -0.5, 0.0, 0.3, 1.5])
    torch.testing.assert_close(soft_threshold(w, 0.5), torch.tensor([-1.5, 0.0, 0.0, 0.0, 1.0]))
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x, y, z = (torch.randn(4, generator=g, dtype=torch.float64) for _ in range(3))
        q = haugazeau(x, y, z)
        # q lies in both half-spaces and no sampled point of their intersection is nearer x
        assert float((q - y) @ (x - y)) <= 1e-9 and float((q - z) @ (y - z)) <= 1e-9
        u = q + 0.5 * torch.randn(4000, 4, generator=g, dtype=torch.float64)  # around q
        inside = (((u - y) @ (x - y)) <= 0) & (((u - z) @ (y - z)) <= 0)
        assert float((q - x).norm()) <= float((u[inside] - x).norm(dim=1).min()) + 1e-9


def _layer(out=6, inp=5, k=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    w0 = torch.randn(out, inp, generator=g, dtype=torch.float64)
    x = torch.randn(k, inp, generator=g, dtype=torch.float64)
    z = w0 + torch.randn(out, inp, generator=g, dtype=torch.float64)
    return w0, x, z


def test_projection_is_exact_on_one_batch():
    """One mini-batch: P_C has the closed form W0 + (Z - W0)(I + mu X^T X)^-1 (KKT)."""
    w0, x, z = _layer()
    eta = 0.3
    y, info = project_outputs(z, w0, x[None], eta, steps=500, tol=1e-7)
    assert info.converged and info.violation <= 1e-7 * eta
    a, eye = x.T @ x, torch.eye(x.shape[1], dtype=torch.float64)
    lo, hi = 0.0, 1e6
    for _ in range(200):  # mu: the multiplier making the constraint tight
        mid = (lo + hi) / 2
        d = (z - w0) @ torch.linalg.inv(eye + mid * a)
        lo, hi = (mid, hi) if (x @ d.T).pow(2).sum() > len(x) * eta**2 else (lo, mid)
    ref = w0 + (z - w0) @ torch.linalg.inv(eye + hi * a)
    torch.testing.assert_close(y, ref, atol=1e-4, rtol=0)


def test_projection_on_many_batches_is_feasible_and_no_farther_than_w0():
    w0, x, z = _layer(k=80)
    eta = 0.3
    y, info = project_outputs(z, w0, x.reshape(8, 10, -1), eta, steps=2000, tol=1e-2)
    assert info.converged
    rms = (x.reshape(8, 10, -1) @ (y - w0).T).flatten(1).norm(dim=1) / math.sqrt(10)
    assert float(rms.max()) <= eta * (1 + 1e-2)
    assert float((y - z).norm()) <= float((w0 - z).norm())  # W0 is a point of C


def test_douglas_rachford_lowers_the_spectral_norm():
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(32, 16, generator=g) / 4
    x = torch.randn(1024, 16, generator=g)
    w, diag = douglas_rachford(w0, x, DRConfig(threshold=0.3, eta=0.1, iterations=20))
    assert w.shape == w0.shape and w.dtype == w0.dtype
    assert diag["sigma_after"] < diag["sigma_before"]
    assert diag["sparsity"] > 0 and diag["deviation"] < 2 * diag["eta"]
    assert diag["sigma_after"] == pytest.approx(float(torch.linalg.matrix_norm(
        w.double(), 2)), rel=1e-6)


def test_constrain_a_model_and_fine_tune_with_the_mask(tmp_path):
    model = adapt(tiny_vit())
    sites = linear_sites(model)
    names = [s.name for s in sites]
    assert "blocks.0.attn.v.head1" in names and "blocks.1.mlp.fc2" in names
    assert "embed.proj" in names and "head" not in names
    cfg = DRConfig(threshold=0.5, eta=0.2, iterations=3, max_pairs=128, batch_size=32)
    res = constrain(model, pixels(16), cfg)
    assert len(res.diagnostics) == len(sites)
    key = "blocks.0.mlp.fc1.weight"
    assert res.masks[key].shape == model.blocks[0].mlp.fc1.weight.shape
    assert not res.masks[key].all()
    res.apply(model)
    torch.testing.assert_close(model.blocks[0].mlp.fc1.weight, res.weights[key])

    # one AdamW step with weight decay, then train(): pruned weights stay exactly zero
    with freeze_zeros(model, res.masks):
        opt = torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
        model(pixels(4)).pow(2).sum().backward()
        opt.step()
        data = {"x": (pixels(16) * 255).to(torch.uint8), "y": torch.arange(16) % 4}
        train(model, data, data, TrainConfig(epochs=1, batch_size=8, lr=0.01), tmp_path,
              device="cpu", progress=False)
    params = dict(model.named_parameters())
    for name, mask in res.masks.items():
        assert torch.all(params[name][~mask] == 0), name
        assert torch.any(params[name][mask] != res.weights[name][mask])  # the rest trained


# -- the certificate ----------------------------------------------------------------------------


def test_certificate_refuses_models_without_global_constant():
    with pytest.raises(ValueError, match="LayerNorm"):
        global_bound(tiny_vit())
    with pytest.raises(ValueError, match="value='kim'"):
        global_bound(adapt(tiny_vit(), Adaptation(value="plain")))


@pytest.mark.parametrize("norm, block, pool", [("project", "prenorm", "cls"),
                                               ("center", "prenorm", "mean"),
                                               ("identity", "stream", "cls")])
def test_global_bound_dominates_the_empirical_lipschitz_constant(norm, block, pool):
    model = adapt(tiny_vit(block=block, pool=pool), Adaptation(norm=norm))
    bound = global_bound(model)
    factors = math.prod(r["lipschitz"] for r in bound.rows if r["factor"])
    assert bound.features == pytest.approx(factors)
    assert bound.rows[0]["lipschitz"] == pytest.approx(1 / 0.4)
    emp = empirical_lipschitz(model, pixels(16), steps=15,
                              generator=torch.Generator().manual_seed(0))
    assert 0 < emp <= bound.logits


def test_certified_radius_pairwise_formula():
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    logits = torch.tensor([[3.0, 1.0, 2.0], [2.0, 2.0, 0.0]])
    r = certified_radius(logits, w, features_lipschitz=2.0)
    # sample 0: class 2 has w_0 = w_2 (constant gap 1 > 0: never flips); class 1: 2 / (sqrt2 * 2)
    assert float(r[0]) == pytest.approx(1 / math.sqrt(2))
    assert float(r[1]) == 0.0  # a tie certifies nothing


def test_certified_points_survive_pgd_at_their_radius():
    model = adapt(tiny_vit(pool="mean"))
    with torch.no_grad():  # a flatter, input-dependent network: radii an attack can probe
        model.head.bias.zero_()
        for b in model.blocks:
            b.attn.o.weight.mul_(0.1)
            b.mlp.fc2.weight.mul_(0.1)
    x = pixels(24)
    with torch.no_grad():
        y = model(x).argmax(1)
    out = certify(model, x, y, [0.02, 0.05, 0.1], attack_steps=10, attack_restarts=1)
    assert out["clean_acc"] == 1.0 and out["broken"] == 0
    assert out["certified_acc"][0.02] > 0
    r = out["radius"]
    _, fooled = pgd_l2(model, x, y, (r * (1 - 1e-6)).float(), steps=20, restarts=2,
                       generator=torch.Generator().manual_seed(0))
    assert not fooled.any()
    # the same attack does fool the model in larger balls: the audit is not vacuous
    _, fooled_far = pgd_l2(model, x, y, 1.0, steps=20, restarts=1)
    assert fooled_far.any()


def test_the_audit_attacks_the_first_n_attack_points_and_reports_them_alike():
    model = adapt(tiny_vit(pool="mean"))
    x = pixels(12)
    with torch.no_grad():
        y = model(x).argmax(1)
    y[0] = (y[0] + 1) % model.config.num_classes  # one misclassified point among the attacked
    full = certify(model, x, y, [0.01, 0.05], attack_steps=3, seed=1)
    part = certify(model, x, y, [0.01, 0.05], attack_steps=3, seed=1, n_attack=5)
    assert full["n_attacked"] == 12 and part["n_attacked"] == 5
    assert part["certified_acc"] == full["certified_acc"]  # certified on every point
    assert torch.equal(part["radius"], full["radius"])
    for e in (0.01, 0.05):  # PGD and its certified twin count the same five points
        assert part["attacked_certified_acc"][e] == pytest.approx(float(
            (part["correct"][:5] & (part["radius"][:5] >= e)).double().mean()))
        assert part["pgd_acc"][e] <= float(part["correct"][:5].double().mean())
    assert full["attacked_certified_acc"] == full["certified_acc"]
    with pytest.raises(ValueError, match="n_attack"):
        certify(model, x, y, [0.01], attack_steps=1, n_attack=0)


def test_lipschitz_table_compares_bounds():
    model = adapt(tiny_vit())
    before = global_bound(model)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight.mul_(0.5)
    after = global_bound(model)
    table = lipschitz_table(adapted=before, constrained=after).set_index("name")
    assert table.loc["blocks.0.mlp.fc1", "constrained"] == pytest.approx(
        0.5 * table.loc["blocks.0.mlp.fc1", "adapted"])
    assert table.loc["features", "constrained"] < table.loc["features", "adapted"]
    assert table.loc["logits", "adapted"] == pytest.approx(before.logits)


# -- the certifiable (spectral) mode ----------------------------------------------------------


def _spectral_model(budgets, seed=0):
    """A tiny adapted ViT of the spectral mode, its weights projected into ``budgets``."""
    model = adapt(tiny_vit(), Adaptation(norm="project", pool="mean", head_norm=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # non-trivial gains, biases and position embeddings
        for p in model.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g))
    return project_(model, map_sets(model, budgets)).double()


def test_clip_spectral_is_the_projection_onto_the_ball():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 5, generator=g, dtype=torch.float64)
    c = clip_spectral(w, 0.7, blocks=2)
    for block in c.view(2, 4, 5):
        assert torch.linalg.matrix_norm(block, 2) <= 0.7 * (1 + 1e-12)
    torch.testing.assert_close(clip_spectral(c, 0.7, blocks=2), c)  # idempotent
    # nearest point of the ball: no random point of the ball is closer to w
    for _ in range(50):
        other = torch.randn(8, 5, generator=g, dtype=torch.float64)
        other = clip_spectral(other, 0.7, blocks=2)
        assert (w - c).norm() <= (w - other).norm() + 1e-12
    with pytest.raises(ValueError, match="blocks"):
        clip_spectral(w, 1.0, blocks=3)


def test_mean_pooled_adaptation_roundtrips(tmp_path):
    model = _spectral_model(Budgets()).float()
    assert isinstance(model, MeanPooledViT) and model.config.head_norm
    x = pixels(4)
    with torch.no_grad():
        t = model.norm(model.blocks[1](model.blocks[0](model.tokens(x))))
        torch.testing.assert_close(model.features(x), t.mean(1))
    save_adapted(model, tmp_path / "m.pt")
    back = load_adapted(tmp_path / "m.pt")
    assert isinstance(back, MeanPooledViT)
    torch.testing.assert_close(back(x), model.eval()(x))
    bound = global_bound(model)
    pool = next(r for r in bound.rows if r["name"] == "pool")
    assert pool["lipschitz"] == pytest.approx(1 / math.sqrt(model.config.n_tokens))


@pytest.mark.parametrize(("budgets", "radius"), [(dict(), None), (dict(), 0.5),
                                                 (dict(q=1.5, v=0.8, o=1.2, fc1=2.0, gain=0.5),
                                                  0.8)])
def test_spectral_bounds_dominate_gradient_ascent(budgets, radius):
    """Mean pooling, gain-clipped norms and the factored attention constant (on the ball the
    norm before it confines its inputs to, with ``radius``): gradient ascent on the logits
    and on every logit difference never exceeds the certificate's constants, and the sets'
    bound is never below the model's bound."""
    from attncert.certvit.adapt import output_radius

    b = Budgets(**budgets)
    model = _spectral_model(b)
    if radius is not None:
        for blk in model.blocks:
            blk.norm_attn.set_radius(radius)
        project_(model, map_sets(model, b))
        for blk in model.blocks:  # the ball is what makes the attention's constant small
            r = output_radius(blk.norm_attn)
            assert r <= radius * b.gain * (1 + 1e-12)
            assert blk.attn.lipschitz_bound(model.config.n_tokens, r) < (
                blk.attn.lipschitz_bound(model.config.n_tokens))
    bound = global_bound(model)
    assert bound.features <= budget_bound(model, b) * (1 + 1e-9)
    x = pixels(16).double()
    emp = empirical_lipschitz(model, x, steps=25, radius=0.05,
                              generator=torch.Generator().manual_seed(1))
    assert 0 < emp <= bound.logits
    # the pairwise constant: ascent on each logit difference f_j - f_k
    w = bound.head_weight.double()
    for j, k in ((0, 1), (2, 3)):
        def diff(z, j=j, k=k):
            out = model(z)
            return out[:, j] - out[:, k]
        u = 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(j),
                               dtype=torch.float64)
        for _ in range(25):
            u.requires_grad_(True)
            ratio = (diff(x + u) - diff(x)).abs() / u.flatten(1).norm(dim=1)
            (grad,) = torch.autograd.grad(ratio.sum(), u)
            with torch.no_grad():
                u = u + 0.02 * grad / grad.flatten(1).norm(dim=1).clamp_min(1e-30).view(-1, 1, 1, 1)
        assert float(ratio.detach().max()) <= bound.features * float((w[j] - w[k]).norm())
        assert float((w[j] - w[k]).norm()) * bound.features <= bound.pairwise


def test_spectral_constraining_and_projected_fine_tune(tmp_path):
    b = Budgets(embed=0.8, q=0.4, v=0.5, o=0.9, fc1=0.7, fc2=0.6, gain=0.9)
    model = adapt(tiny_vit(), Adaptation(norm="project", pool="mean", head_norm=True))
    x = pixels(32)
    result = constrain_spectral(model, x, b, DRConfig(iterations=3, projection_steps=10,
                                                      batch_size=16, max_pairs=64))
    out = project_(result.apply(copy.deepcopy(model)), map_sets(model, b))
    for s in map_sets(out, b):
        p = dict(out.named_parameters())[s.param].detach().double()
        if s.kind == "gain":
            assert p.abs().max() <= s.budget
        else:
            norms = torch.linalg.matrix_norm(p.view(s.blocks, -1, p.shape[1]), 2)
            assert norms.max() <= s.budget * (1 + 1e-5)
    assert {d["site"] for d in result.diagnostics} >= {"embed.proj", "blocks.0.attn.q",
                                                       "blocks.0.attn.v.head1"}
    assert all(d["sigma_after"] <= d["sigma_before"] + 1e-9 for d in result.diagnostics)
    y = torch.arange(32) % 4
    with projected(out, map_sets(out, b)):
        train(out, (x, y), (x, y), TrainConfig(epochs=2, lr=0.05, batch_size=8, margin="lmt",
                                               lmt_offset=0.1), tmp_path, "cpu", progress=False)
    assert global_bound(out).features <= budget_bound(out, b) * (1 + 1e-5)
    # outside the block the hook is gone: training may leave the sets
    train(out, (x, y), (x, y), TrainConfig(epochs=1, lr=0.5, batch_size=8), tmp_path / "free",
          "cpu", progress=False)
    assert global_bound(out).features > budget_bound(out, b)


def test_linear_baseline_radius_is_exact_and_audited(tmp_path):
    """PixelLinear's pairwise radius is the distance to its decision boundary: a step just
    past it along the closest rival's direction changes the prediction, PGD inside it never
    does (0 broken), and a training run with the radius loss keeps unit rows."""
    from attncert.certvit import PixelLinear, certify_linear
    from attncert.training.train import TrainConfig, train

    g = torch.Generator().manual_seed(0)
    x = torch.rand(64, 1, 6, 6, generator=g)
    y = (x.flatten(1)[:, :18].sum(1) > x.flatten(1)[:, 18:].sum(1)).long()
    model = PixelLinear(36, 2, seed=0)
    cfg = TrainConfig(epochs=3, batch_size=16, lr=5e-2, margin="radius", lmt_offset=0.2,
                      logit_scale=5.0)
    train(model, {"x": x, "y": y}, {"x": x, "y": y}, cfg, tmp_path, "cpu", progress=False)
    rows = model.head_weight().detach()
    torch.testing.assert_close(rows.norm(dim=1), torch.ones(2))
    report = certify_linear(model, x, y, [0.01, 0.05, 0.2], attack_steps=20, seed=0)
    assert report["broken"] == 0 and report["lipschitz"] == 1.0
    assert report["clean_acc"] > 0.7
    with torch.no_grad():
        pred = model(x).argmax(1)
        for i in range(8):
            p, q = int(pred[i]), 1 - int(pred[i])
            direction = (rows[q] - rows[p]) / (rows[q] - rows[p]).norm()
            r = float(report["radius"][i])
            inside = model(x[i:i + 1] + 0.999 * r * direction.view(1, 1, 6, 6))
            past = model(x[i:i + 1] + 1.001 * r * direction.view(1, 1, 6, 6))
            assert int(inside.argmax()) == p and int(past.argmax()) == q
    with pytest.raises(ValueError, match="PixelLinear"):
        certify_linear(nn.Linear(36, 2), x, y, [0.1])
    with pytest.raises(ValueError, match="classes"):
        PixelLinear(36, 1)


def test_linear_baseline_checkpoints_like_a_phase(tmp_path):
    """The stage keys the baseline's checkpoint folder on its config, as every phase's."""
    from attncert.certvit import PixelLinear
    from attncert.certvit import methods as stage
    from attncert.training.checkpoint import prepare_checkpoint_dir
    from attncert.training.train import TrainConfig

    model = PixelLinear(36, 2, seed=0)
    cfg = TrainConfig(epochs=1, margin="radius", lmt_offset=0.2)
    fp = stage.phase_fingerprint(model, cfg, "toy", "src", "linear")
    assert prepare_checkpoint_dir(tmp_path / "lin", fp) == "fresh"
    assert model.config.to_dict() == {"kind": "pixel_linear", "in_features": 36,
                                      "num_classes": 2}


def test_a_checkpoint_missing_weights_is_refused(tmp_path):
    """from_pretrained would fill missing weights at random and only log it."""
    from safetensors.torch import load_file, save_file

    path = tiny_hf_vit(tmp_path / "hf", hidden_size=16, num_layers=1)
    weights = path / "model.safetensors"
    state = load_file(weights)
    dropped = next(k for k in state if k.endswith("attention.query.weight"))
    save_file({k: v for k, v in state.items() if k != dropped}, weights,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks"):
        load_model(path)


def test_the_certificate_forward_pass_is_float64(monkeypatch):
    """CertViT's radii come from float64 logits of a float64 copy; the model stays float32."""
    from attncert.certvit import certificate

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 3))
    seen = []
    real = torch.nn.Linear.forward

    def spy(self, x):
        seen.append(x.dtype)
        return real(self, x)

    monkeypatch.setattr(torch.nn.Linear, "forward", spy)
    x, y = torch.rand(5, 3, 2, 2), torch.tensor([0, 1, 2, 0, 1])
    out = certificate.certify_pairwise(model, x, y, model[1].weight, 1.0, [0.1])
    assert seen and set(seen) == {torch.float64}
    assert next(model.parameters()).dtype == torch.float32
    assert out["radius"].dtype == torch.float64
