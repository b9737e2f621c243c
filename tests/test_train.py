"""Training library: losses, schedule, checkpoint/resume determinism, metrics files."""

import copy
import json
import math

import pytest
import torch

from attncert.models import ViTConfig, build_vit, load_vit, save_vit
from attncert.pipeline.device import resolve_device
from attncert.training.checkpoint import fingerprint
from attncert.training.loop import cosine_schedule, lipschitz_diagnostics
from attncert.training.losses import logit_margin, training_loss
from attncert.training.train import (
    TrainConfig,
    augment_batch,
    evaluate,
    step_loss,
    train,
    train_resumable,
)

MODEL = dict(image_size=8, channels=1, patch=4, dim=8, depth=1, heads=2, mlp_hidden=8,
             num_classes=3, mean=(0.5,), std=(0.3,))


def toy_data(n, seed):
    """Three classes told apart by the overall brightness (uint8 pixels)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randint(0, 60, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
    for c in range(3):
        x[y == c] += 90 * c
    return {"x": x, "y": y}


def fresh_model():
    torch.manual_seed(0)
    return build_vit(ViTConfig(**MODEL))


CFG = TrainConfig(epochs=3, batch_size=16, lr=3e-3, warmup_steps=2, seed=1)


class Stop(Exception):
    pass


def test_resume_after_interruption_gives_identical_weights(tmp_path):
    data, ev = toy_data(64, 0), toy_data(32, 1)
    ref = fresh_model()
    rows = train(ref, data, ev, CFG, tmp_path / "ref", device="cpu", progress=False)
    assert [r["epoch"] for r in rows] == [1, 2, 3]

    def stop_after_1(epoch, row):
        if epoch == 1:
            raise Stop

    broken = fresh_model()
    with pytest.raises(Stop):
        train(broken, data, ev, CFG, tmp_path / "run", device="cpu", progress=False,
              callback=stop_after_1)
    assert len(json.loads((tmp_path / "run" / "metrics.json").read_text())) == 1
    resumed = fresh_model()
    rows2 = train(resumed, data, ev, CFG, tmp_path / "run", device="cpu", progress=False)
    for (k, a), b in zip(ref.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert [r["train_loss"] for r in rows2] == [r["train_loss"] for r in rows]
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [r["epoch"] for r in saved] == [1, 2, 3]
    assert {"train_loss", "train_acc", "test_acc", "seconds", "sigma/blocks.0.attn.q",
            "sigma/embed.proj", "sigma/head"} <= set(saved[0])
    assert max(saved[-1][f"sigma/blocks.0.attn.{p}"] for p in "qkvo") <= 1 + 1e-6
    # a finished run is a no-op; one stopped between its last checkpoint and its metrics
    # file writes the file on resume; another config refuses the checkpoint
    assert train(resumed, data, ev, CFG, tmp_path / "run", device="cpu", progress=False) == rows2
    (tmp_path / "run" / "metrics.json").unlink()
    assert train(resumed, data, ev, CFG, tmp_path / "run", device="cpu", progress=False) == rows2
    assert json.loads((tmp_path / "run" / "metrics.json").read_text()) == saved
    with pytest.raises(ValueError, match="another training config"):
        train(fresh_model(), data, ev, TrainConfig(epochs=3, batch_size=8), tmp_path / "run",
              device="cpu", progress=False)


def _fingerprint(cfg, source="toy"):
    return fingerprint(ViTConfig(**MODEL), cfg, "toy", source, "fp32")


def test_train_resumable_resumes_to_the_uninterrupted_weights(tmp_path, capsys):
    """An interrupted run resumed by train_resumable ends with the weights, rows and global
    random state of an uninterrupted one; the metrics file holds every epoch."""
    data, ev = toy_data(64, 0), toy_data(32, 1)
    cfg = TrainConfig(epochs=3, batch_size=16, lr=3e-3, warmup_steps=2, augment="crop_flip",
                      msvp_lambda=1e-2, seed=1)
    ref = fresh_model()
    full, status = train_resumable(ref, data, ev, cfg, tmp_path / "ref", "cpu",
                                   fingerprint=_fingerprint(cfg), progress=False)
    assert status == "fresh" and [r["epoch"] for r in full] == [1, 2, 3]
    ref_rng = torch.get_rng_state()

    def stop_after_2(epoch, row):
        if epoch == 2:
            raise Stop

    with pytest.raises(Stop):
        train_resumable(fresh_model(), data, ev, cfg, tmp_path / "run", "cpu",
                        fingerprint=_fingerprint(cfg), progress=False, callback=stop_after_2)
    assert len(json.loads((tmp_path / "run" / "metrics.json").read_text())) == 2
    resumed = fresh_model()
    torch.manual_seed(123)  # the checkpoint's global random state replaces this one
    rows, status = train_resumable(resumed, data, ev, cfg, tmp_path / "run", "cpu",
                                   fingerprint=_fingerprint(cfg), progress=False)
    assert status == "resume"
    for (k, a), b in zip(ref.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    strip = [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
    assert strip == [{k: v for k, v in r.items() if k != "seconds"} for r in full]
    assert torch.equal(torch.get_rng_state(), ref_rng)
    saved = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert [r["epoch"] for r in saved] == [1, 2, 3]
    assert [r["train_loss"] for r in saved] == [r["train_loss"] for r in full]
    assert json.loads((tmp_path / "run" / "run.json").read_text()) == _fingerprint(cfg)
    assert "starts over" not in capsys.readouterr().out


def test_train_resumable_starts_over_when_the_fingerprint_changes(tmp_path, capsys):
    """Another setting clears the folder and says so (status and a printed line); the run
    then equals a fresh one. ``metrics_path`` and ``marker`` name the caller's files."""
    data, ev = toy_data(48, 0), toy_data(16, 1)
    cfg = TrainConfig(epochs=2, batch_size=16, lr=3e-3, seed=2)
    other = TrainConfig(epochs=2, batch_size=16, lr=1e-2, seed=2)
    kw = dict(progress=False, metrics_path=tmp_path / "train.json", marker="spec.json")
    train_resumable(fresh_model(), data, ev, cfg, tmp_path / "ck", "cpu",
                    fingerprint=_fingerprint(cfg), **kw)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["last.pt", "spec.json"]
    model = fresh_model()
    rows, status = train_resumable(model, data, ev, other, tmp_path / "ck", "cpu",
                                   fingerprint=_fingerprint(other), **kw)
    assert status == "cleared: train changed"
    assert "cleared: train changed; training starts over" in capsys.readouterr().out
    fresh = fresh_model()
    want, status = train_resumable(fresh, data, ev, other, tmp_path / "fresh", "cpu",
                                   fingerprint=_fingerprint(other), progress=False)
    assert status == "fresh"
    assert [r["train_loss"] for r in rows] == [r["train_loss"] for r in want]
    for (k, a), b in zip(fresh.state_dict().items(), model.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    assert json.loads((tmp_path / "train.json").read_text()) == rows
    # other data with the same config: cleared too (the config check alone would resume)
    _, status = train_resumable(fresh_model(), data, ev, other, tmp_path / "ck", "cpu",
                                fingerprint=_fingerprint(other, "other"), **kw)
    assert status == "cleared: data changed"
    # a folder without a fingerprint (or with a broken one) is never resumed
    (tmp_path / "ck" / "spec.json").write_text("{")
    _, status = train_resumable(fresh_model(), data, ev, other, tmp_path / "ck", "cpu",
                                fingerprint=_fingerprint(other), **kw)
    assert status.startswith("cleared: data, dataset, model, precision, train")


def test_training_learns_the_toy_task(tmp_path):
    data = toy_data(192, 0)
    model = fresh_model()
    cfg = TrainConfig(epochs=6, batch_size=32, lr=1e-2, margin="lmt", lmt_offset=0.05,
                      logit_scale=5.0)
    before = evaluate(model, data)["acc"]
    train(model, data, data, cfg, tmp_path, device="cpu", progress=False,
          metrics_path=tmp_path / "m" / "plots.json")
    assert (tmp_path / "m" / "plots.json").is_file()
    assert evaluate(model, data)["acc"] >= max(0.9, before)
    save_vit(model, tmp_path / "model.pt")
    again = load_vit(tmp_path / "model.pt")
    x = data["x"][:4].float() / 255
    torch.testing.assert_close(again(x), model.eval()(x))


def test_training_learns_the_toy_task_with_the_lofast_margin(tmp_path):
    """The certified-training margin trains the classifier (its loss keeps the clean logits
    in the autograd graph), not only the bound."""
    data = toy_data(192, 0)
    model = fresh_model()
    cfg = TrainConfig(epochs=6, batch_size=32, lr=1e-2, margin="lofast", lofast_eps=0.01,
                      lofast_mix=0.5, logit_scale=5.0)
    before = evaluate(model, data)["acc"]
    train(model, data, data, cfg, tmp_path, device="cpu", progress=False)
    assert evaluate(model, data)["acc"] >= max(0.9, before)


def test_a_diverging_run_stops_with_one_clear_error(tmp_path):
    from attncert.training.loop import TrainingDiverged

    data = toy_data(64, 0)
    model = fresh_model()
    with torch.no_grad():  # weights already non-finite: the first step's loss is NaN
        next(model.parameters()).fill_(float("nan"))
    cfg = TrainConfig(epochs=1, batch_size=32, lr=1e-2)
    with pytest.raises(TrainingDiverged, match="training diverged in epoch 1.*grad_clip"):
        train(model, data, data, cfg, tmp_path, device="cpu", progress=False)


def test_losses():
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])
    y = torch.tensor([0, 1])
    torch.testing.assert_close(logit_margin(logits, y), torch.tensor([1.5, -2.0]))
    ce = torch.nn.functional.cross_entropy
    assert training_loss(logits, y, TrainConfig()) == pytest.approx(float(ce(logits, y)))
    lmt = TrainConfig(margin="lmt", lmt_offset=0.7)
    shifted = logits + 0.7 * torch.tensor([[0.0, 1, 1], [1, 0, 1]])
    assert training_loss(logits, y, lmt) == pytest.approx(float(ce(shifted, y)))
    scaled = TrainConfig(margin="lmt", lmt_offset=0.7, logit_scale=3.0)
    assert training_loss(logits, y, scaled) == pytest.approx(float(ce(3 * shifted, y)))
    olsa = TrainConfig(margin="olsa", olsa_gamma=2.0)
    want = float(ce(logits, y)) - 2.0 * (1.5 / math.sqrt(2) + 0.0) / 2
    assert training_loss(logits, y, olsa) == pytest.approx(want)



