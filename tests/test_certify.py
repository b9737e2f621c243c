"""Certification engine: propagated bounds hold against attacks; radii are consistent."""

import pytest
import torch

from attncert import certify, soundness
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
    eps_grid = [float(out["radius_lofast_M"].median()) * 0.9, 1.0]
    rows, success = certify.audit(model, x, y, radii, eps_grid, steps=50, restarts=2)
    assert success.shape == (2, 8)
    assert rows[0]["attacked"] == 8
    for row in rows:
        for v in certify.VARIANTS:
            assert row[f"broken_{v}"] == 0
            assert row[f"certified_{v}"] <= row["robust_acc"]
    # the audit can fail: radii inflated far beyond the certificate are broken by PGD
    fake = {"inflated": torch.full((8,), 50 * eps_grid[0] + 1.0, dtype=torch.float64)}
    rows, _ = certify.audit(model, x, y, fake, [50 * eps_grid[0] + 1.0], steps=50, restarts=1)
    assert rows[0]["broken_inflated"] > 0
    with pytest.raises(soundness.UnsoundCertificateError, match="toy / inflated at eps"):
        soundness.require_sound({"toy": rows})


def test_the_audit_attacks_only_the_points_still_standing(monkeypatch):
    """The radii run in ascending order, each attacking the points neither misclassified nor
    broken at a smaller radius; an adversarial example found at a smaller radius counts at
    every larger one, a certificate it contradicts there included (planted here: radii that
    claim every eps); the rows and the success matrix keep the grid's order."""
    from attncert import attacks

    model = _model()
    x = torch.rand(10, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        y = model(x).argmax(1)
    y[:2] = (y[:2] + 1) % 3  # two misclassified points: never attacked
    calls, real = [], attacks.verified_pgd_l2

    def pgd(model_, x_, y_, eps, *args, **kwargs):
        calls.append((eps, len(x_)))
        return real(model_, x_, y_, eps, *args, **kwargs)

    monkeypatch.setattr(attacks, "verified_pgd_l2", pgd)
    grid = [8.0, 0.01, 2.0, 1.0]
    planted = {"planted": torch.full((10,), 9.0, dtype=torch.float64)}
    rows, success = certify.audit(model, x, y, planted, grid, steps=20, restarts=1)
    assert [r["eps"] for r in rows] == grid and success.shape == (4, 10)
    by = {r["eps"]: (r, s) for r, s in zip(rows, success, strict=True)}
    up = sorted(grid)
    standing = [round(10 * by[e][0]["robust_acc"]) for e in up]
    assert [by[e][0]["attacked"] for e in up] == [8, *standing[:-1]]
    assert calls == [(e, by[e][0]["attacked"]) for e in up if by[e][0]["attacked"]]
    assert standing == sorted(standing, reverse=True) and standing[0] > standing[-1]
    for small, large in zip(up[:-1], up[1:], strict=True):  # a success stays one above
        assert (by[large][1] >= by[small][1]).all()
    assert all(by[e][1][:2].all() for e in up)
    assert [by[e][0]["broken_planted"] for e in up] == [8 - k for k in standing]


def _rows(**broken):
    return [{"eps": 0.1, "attacked": 8, "robust_acc": 0.5, **broken},
            {"eps": 0.25, "attacked": 8, "robust_acc": 0.25, **broken}]


def test_require_sound_passes_a_clean_audit():
    assert soundness.require_sound(
        {"run": _rows(broken_lofast_M=0, broken_naive=0), "text": _rows(broken=0)},
        {"lofast_M": ({0.1: 0.5, 0.25: 0.0}, {0.1: 0.5, 0.25: 0.25})}) is None
    assert soundness.require_sound({"L": [dict(r, depth=3) for r in _rows(broken_crown=0)]},
                                   by=("depth",)) is None


def test_require_sound_names_every_broken_model_variant_and_eps():
    audits = {"mnist-L3": [{"eps": 0.1, "broken_lofast_M": 2, "broken_naive": 0},
                           {"eps": 0.25, "broken_lofast_M": 0, "broken_naive": 1}],
              "olsa": [{"eps": 0.5, "broken": 3}]}
    with pytest.raises(soundness.UnsoundCertificateError) as err:
        soundness.require_sound(audits, see="results/x/samples.csv")
    msg = str(err.value)
    assert isinstance(err.value, RuntimeError)
    assert "6 certified point(s) broken by PGD" in msg
    assert "mnist-L3 / lofast_M at eps 0.1: 2" in msg and "mnist-L3 / naive at eps 0.25: 1" in msg
    assert "olsa at eps 0.5: 3" in msg and msg.endswith("(see results/x/samples.csv)")
    assert "naive at eps 0.1" not in msg and "lofast_M at eps 0.25" not in msg
    crown = [{"eps": 0.02, "depth": d, "broken_lofast": 0, "broken_crown": d - 3} for d in (3, 4)]
    with pytest.raises(soundness.UnsoundCertificateError, match=r"\(cifar10 / depth 4 / crown at "
                       r"eps 0.02: 1\)"):
        soundness.require_sound({"cifar10": crown}, by=("depth",))


def test_require_sound_fails_a_certified_accuracy_above_the_attack():
    acc = {"lofast_M_pairwise": ({"0.1": 0.5, "0.2": 0.375}, {"0.1": 0.5, "0.2": 0.25}),
           "naive_logit": ({"0.1": 0.25, "0.2": 0.0}, {"0.1": 0.5, "0.2": 0.25})}
    with pytest.raises(soundness.UnsoundCertificateError) as err:
        soundness.require_sound({"run": _rows(broken_lofast_M=0)}, acc)
    msg = str(err.value)
    assert ("certified accuracy above PGD accuracy (lofast_M_pairwise at eps 0.2: 0.375 > 0.25)"
            in msg)
    assert "broken by PGD" not in msg and "naive_logit" not in msg


def test_require_sound_rejects_an_audit_that_counts_nothing():
    with pytest.raises(ValueError, match="lacks a broken count"):
        soundness.require_sound({"run": [{"eps": 0.1, "robust_acc": 1.0}]})
    with pytest.raises(ValueError, match="lacks depth"):
        soundness.require_sound({"run": _rows(broken=0)}, by=("depth",))
    with pytest.raises(ValueError, match=r"no accuracy under attack at eps \[0.3\]"):
        soundness.require_sound({}, {"m": ({0.3: 0.1}, {0.1: 0.5})})


def test_certify_table_matches_certify_batch():
    model = _model()
    x = torch.rand(7, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2, 0, 1, 2, 0])
    table = certify.certify_table(model, x, y, ["lofast_M", "naive"], ["pairwise", "logit"],
                                  batch_size=3, progress=False)
    out = certify.certify_batch(model, x, y, ["lofast_M", "naive"])
    same = certify.certify_table(model, x, y, ["lofast_M"], ["pairwise"], batch_size=7,
                                 progress=False)
    assert (same["radius_lofast_M_pairwise"].to_numpy() == out["radius_lofast_M"].numpy()).all()
    assert list(table["index"]) == list(range(7))
    assert (table["correct"] == (table["label"] == table["prediction"])).all()
    for v in ("lofast_M", "naive"):
        # other batch splits: other Lanczos starts, upper bounds equal within its tolerance
        assert torch.allclose(torch.tensor(table[f"radius_{v}_pairwise"].to_numpy()),
                              out[f"radius_{v}"], rtol=1e-3, atol=1e-9)
        assert (table[f"radius_{v}_logit"] <= table[f"radius_{v}_pairwise"] + 1e-12).all()
        assert (table[f"seconds_{v}_pairwise"] > 0).all()
    assert (table["forward_seconds"] > 0).all()


