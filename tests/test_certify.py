"""Certification engine: propagated bounds hold against attacks; radii are consistent."""

import pytest
import torch

from attncert import certify
from attncert.attacks import pgd_l2
from attncert.models.vit import ViTConfig, build_vit

pytest.importorskip("attncert.bounds")


def _model(block="stream", pool="cls", seed=0):
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=16, depth=2, heads=2, mlp_hidden=32,
                    num_classes=3, kind="lipschitz", block=block, pool=pool, gamma_vo=0.75,
                    mean=(0.5,), std=(0.25,))
    model = build_vit(cfg).double().eval()
    # larger position/class embeddings than the init so attention is far from uniform
    with torch.no_grad():
        model.pos.normal_(0, 1.0)
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    return model


def _max_feature_change(model, x, eps, steps=60, restarts=3, seed=0):
    """PGD ascent on ||features(x + d) - features(x)|| over ||d|| <= eps (a lower bound)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        f0 = model.features(x)
    best = torch.zeros(len(x), dtype=x.dtype)
    for _ in range(restarts):
        d = torch.randn(x.shape, generator=g, dtype=x.dtype)
        d = d * (eps / d.flatten(1).norm(dim=1)).view(-1, 1, 1, 1)
        for _ in range(steps):
            d.requires_grad_(True)
            val = (model.features(x + d) - f0).norm(dim=1)
            (grad,) = torch.autograd.grad(val.sum(), d)
            with torch.no_grad():
                best = torch.maximum(best, val.detach())
                step = grad / grad.flatten(1).norm(dim=1).clamp_min(1e-12).view(-1, 1, 1, 1)
                d = d + 0.1 * eps * step
                d = d * (eps / d.flatten(1).norm(dim=1).clamp_min(eps)).view(-1, 1, 1, 1)
    with torch.no_grad():
        best = torch.maximum(best, (model.features(x + d) - f0).norm(dim=1))
    return best


@pytest.mark.parametrize("block", ["stream", "prenorm"])
@pytest.mark.parametrize("variant", certify.VARIANTS)
def test_feature_bound_dominates_pgd(block, variant):
    model = _model(block)
    x = torch.rand(4, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pre = certify.precompute(model, x, [variant])
    for eps in (0.01, 0.1, 0.5):
        bound = certify.feature_delta(pre, variant, eps)
        found = _max_feature_change(model, x, eps)
        assert torch.all(bound >= found * (1 - 1e-9)), (variant, eps, bound, found)


def test_variant_ordering_of_radii():
    model = _model()
    x = torch.rand(6, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    out = certify.certify_batch(model, x, torch.zeros(6, dtype=torch.long))
    assert torch.all(out["radius_lofast_M"] >= out["radius_lofast_xi"] - 1e-12)
    assert torch.all(out["radius_lofast_xi"] >= out["radius_naive"] - 1e-12)
    assert torch.all(out["radius_lofast_M"] > 0)


def test_radius_certifies_and_is_maximal():
    model = _model()
    x = torch.rand(5, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pre = certify.precompute(model, x, ["lofast_M"])
    head = certify.head_of(pre.components)
    r = certify.certified_radius(pre, "lofast_M")
    delta = certify.feature_delta(pre, "lofast_M", r)
    assert certify.certified(pre.logits, delta, head)[r > 0].all()
    above = certify.feature_delta(pre, "lofast_M", r * 1.001 + 1e-9)
    assert not certify.certified(pre.logits, above, head).any()


def test_pairwise_test_is_tighter_than_logit_test():
    model = _model()
    x = torch.rand(5, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    pre = certify.precompute(model, x, ["lofast_xi"])
    pair = certify.certified_radius(pre, "lofast_xi", "pairwise")
    logit = certify.certified_radius(pre, "lofast_xi", "logit")
    assert torch.all(pair >= logit - 1e-12)


def test_audit_finds_no_broken_certificate_and_certified_below_pgd():
    model = _model()
    g = torch.Generator().manual_seed(5)
    x = torch.rand(8, 1, 8, 8, dtype=torch.float64, generator=g)
    with torch.no_grad():
        y = model(x).argmax(1)  # labels = predictions: every point is correct
    out = certify.certify_batch(model, x, y)
    radii = {v: out[f"radius_{v}"] for v in certify.VARIANTS}
    eps_grid = [float(out["radius_lofast_M"].median()) * 0.9]
    rows = certify.audit(model, x, y, radii, eps_grid, steps=50, restarts=2)
    assert rows[0]["attacked"] > 0
    assert all(rows[0][f"broken_{v}"] == 0 for v in certify.VARIANTS)
    # attacked at a radius far above the certificate, PGD breaks some (the audit can fail)
    _, success = pgd_l2(model, x, y, 50 * eps_grid[0] + 1.0, steps=50, restarts=1)
    assert success.any()
    correct = torch.ones(8, dtype=torch.bool)
    for v in certify.VARIANTS:
        acc = certify.certified_accuracy(correct, radii[v], eps_grid)[eps_grid[0]]
        _, s = pgd_l2(model, x, y, eps_grid[0], steps=50, restarts=1)
        assert acc <= float((~s).double().mean())


def test_layernorm_model_is_refused():
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=16, depth=1, heads=2, mlp_hidden=32,
                    num_classes=3, kind="standard")
    with pytest.raises(ValueError, match="no Lipschitz constant"):
        certify.precompute(build_vit(cfg), torch.rand(2, 1, 8, 8))