def test_radius_loss_is_the_pairwise_certificate_margin():
    """"radius": log(1 + sum_j exp(s (offset - gap_j / ||w_y - w_j||))), written out by hand;
    it needs the head's rows, and a model without head_weight() is refused."""
    logits = torch.tensor([[2.0, 0.5, -1.0], [0.0, 1.0, 3.0]])
    y = torch.tensor([0, 1])
    w = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])
    cfg = TrainConfig(margin="radius", lmt_offset=0.3, logit_scale=2.0)
    want = 0.0
    for i in range(2):
        terms = [0.0]
        for j in range(3):
            if j != int(y[i]):
                gap = float(logits[i, y[i]] - logits[i, j])
                terms.append(2.0 * (0.3 - gap / float((w[y[i]] - w[j]).norm())))
        want += math.log(sum(math.exp(t) for t in terms)) / 2
    assert training_loss(logits, y, cfg, w) == pytest.approx(want, rel=1e-6)
    # a gap far past the offset costs (almost) nothing; a wrong prediction costs at least log 2
    far = TrainConfig(margin="radius", lmt_offset=0.0, logit_scale=50.0)
    assert float(training_loss(torch.tensor([[9.0, 0.0, 0.0]]), torch.tensor([0]), far, w)) < 1e-6
    assert float(training_loss(torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([0]), far, w)) > 1
    with pytest.raises(ValueError, match="head_weight"):
        training_loss(logits, y, cfg)
    with pytest.raises(ValueError, match="head_weight"):
        step_loss(torch.nn.Linear(4, 3), torch.randn(2, 4), y, cfg)

