"""Precision: autocast in training only, never in a certificate; float32 audits confirmed in
float64; training data indexed and augmented on the device."""

import pytest
import torch
from test_train import MODEL
from test_train import toy_data as _toy

from attncert import certify
from attncert.attacks import attack_copy, confirm_l2, pgd_l2, verified_pgd_l2
from attncert.models.vit import ViTConfig, build_vit
from attncert.pipeline.device import resolve_precision
from attncert.training.precision import (
    attack_matmuls,
    autocast,
    require_full_precision,
    training_matmuls,
)
from attncert.training.train import TrainConfig, augment_batch, epoch_generator, train


def _vit(**kw):
    torch.manual_seed(0)
    return build_vit(ViTConfig(**{**MODEL, **kw}))


def test_resolve_precision():
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("auto", torch.device("cuda")) == "bf16"
    assert resolve_precision("tf32", "cpu") == "tf32"
    with pytest.raises(ValueError, match="choose from"):
        resolve_precision("fp16", "cpu")


def test_tf32_only_inside_a_cuda_training_block():
    assert torch.get_float32_matmul_precision() == "highest"
    with training_matmuls("auto", "cuda"):
        assert torch.get_float32_matmul_precision() == "high"
    assert torch.get_float32_matmul_precision() == "highest"
    for precision, device in (("auto", "cpu"), ("fp32", "cuda"), ("bf16", "cpu")):
        with training_matmuls(precision, device):
            assert torch.get_float32_matmul_precision() == "highest"
    with attack_matmuls("cuda"):
        assert torch.get_float32_matmul_precision() == "high"
    with attack_matmuls("cpu"):
        assert torch.get_float32_matmul_precision() == "highest"
    with pytest.raises(KeyError), training_matmuls("bf16", "cuda"):
        raise KeyError  # restored on the way out of an error too
    assert torch.get_float32_matmul_precision() == "highest"


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_autocast_covers_the_training_forward_only(tmp_path, precision):
    model = _vit()
    seen = {True: set(), False: set()}  # model.training -> autocast states seen
    model.register_forward_pre_hook(
        lambda m, args: seen[m.training].add(torch.is_autocast_enabled("cpu")))
    cfg = TrainConfig(epochs=1, batch_size=16, lr=3e-3, seed=1, augment="crop_flip")
    rows = train(model, _toy(48, 0), _toy(16, 1), cfg, tmp_path, device="cpu", progress=False,
                 precision=precision)
    assert seen[True] == {precision == "bf16"}  # every training forward
    assert seen[False] == {False}  # evaluation
    assert not torch.is_autocast_enabled("cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert rows[0]["train_loss"] == rows[0]["train_loss"]  # finite, not NaN


def test_bf16_changes_training_and_fp32_is_the_cpu_default(tmp_path):
    cfg = TrainConfig(epochs=1, batch_size=16, lr=3e-3, seed=1)
    losses = {}
    for precision in ("auto", "fp32", "bf16"):
        rows = train(_vit(), _toy(48, 0), _toy(16, 1), cfg, tmp_path / precision,
                     device="cpu", progress=False, precision=precision)
        losses[precision] = rows[0]["train_loss"]
    assert losses["auto"] == losses["fp32"] != losses["bf16"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.05)


def test_certificates_refuse_autocast_and_tf32():
    from attncert.certvit import global_bound
    from attncert.certvit.adapt import adapt

    model = _vit(kind="lipschitz").double().eval()
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1])
    std = build_vit(ViTConfig(**{**MODEL, "kind": "standard", "block": "prenorm",
                                 "pool": "cls"}))
    adapted = adapt(std).double().eval()
    certify.certify_table(model, x, y, ["lofast_M"], ["pairwise"], progress=False)  # works
    global_bound(adapted)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match="autocast"):
            certify.certify_table(model, x, y, ["lofast_M"], ["pairwise"], progress=False)
        with pytest.raises(RuntimeError, match="autocast"):
            certify.certify_batch(model, x, y, ["global"])
        with pytest.raises(RuntimeError, match="autocast"):
            global_bound(adapted)
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        with pytest.raises(RuntimeError, match="reduced-precision"):
            require_full_precision("a certificate")
    finally:
        torch.set_float32_matmul_precision(before)
    with autocast("bf16", "cpu"), pytest.raises(RuntimeError, match="autocast"):
        require_full_precision("a certificate")


