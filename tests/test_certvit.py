"""CertViT: HF loading, adaptation, Douglas-Rachford constraining (the certificate and the
spectral mode: test_certvit_certificate.py)."""

import math

import pytest
import torch
from helpers import TINY_VIT, pixels, tiny_vit
from torch import nn

from attncert.certvit import (
    NORMS,
    Adaptation,
    CheckpointUnavailable,
    DRConfig,
    ProjectNorm,
    adapt,
    calibrate_radii,
    constrain,
    douglas_rachford,
    freeze_zeros,
    haugazeau,
    linear_sites,
    load_adapted,
    load_model,
    project_outputs,
    save_adapted,
    soft_threshold,
    tiny_hf_vit,
)
from attncert.layers import L2MultiHeadAttention
from attncert.models.vit import ViTConfig, build_vit, save_vit
from attncert.training.train import TrainConfig, train

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