def test_layernorm_model_is_refused():
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=16, depth=1, heads=2, mlp_hidden=32,
                    num_classes=3, kind="standard")
    with pytest.raises(ValueError, match="no Lipschitz constant"):
        certify.precompute(build_vit(cfg), torch.rand(2, 1, 8, 8))


def test_one_table_of_bound_variants():
    """Every variant the studies name is an entry of the one table, priced by the cost model
    one of its ways; an unknown name fails in the certificate and in the cost model alike,
    before any work (it was once priced silently as the naive bound)."""
    from attncert.bounds.variants import COSTS, VARIANTS
    from attncert.cost.layer_counts import layer_certificate_counts
    from attncert.crown.params import LOFAST_VARIANTS as CROWN_VARIANTS
    from attncert.specformer.params import CERT_VARIANTS
    from attncert.text.params import LOFAST_VARIANTS as TEXT_VARIANTS

    assert certify.VARIANTS == tuple(VARIANTS)
    assert all(v.cost in COSTS and v.name == k for k, v in VARIANTS.items())
    for subset in (CROWN_VARIANTS, CERT_VARIANTS, TEXT_VARIANTS):
        assert set(subset) <= set(VARIANTS), subset
    model = _model()
    x, y = torch.rand(2, 1, 8, 8, dtype=torch.float64), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="unknown bound variant 'lofast_Z'"):
        certify.precompute(model, x, ["lofast_M", "lofast_Z"])
    with pytest.raises(ValueError, match="unknown bound variant 'lofast_Z'"):
        layer_certificate_counts(5, 16, 2, "lofast_Z")
    assert layer_certificate_counts(5, 16, 2, "global").kernels == 0
    assert layer_certificate_counts(5, 16, 2, "lofast_M").kernels > 0
    # every variant through the table gives a sound, finite radius on the same batch
    table = certify.certify_table(model, x, y, tuple(VARIANTS), ["pairwise"], progress=False)
    assert all((table[f"radius_{v}_pairwise"] >= 0).all() for v in VARIANTS)
