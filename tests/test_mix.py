"""Mixup / CutMix: the host-drawn plan, the batch operation, the loss, and exact resume."""

from __future__ import annotations

import math

import pytest
import torch
from test_train import Stop, fresh_model, toy_data
from torch.nn import functional as F

from attncert.training import mix
from attncert.training.loop import optimizer
from attncert.training.train import ImageSteps, TrainConfig, step_loss, train

SPEC = mix.MixSpec(mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=0.5, mix_switch_prob=0.5)


def test_plan_is_seeded_and_follows_the_probabilities():
    plan = mix.plan_epoch(SPEC, 4000, 32, 32, seed=3, epoch=2)
    assert plan == mix.plan_epoch(SPEC, 4000, 32, 32, seed=3, epoch=2)
    assert plan != mix.plan_epoch(SPEC, 4000, 32, 32, seed=3, epoch=3)
    mixed = [m for m in plan if m is not None]
    assert abs(len(mixed) / len(plan) - 0.5) < 0.03
    cut = [m for m in mixed if m.box is not None]
    assert abs(len(cut) / len(mixed) - 0.5) < 0.04
    assert all(0.0 <= m.lam <= 1.0 for m in mixed)
    # Mixup's lam follows Beta(0.8, 0.8) (mean 1/2, variance 1 / (4 (2 alpha + 1)))
    lams = torch.tensor([m.lam for m in mixed if m.box is None])
    assert abs(float(lams.mean()) - 0.5) < 0.03
    assert abs(float(lams.var()) - 1 / (4 * 2.6)) < 0.015
    assert mix.plan_epoch(mix.MixSpec(), 5, 8, 8, 0, 1) == [None] * 5
    assert all(m is not None for m in mix.plan_epoch(
        mix.MixSpec(mixup_alpha=1.0, mix_prob=1.0), 50, 8, 8, 0, 1))


def test_cutmix_lam_is_the_uncovered_share():
    for m in mix.plan_epoch(mix.MixSpec(cutmix_alpha=1.0, mix_prob=1.0), 500, 7, 9, 0, 1):
        top, bottom, left, right = m.box
        assert 0 <= top <= bottom <= 7 and 0 <= left <= right <= 9
        assert m.lam == pytest.approx(1 - (bottom - top) * (right - left) / 63)


def test_apply_mixes_each_example_with_its_reversed_partner():
    g = torch.Generator().manual_seed(0)
    x, y = torch.rand(5, 3, 6, 6, generator=g), torch.arange(5)
    before = x.clone()
    out, y_rev = mix.apply(x, y, mix.Mix(0.3))
    torch.testing.assert_close(out, 0.3 * x + 0.7 * x.flip(0))
    assert y_rev.tolist() == [4, 3, 2, 1, 0]
    out, _ = mix.apply(x, y, mix.Mix(1 - 6 / 36, (1, 3, 2, 5)))
    inside = torch.zeros(6, 6, dtype=torch.bool)
    inside[1:3, 2:5] = True
    assert torch.equal(out[..., inside], x.flip(0)[..., inside])
    assert torch.equal(out[..., ~inside], x[..., ~inside])
    assert torch.equal(x, before), "the batch itself is left alone"


def test_mixed_loss_weights_both_labels():
    model = fresh_model()
    cfg = TrainConfig(mixup_alpha=1.0, mix_prob=1.0, logit_scale=2.0)
    xb = torch.rand(4, 1, 8, 8)
    yb, y_rev = torch.tensor([0, 1, 2, 0]), torch.tensor([0, 2, 1, 0])
    logits, loss = step_loss(model, xb, yb, cfg, partner=(y_rev, 0.25))
    want = 0.25 * F.cross_entropy(2 * logits, yb) + 0.75 * F.cross_entropy(2 * logits, y_rev)
    torch.testing.assert_close(loss, want)


def test_image_steps_mix_as_planned():
    data = toy_data(64, 0)
    cfg = TrainConfig(batch_size=16, mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=0.5, seed=2)
    steps = ImageSteps(fresh_model(), data, cfg, torch.device("cpu"))
    keys = steps.plan(1)
    assert [m for _, m in keys] == mix.plan_epoch(cfg.mix_spec, 4, 8, 8, 2, 1)
    for idx, m in keys:
        (x, partner), y = steps.batch((idx, m))
        assert torch.equal(y, data["y"][idx])
        assert (partner is None) == (m is None)
        if m is not None:
            assert torch.equal(partner[0], y.flip(0)) and partner[1] == m.lam


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_mixed_run_resumes_to_the_uninterrupted_weights(tmp_path, kind):
    train_d, test_d = toy_data(64, 0), toy_data(32, 1)
    cfg = TrainConfig(epochs=2, batch_size=16, lr=3e-2, seed=1, optimizer=kind,
                      mixup_alpha=0.8, cutmix_alpha=1.0, mix_prob=0.7, augment="crop")
    assert any(m is not None for e in (1, 2) for m in mix.plan_epoch(cfg.mix_spec, 4, 8, 8, 1, e))
    full = fresh_model()
    rows = train(full, train_d, test_d, cfg, tmp_path / "a", "cpu", progress=False)
    assert all(math.isfinite(r["train_loss"]) for r in rows)

    def stop(epoch, row):
        raise Stop

    with pytest.raises(Stop):
        train(fresh_model(), train_d, test_d, cfg, tmp_path / "b", "cpu", progress=False,
              callback=stop)
    resumed = fresh_model()
    train(resumed, train_d, test_d, cfg, tmp_path / "b", "cpu", progress=False)
    for (k, a), b in zip(full.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    opt = torch.load(tmp_path / "a" / "last.pt", weights_only=True)["optimizer"]
    assert ("momentum_buffer" in opt["state"][0]) == (kind == "sgd")


def test_optimizer_and_mixing_settings_are_validated():
    params = list(fresh_model().parameters())
    sgd = optimizer(params, TrainConfig(optimizer="sgd", momentum=0.8, lr=0.1,
                                        weight_decay=1e-4))
    assert isinstance(sgd, torch.optim.SGD)
    assert (sgd.defaults["momentum"], sgd.defaults["weight_decay"]) == (0.8, 1e-4)
    assert isinstance(optimizer(params, TrainConfig()), torch.optim.AdamW)
    with pytest.raises(ValueError, match="optimizer = 'adam': choose from adamw, sgd"):
        TrainConfig(optimizer="adam")
    with pytest.raises(ValueError, match="momentum"):
        TrainConfig(momentum=1.0)
    with pytest.raises(ValueError, match="mix_prob 0.3 needs mixup_alpha or cutmix_alpha"):
        TrainConfig(mix_prob=0.3)
    with pytest.raises(ValueError, match="mix_prob must be a number in"):
        TrainConfig(mixup_alpha=1.0, mix_prob=1.5)
    with pytest.raises(ValueError, match="needs margin 'none' and adversarial 'none'"):
        TrainConfig(mixup_alpha=1.0, mix_prob=0.3, margin="lmt")
    with pytest.raises(ValueError, match="needs margin 'none' and adversarial 'none'"):
        TrainConfig(mixup_alpha=1.0, mix_prob=0.3, adversarial="pgd_linf")
