"""The ``lofast`` training margin: the certifier's pairwise test on a differentiable LoFAST
bound, sound against the float64 certifier, trainable, resumable."""

import pytest
import torch
from torch.nn import functional as F

from attncert import certify
from attncert.models import ViTConfig, build_vit
from attncert.training import certified_training as ct
from attncert.training.train import TrainConfig, train


def _model(seed: int = 0, dtype=torch.float64, **kw):
    torch.manual_seed(seed)
    cfg = ViTConfig(**{**dict(image_size=8, channels=1, patch=4, dim=16, depth=2, heads=2,
                              mlp_hidden=32, num_classes=3, kind="lipschitz", block="stream",
                              pool="mean", gamma_vo=0.75, mean=(0.5,)), **kw})
    model = build_vit(cfg).to(dtype).eval()
    with torch.no_grad():  # attention far from uniform, as in the certifier's tests
        model.pos.normal_(0, 1.0)
    return model


def _data(n: int = 24, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g, dtype=dtype)
    return x, torch.randint(0, 3, (n,), generator=g)


def _surrogate(model, x, eps):
    logits, inputs = model.attention_inputs(x)
    comps = model.components()
    weights = {c.name: c.module.attention_weights() for c in comps if c.kind == "attention"}
    return logits, comps, ct.feature_delta(comps, inputs, weights, eps)


def test_the_surrogate_bounds_the_certifier_and_its_test_is_the_certificate_s():
    """In float64 the surrogate bound is at least the certifier's lofast_xi (its zeta is the
    closed-form upper bound of the certifier's), so its pairwise test is the certificate's
    own test at a larger delta: every point it passes the certifier certifies at eps."""
    model = _model()
    x, _ = _data()
    eps = 0.04  # about half the points pass the surrogate's test here
    with torch.no_grad():
        logits, comps, delta = _surrogate(model, x, eps)
        pre = certify.precompute(model, x, ["lofast_xi"])
        exact = certify.feature_delta(pre, "lofast_xi", eps)
        # the training loss's bound: the constants outside attention computed on the device
        _, inputs = model.attention_inputs(x)
        weights = {c.name: c.module.attention_weights() for c in comps if c.kind == "attention"}
        trained = ct.feature_delta(model.components(exact=False), inputs, weights,
                                   torch.tensor(eps, dtype=torch.float64), 1.0,
                                   model.live_constants())
    assert torch.all(delta >= exact * (1 - 1e-12)) and torch.all(delta <= 5 * exact)
    assert torch.all(trained >= delta * (1 - 1e-12)) and torch.all(trained <= 1.01 * delta)
    y = logits.argmax(1)  # the certificate is for the prediction
    passes = ct.surrogate_certifies(model, x, y, eps)
    assert 0 < passes.sum() < len(y)
    head = certify.head_of(comps)
    assert torch.equal(passes, certify.certified(logits, delta, head, "pairwise"))
    radius = certify.certified_radius(pre, "lofast_xi", "pairwise")
    assert torch.all(radius[passes] >= eps) and (radius[~passes] >= eps).any(), (
        "the certifier's tighter zeta certifies more than the surrogate's test")
    # the training loss's rival offsets are that test's requirements
    dist = torch.cdist(model.head_weight(), model.head_weight())[y]
    need = dist * delta[:, None]
    gaps = logits.gather(1, y[:, None]) - logits
    assert torch.equal(((gaps > need) | F.one_hot(y, 3).bool()).all(1), passes)


def test_the_margin_is_differentiable_and_its_gradient_lowers_the_bound():
    model = _model(dtype=torch.float32).train()
    x, y = _data(dtype=torch.float32)
    logits, loss = ct.lofast_loss(model, x, y, eps=0.1, scale=5.0)
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for n, g in zip(
        [n for n, p in model.named_parameters() if p.grad is not None], grads, strict=True)
        if "attn" in n), "the bound's attention terms reach the weights"

    def bound():
        _, inputs = model.attention_inputs(x, detach=False)
        comps = model.components()
        weights = {c.name: c.module.attention_weights(detach=False)
                   for c in comps if c.kind == "attention"}
        return ct.feature_delta(comps, inputs, weights, 0.1).mean()

    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    before = bound()
    for _ in range(5):
        opt.zero_grad()
        b = bound()
        b.backward()
        opt.step()
    assert bound() < before


def test_the_margin_trains_the_clean_logits():
    """The loss's logits stay in the autograd graph: with the radius at 0 its gradient is the
    plain cross-entropy's, in every parameter (the forward pass that also captures the
    attention inputs must not run without autograd), and with a radius the clean
    cross-entropy still moves the embedding."""
    model = _model(dtype=torch.float32).train()
    x, y = _data(dtype=torch.float32)
    params = list(model.parameters())
    _, zero = ct.lofast_loss(model, x, y, eps=0.0, scale=5.0)
    plain = F.cross_entropy(5.0 * model(x), y)
    assert torch.equal(zero, plain)
    g0 = torch.autograd.grad(zero, params, allow_unused=True)
    g1 = torch.autograd.grad(plain, params, allow_unused=True)
    for a, b in zip(g0, g1, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b)
    _, loss = ct.lofast_loss(model, x, y, eps=0.1, scale=5.0, mix=0.5)
    grads = dict(zip([n for n, _ in model.named_parameters()],
                     torch.autograd.grad(loss, params, allow_unused=True), strict=True))
    assert all(g is not None and torch.isfinite(g).all() for n, g in grads.items()
               if n.startswith(("embed", "head"))), "the clean path reaches every layer"
    with torch.no_grad():
        _, inputs = model.attention_inputs(x, detach=False)
    assert not any(t.requires_grad for t in inputs.values()), "no_grad outside wins"


