"""CertViT's global certificate (every component counted, against PGD) and its certifiable
spectral mode."""

import copy
import math

import pytest
import torch
from helpers import pixels, tiny_vit
from torch import nn

from attncert.attacks import pgd_l2
from attncert.certvit import (
    Adaptation,
    DRConfig,
    MeanPooledViT,
    adapt,
    certified_radius,
    certify,
    empirical_lipschitz,
    global_bound,
    lipschitz_table,
    load_adapted,
    load_model,
    save_adapted,
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
from attncert.training.train import TrainConfig, train

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


def test_scaled_residual_branches_count_in_the_global_bound():
    # LipsFormer's x + alpha f(x): a large alpha must raise the bound past what PGD finds
    model = adapt(tiny_vit(residual_scale=0.1), Adaptation(norm="center")).eval()
    with torch.no_grad():
        for b in model.blocks:
            b.scale_attn.alpha.fill_(50.0)
            b.scale_mlp.alpha.fill_(50.0)
    bound = global_bound(model)
    assert [r["lipschitz"] for r in bound.rows if r["kind"] == "residual_scale"] == [50.0] * (
        2 * len(model.blocks))
    emp = empirical_lipschitz(model, pixels(16), steps=15,
                              generator=torch.Generator().manual_seed(0))
    assert 0 < emp <= bound.logits


def test_the_head_rows_are_those_of_the_float64_forward():
    model = adapt(tiny_vit(), Adaptation(pool="mean", head_norm=True)).eval()
    with torch.no_grad():
        model.head.weight.mul_(37.3).add_(torch.randn(model.head.weight.shape,
                                                      generator=torch.Generator().manual_seed(0)))
    rows64 = copy.deepcopy(model).double().head_weight()
    assert torch.equal(global_bound(model).head_weight, rows64)


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