def test_text_certificate_refuses_autocast():
    from attncert.text.models import OLSAClassifier
    from attncert.text.train_text import certify_rows

    torch.manual_seed(0)
    model = OLSAClassifier(vocab_size=30, max_len=6, dim=8, depth=1, heads=2).eval()
    data = {"ids": torch.randint(1, 30, (4, 6)), "mask": torch.ones(4, 6, dtype=torch.bool),
            "y": torch.tensor([0, 1, 0, 1])}
    assert len(certify_rows(model, data)) == 4
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError,
                                                                    match="autocast"):
        certify_rows(model, data)


def test_text_certificates_run_in_float64_from_the_models_embeddings():
    """The OLSA radii come from a float64 copy on the model's own embeddings; a frozen encoder
    is shared with the copy, neither copied nor converted."""
    from attncert.cost.kinds import StandInEncoder
    from attncert.text.models import FrozenEncoderOLSA, OLSAClassifier
    from attncert.text.train_text import certificate_copy, certify_rows

    torch.manual_seed(0)
    data = {"ids": torch.randint(1, 30, (6, 6)), "mask": torch.ones(6, 6, dtype=torch.bool),
            "y": torch.tensor([0, 1, 0, 1, 1, 0])}
    data["mask"][:3, 4:] = False
    model = OLSAClassifier(vocab_size=30, max_len=6, dim=8, depth=2, heads=2).eval()
    rows = certify_rows(model, data, batch_size=4)
    e = model.embed(data["ids"], data["mask"]).double()
    ref = certificate_copy(model).certified_radius(e, data["mask"], data["y"])
    # float64 (a float32 copy is 1e-7 away); batches of 4 and 2 against one of 6 may sum in
    # another order on some CPUs' BLAS (the last bits)
    torch.testing.assert_close(torch.as_tensor(rows.radius.to_numpy()), ref, rtol=1e-13, atol=0)
    assert next(model.parameters()).dtype == torch.float32  # the model itself is untouched
    frozen = FrozenEncoderOLSA(heads=2, max_len=6, encoder=StandInEncoder(12), hidden=8)
    copy64 = certificate_copy(frozen.eval())
    assert copy64.encoder is frozen.encoder and copy64.head.weight.dtype == torch.float64
    assert len(certify_rows(frozen, {**data, "ids": torch.randn(6, 6, 12)}, batch_size=4)) == 6


class _Threshold(torch.nn.Module):
    """Class 1 iff sum(x) > t: a float64 model whose boundary a float32 copy misplaces."""

    def __init__(self, t):
        super().__init__()
        self.t = torch.nn.Parameter(torch.tensor(t, dtype=torch.float64))

    def forward(self, x):
        s = x.flatten(1).sum(1) - self.t
        return torch.stack([-s, s], dim=1)


def test_confirm_counts_only_float64_misclassifications_inside_the_ball():
    x = torch.full((1, 1, 2, 2), 0.25, dtype=torch.float64)
    y = torch.tensor([0])
    eps = 0.1
    direction = torch.full_like(x, 0.5)  # unit norm: sum(x + r direction) = 1 + 2 r
    # a candidate a float32 attack could return: a little outside the ball
    outside = (x + direction * eps * (1 + 1e-4)).float()
    model = _Threshold(1.0 + 2 * eps * (1 + 5e-5))  # fooled only outside the ball
    assert model(outside.double()).argmax(1).item() == 1  # taken as it is, it would count
    cand, ok = confirm_l2(model, x, outside, y, eps)
    assert cand.dtype == torch.float64
    assert float((cand - x).flatten(1).norm()) <= eps
    assert not bool(ok.any())
    # a boundary inside the ball: the projected candidate is confirmed
    model = _Threshold(1.0 + 2 * eps * (1 - 1e-3))
    cand, ok = confirm_l2(model, x, outside, y, eps)
    assert bool(ok.all()) and float((cand - x).flatten(1).norm()) <= eps
    # no box for embeddings: values outside [0, 1] are kept
    far = torch.full((1, 1, 2, 2), 3.0, dtype=torch.float64)
    cand, _ = confirm_l2(model, far, far + 0.01, y, eps, box=False)
    assert float(cand.min()) > 3.0


