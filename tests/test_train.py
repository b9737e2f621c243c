"""Training library: losses, schedule, checkpoint/resume determinism, metrics files."""

import json
import math

import pytest
import torch

from attncert.models import ViTConfig, build_vit, load_vit, save_vit
from attncert.train import (
    TrainConfig,
    augment_batch,
    cosine_schedule,
    evaluate,
    lipschitz_diagnostics,
    logit_margin,
    resolve_device,
    train,
    training_loss,
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
    # a finished run is a no-op; another config refuses the checkpoint
    assert train(resumed, data, ev, CFG, tmp_path / "run", device="cpu", progress=False) == rows2
    with pytest.raises(ValueError, match="another training config"):
        train(fresh_model(), data, ev, TrainConfig(epochs=3, batch_size=8), tmp_path / "run",
              device="cpu", progress=False)


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