def test_config_validation_and_device():
    for bad in (dict(epochs=0), dict(margin="hinge"), dict(lr=0.0), dict(augment="mixup"),
                dict(batch_size=2.5), dict(weight_decay=-1.0), dict(logit_scale=0.0)):
        with pytest.raises(ValueError):
            TrainConfig(**bad)
    with pytest.raises(ValueError, match="unknown key"):
        TrainConfig.from_dict({"epoch": 3})
    assert resolve_device("cpu").type == "cpu"
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


def test_cosine_schedule():
    f = cosine_schedule(total_steps=10, warmup_steps=2)
    assert [f(0), f(1)] == [0.5, 1.0]
    assert f(2) == 1.0 and f(10) == pytest.approx(0.0) and 0 < f(6) < 1


def test_augment_crop_keeps_content_and_is_seeded():
    x = torch.rand(5, 1, 6, 6)
    a = augment_batch(x, "crop_flip", torch.Generator().manual_seed(0), pad=2)
    b = augment_batch(x, "crop_flip", torch.Generator().manual_seed(0), pad=2)
    assert torch.equal(a, b) and a.shape == x.shape
    assert torch.equal(augment_batch(x, "none", torch.Generator()), x)
    # every output pixel is a pixel of the (padded, possibly flipped) input or 0
    vals = set(x.flatten().tolist()) | {0.0}
    assert set(a.flatten().tolist()) <= vals