def test_verified_pgd_attacks_in_float32_and_confirms_in_float64():
    torch.manual_seed(0)
    model = _vit(kind="lipschitz").double().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(3.0)
    x = torch.rand(16, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = model(x).argmax(1)
    copy32 = attack_copy(model)
    assert copy32 is not model and next(copy32.parameters()).dtype == torch.float32
    assert attack_copy(copy32) is copy32
    eps = 2.0
    x_adv, ok = verified_pgd_l2(model, x, y, eps, steps=30, restarts=1,
                                generator=torch.Generator().manual_seed(2))
    assert x_adv.dtype == torch.float64 and ok.any()
    norms = (x_adv - x).flatten(1).norm(dim=1)
    assert (norms[ok] <= eps).all() and x_adv.min() >= 0 and x_adv.max() <= 1
    with torch.no_grad():
        assert (model(x_adv[ok]).argmax(1) != y[ok]).all()
    # the float64 attack finds about the same points
    _, ok64 = pgd_l2(model, x, y, eps, 30, 1, generator=torch.Generator().manual_seed(2))
    assert abs(int(ok.sum()) - int(ok64.sum())) <= 2


def test_device_batches_match_the_cpu_draws():
    """The epoch generator lives on the batches' device; on the CPU the draws are unchanged
    (order, crops and flips from one generator, in that order)."""
    x = torch.arange(2 * 3 * 4 * 4, dtype=torch.float32).reshape(2, 3, 4, 4)
    g = epoch_generator(1, 2, "cpu")
    assert g.device.type == "cpu"
    order = torch.randperm(5, generator=g, device="cpu")
    out = augment_batch(x, "crop_flip", g, pad=1)
    g2 = torch.Generator().manual_seed(1 * 1_000_003 + 2)
    assert torch.equal(order, torch.randperm(5, generator=g2))
    dy = torch.randint(0, 3, (2,), generator=g2)
    dx = torch.randint(0, 3, (2,), generator=g2)
    flip = torch.rand(2, generator=g2) < 0.5
    padded = torch.nn.functional.pad(x, (1, 1, 1, 1))
    for i in range(2):
        want = padded[i, :, dy[i]:dy[i] + 4, dx[i]:dx[i] + 4]
        want = want.flip(-1) if flip[i] else want
        assert torch.equal(out[i], want)


def test_olsa_orthogonalisation_stays_float32_under_bf16_autocast():
    """Newton-Schulz in bfloat16 leaves W far from orthogonal; the layer computes W in
    float32 outside autocast whatever the training precision."""
    from attncert.text.orthogonal import OrthogonalLinear, newton_orthogonalize

    torch.manual_seed(0)
    layer = OrthogonalLinear(64, iters=1)
    with torch.no_grad():
        layer.v.add_(0.01 * torch.randn(64, 64))
    layer.reproject_(10)
    eye = torch.eye(64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        w = layer.weight_effective()
        loose = newton_orthogonalize(layer.v, 1)  # what autocast alone would compute
        y = layer(torch.randn(3, 64))
    assert w.dtype == torch.float32 and y.dtype == torch.bfloat16
    assert (w @ w.T - eye).abs().max() < 1e-5
    assert (loose.float() @ loose.float().T - eye).abs().max() > 1e-3


def test_the_bf16_training_path_trains_an_olsa_text_model(tmp_path):
    """The text training loop at bf16 (CPU autocast): finite losses, the orthogonal maps
    re-projected in float32, and a resolved precision recorded for the resume check."""
    from attncert.text.models import OLSAClassifier
    from attncert.text.orthogonal import OrthogonalLinear
    from attncert.text.train_text import TextTrainConfig, train_model

    g = torch.Generator().manual_seed(0)
    n, length, vocab = 48, 8, 30
    ids = torch.randint(1, vocab, (n, length), generator=g)
    data = {"ids": ids, "mask": torch.ones(n, length, dtype=torch.bool),
            "y": (ids[:, 0] % 2).long()}
    model = OLSAClassifier(vocab_size=vocab, max_len=length, dim=16, depth=1, heads=2)
    rows = train_model(model, {"name": "olsa-bf16"}, data, data,
                       TextTrainConfig(epochs=1, batch_size=16, logit_scale=5.0), tmp_path,
                       "cpu", precision="bf16")
    assert len(rows) == 1 and all(torch.isfinite(torch.tensor(r["train_loss"])) for r in rows)
    for m in model.modules():
        if isinstance(m, OrthogonalLinear):
            w = m.weight_effective()
            assert (w @ w.T - torch.eye(w.shape[0])).abs().max() < 1e-5
    assert "bf16" in (tmp_path / "spec.json").read_text()