def test_the_radius_ramp_and_the_config_checks():
    assert ct.margin_eps(0.5, 0.0, 0, 100) == 0.5
    assert ct.margin_eps(0.5, 0.5, 0, 100) == pytest.approx(0.01)
    assert ct.margin_eps(0.5, 0.5, 49, 100) == pytest.approx(0.5)
    assert ct.margin_eps(0.5, 0.5, 99, 100) == 0.5
    # the margin after a start: plain CE (radius 0) first, then the ramp from there
    assert [ct.margin_eps(0.5, 0.0, s, 100, start=0.75) for s in (0, 74, 75, 99)] == [
        0.0, 0.0, 0.5, 0.5]
    assert ct.margin_eps(0.5, 0.5, 75, 100, start=0.5) == pytest.approx(0.26)
    with pytest.raises(ValueError, match="lofast_start"):
        TrainConfig(margin="lofast", lofast_eps=0.1, lofast_start=1.0)
    with pytest.raises(ValueError, match="lofast_eps > 0"):
        TrainConfig(margin="lofast")
    with pytest.raises(ValueError, match="lofast_mix"):
        TrainConfig(margin="lofast", lofast_eps=0.1, lofast_mix=1.5)


def test_training_with_the_margin_resumes_exactly(tmp_path):
    class Stop(Exception):
        pass

    g = torch.Generator().manual_seed(1)
    data = {"x": torch.randint(0, 256, (32, 1, 8, 8), dtype=torch.uint8, generator=g),
            "y": torch.randint(0, 3, (32,), generator=g)}
    cfg = TrainConfig(epochs=2, batch_size=16, lr=3e-3, margin="lofast", lofast_eps=0.1,
                      lofast_ramp=0.5, lofast_mix=0.5, logit_scale=5.0, seed=1)
    ref = _model(dtype=torch.float32)
    rows = train(ref, data, data, cfg, tmp_path / "ref", device="cpu", progress=False)
    assert all(torch.isfinite(torch.tensor(r["train_loss"])) for r in rows)

    def stop(epoch, row):
        raise Stop

    with pytest.raises(Stop):
        train(_model(dtype=torch.float32), data, data, cfg, tmp_path / "run", device="cpu",
              progress=False, callback=stop)
    resumed = _model(dtype=torch.float32)
    again = train(resumed, data, data, cfg, tmp_path / "run", device="cpu", progress=False)
    assert [r["train_loss"] for r in again] == [r["train_loss"] for r in rows]
    for (k, a), b in zip(ref.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k


def test_the_attention_entropy_term_is_the_diagnostics_entropy_and_trains_it_down(tmp_path):
    """attention_entropy is the diagnostics' mean row entropy / log n (the same rows), it has
    a gradient in W^Q, and training with attn_entropy > 0 makes the rows near one-hot where
    the same training without it leaves them spread."""
    from attncert import diagnostics

    room = dict(radius_attn=4.0, gamma_qk=2.0)  # logits up to 16 x 4 / sqrt(8): room to sharpen
    model, (x, y) = _model(**room), _data()
    logits, inputs = model.attention_inputs(x, detach=False)
    term = ct.attention_entropy(model, inputs)
    want = diagnostics.attention_diagnostics(model, x, y)["entropy_mean"]
    assert float(term.detach()) == pytest.approx(want, rel=1e-5)  # float32 in, float64 there
    term.backward()
    assert model.blocks[0].attn.q.weight.grad.abs().sum() > 0
    g = torch.Generator().manual_seed(1)
    data = {"x": torch.randint(0, 256, (64, 1, 8, 8), dtype=torch.uint8, generator=g),
            "y": torch.randint(0, 3, (64,), generator=g)}

    def trained_entropy(weight: float, margin: str) -> float:
        cfg = TrainConfig(epochs=8, batch_size=16, lr=5e-2, margin=margin, lofast_eps=0.1,
                          lmt_offset=0.1, attn_entropy=weight, seed=1)
        m = _model(dtype=torch.float32, **room)
        train(m, data, data, cfg, tmp_path / f"{margin}-{weight}", device="cpu",
              progress=False)
        xs = data["x"].float() / 255
        return diagnostics.attention_diagnostics(m, xs, data["y"])["entropy_mean"]

    for margin in ("none", "lmt"):
        assert trained_entropy(2.0, margin) < 0.1 < 0.5 < trained_entropy(0.0, margin)
    with pytest.raises(ValueError, match="attn_entropy"):
        TrainConfig(attn_entropy=-1.0)