def test_lipschitz_diagnostics_exact():
    model = fresh_model()
    d = lipschitz_diagnostics(model)
    w = model.blocks[0].attn.v.weight_effective().detach().double()
    assert d["sigma/blocks.0.attn.v"] == pytest.approx(torch.linalg.svdvals(w).max().item())


# -- MSVP and adversarial training ----------------------------------------------------------


def test_msvp_lambda_validation_and_broadcast():
    assert TrainConfig().msvp_lambda == (0.0, 0.0, 0.0) and not TrainConfig().msvp_enabled
    cfg = TrainConfig(msvp_lambda=1e-3)
    assert cfg.msvp_lambda == (1e-3,) * 3 and cfg.msvp_enabled
    assert TrainConfig(msvp_lambda=[0, 1, 2]).msvp_lambda == (0.0, 1.0, 2.0)
    for bad in ((1.0, 2.0), (-1.0, 0.0, 0.0), "x"):
        with pytest.raises(ValueError, match="msvp_lambda"):
            TrainConfig(msvp_lambda=bad)
    with pytest.raises(ValueError, match="adversarial"):
        TrainConfig(adversarial="fgsm")
    with pytest.raises(ValueError, match="adv_eps"):
        TrainConfig(adv_eps=0.0)


def test_msvp_term_changes_the_loss_and_the_gradients():
    from attncert.msvp import MSVP
    from attncert.training.train import step_loss

    data = toy_data(16, 0)
    xb, yb = data["x"].float() / 255, data["y"]
    cfg = TrainConfig(msvp_lambda=(0.1, 0.2, 0.3))
    grads = []
    for with_msvp in (False, True):
        model = fresh_model()
        msvp = MSVP(model, *cfg.msvp_lambda, generator=torch.Generator().manual_seed(0))
        _, loss = step_loss(model, xb, yb, cfg, msvp if with_msvp else None)
        loss.backward()
        grads.append((float(loss), model.blocks[0].attn.q.weight.grad.clone()))
        if with_msvp:
            plain = float(training_loss(model(xb), yb, cfg))
            assert float(loss) == pytest.approx(plain + float(msvp()), rel=1e-5)
    assert grads[1][0] > grads[0][0]
    assert not torch.allclose(grads[0][1], grads[1][1])


def test_adversarial_step_trains_on_pgd_examples():
    from attncert.training.train import step_loss

    data = toy_data(16, 0)
    xb, yb = data["x"].float() / 255, data["y"]
    model = fresh_model()
    clean = TrainConfig()
    adv = TrainConfig(adversarial="pgd_linf", adv_eps=0.1, adv_steps=3)
    _, loss_clean = step_loss(model, xb, yb, clean)
    _, loss_adv = step_loss(model, xb, yb, adv, generator=torch.Generator().manual_seed(0))
    assert float(loss_adv) > float(loss_clean)
    loss_adv.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_resume_restores_msvp_vectors_and_adversarial_run(tmp_path):
    """An interrupted MSVP + adversarial run resumes to the weights AND vectors of a clean run."""
    train_d, test_d = toy_data(64, 0), toy_data(32, 1)
    cfg = TrainConfig(epochs=2, batch_size=16, lr=3e-3, seed=1, msvp_lambda=1e-2,
                      adversarial="pgd_linf", adv_eps=0.05, adv_steps=2)
    full = fresh_model()
    train(full, train_d, test_d, cfg, tmp_path / "a", "cpu", progress=False)
    ref = torch.load(tmp_path / "a" / "last.pt", weights_only=True)

    def stop(epoch, row):
        raise Stop

    part = fresh_model()
    with pytest.raises(Stop):
        train(part, train_d, test_d, cfg, tmp_path / "b", "cpu", progress=False, callback=stop)
    resumed = fresh_model()
    train(resumed, train_d, test_d, cfg, tmp_path / "b", "cpu", progress=False)
    got = torch.load(tmp_path / "b" / "last.pt", weights_only=True)
    for k, v in ref["model"].items():
        torch.testing.assert_close(got["model"][k], v, rtol=0, atol=0, msg=k)
    assert set(ref["msvp"]) and set(ref["msvp"]) == set(got["msvp"])
    for k, v in ref["msvp"].items():
        torch.testing.assert_close(got["msvp"][k], v, rtol=0, atol=0, msg=k)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_the_optimiser_is_fused_on_cuda_and_steps_as_the_default_does(kind, monkeypatch):
    """On CUDA one fused kernel steps every parameter (``fused_on_cuda``), on the CPU torch's
    default loop. The fused update (run here with the CPU's fused kernel) is the loop's up to
    float rounding, and a state saved by either resumes in the other."""
    from types import SimpleNamespace

    from attncert.training import loop

    cfg = SimpleNamespace(optimizer=kind, lr=0.05, weight_decay=0.01, momentum=0.9)
    assert loop.fused_on_cuda([torch.nn.Parameter(torch.ones(2))]) == {}
    assert loop.fused_on_cuda([SimpleNamespace(is_cuda=True, is_floating_point=lambda: True)]
                              ) == {"fused": True}
    torch.manual_seed(0)
    models = [torch.nn.Linear(6, 3), torch.nn.Linear(6, 3)]
    models[1].load_state_dict(models[0].state_dict())
    looped = loop.optimizer(list(models[0].parameters()), cfg)
    monkeypatch.setattr(loop, "fused_on_cuda", lambda params: {"fused": True})
    fused = loop.optimizer(list(models[1].parameters()), cfg)
    assert not looped.defaults["fused"] and fused.defaults["fused"]

    def step(model, opt, x):
        opt.zero_grad()
        model(x).square().sum().backward()
        opt.step()

    for i in range(5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i))
        for model, opt in zip(models, (looped, fused), strict=True):
            step(model, opt, x)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # a state saved by either resumes in the other, which then steps as the saving one did
    # (torch restores the flag with the state)
    saved = [copy.deepcopy(o.state_dict()) for o in (fused, looped)]
    looped.load_state_dict(saved[0])
    fused.load_state_dict(saved[1])
    assert looped.param_groups[0]["fused"] and not fused.param_groups[0]["fused"]
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(9))
    for model, opt in zip(models, (looped, fused), strict=True):
        step(model, opt, x)
    for a, b in zip(*(m.parameters() for m in models), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
