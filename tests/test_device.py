"""Every stage's random draws and tensors stay on the model's device (run on a simulated one).

The code paths below run with their models and inputs on ``simdev`` (tests/simdevice.py), a
second device type that computes on the CPU but fails like CUDA on a generator from another
device, on host tensors mixed into device operators, and on host draws copied to the device.
Where a path is seeded, its simdev result must equal its CPU result: the same generator
stream on either device.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
from simdevice import DeviceError, SimTensor, simulated_device

from attncert import certify, tightness
from attncert.certvit import DRConfig, adapt, constrain, empirical_lipschitz
from attncert.certvit.certificate import certify as certify_global
from attncert.models.vit import ViTConfig, build_vit
from attncert.msvp import MSVP
from attncert.pipeline.device import resolve_device
from attncert.specformer import methods as sf
from attncert.training.train import ImageSteps, TrainConfig

F64 = torch.float64


def _host(t):
    """A simdev result back on the host (tensors, lists, dicts, frames pass through)."""
    if isinstance(t, SimTensor):
        return t.elem
    if isinstance(t, dict):
        return {k: _host(v) for k, v in t.items()}
    if isinstance(t, list | tuple):
        return type(t)(_host(v) for v in t)
    return t


# -- the harness itself ---------------------------------------------------------------------


def test_simulated_device_fails_like_a_gpu_and_passes_correct_code():
    with simulated_device() as sim:
        x = torch.ones(3, 4, device=sim.device)
        g_dev = torch.Generator(device=x.device).manual_seed(0)
        g_host = torch.Generator().manual_seed(0)
        assert x.device.type == "simdev" and g_dev.device == x.device
        # correct code: draws on the device with a device generator, host scalars, indexing
        z = torch.randn(x.shape, generator=g_dev, device=x.device) + x * torch.tensor(2.0)
        assert z.device == x.device and z[torch.tensor([0, 2])].shape == (2, 4)
        torch.nn.init.normal_(torch.empty(2, 2, device=x.device), generator=g_dev)
        bad = {
            "device indices into a host tensor": lambda: torch.ones(5)[torch.tensor(
                [0, 2], device=x.device)],
            "generator": lambda: torch.randn(3, generator=g_host, device=x.device),
            "host generator in place": lambda: torch.empty(2, device=x.device).uniform_(
                generator=g_host),
            "device generator, host draw": lambda: torch.rand(3, generator=g_dev),
            "one device": lambda: x + torch.ones(3, 4),
            "host draw copied": lambda: torch.randn(3, generator=g_host).double().to(x.device),
        }
        for fn in bad.values():
            with pytest.raises(DeviceError):
                fn()
        syncs = sim.host_syncs
        float(x.sum()), x.cpu(), x.tolist()
        assert sim.host_syncs == syncs + 3
    # the values are the CPU values: same generator stream on both devices
    torch.testing.assert_close(z.elem, torch.randn(3, 4, generator=torch.Generator()
                                                   .manual_seed(0)) + 2)


def test_pgd_waits_for_the_device_once_per_restart_not_per_step():
    from attncert.attacks import pgd_l2, pgd_linf

    model = _standard_vit()
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 0])
    syncs = {}
    for steps in (2, 6):
        with simulated_device() as sim:
            dm, xs, ys = model.to(sim.device), x.to(sim.device), y.to(sim.device)
            g = torch.Generator(device=sim.device).manual_seed(0)
            pgd_l2(dm, xs, ys, 0.01, steps, restarts=2, generator=g)
            pgd_linf(dm, xs, ys, 0.001, steps, restarts=2, generator=g)
        syncs[steps] = sim.host_syncs
    assert syncs[2] == syncs[6] <= 4


# -- LoFAST tightness -----------------------------------------------------------------------


def test_tightness_measurements_on_the_device():
    w, x = tightness.random_attention_layer(n=3, d=4, h=2, seed=0, samples=1)
    kw = dict(attack_steps=2, attack_restarts=1, seed=1)
    ref3 = tightness.table3(w, x, eps_list=(0.05,), **kw)
    with simulated_device() as sim:
        ws, xs = w.to(sim.device), x.to(sim.device)
        t3 = tightness.table3(ws, xs, eps_list=(0.05,), **kw)
        f1 = tightness.figure1_single_head(ws, xs, eps_list=(0.05,), **kw)
        f3 = tightness.figure3_weight_perturbation(ws, xs, sizes=(0.1,), samples=1, **kw)
        f4 = tightness.figure4_input_norm(ws, xs, scales=(0.5, 2.0), eps=0.05, **kw)
    assert len(f1) and len(f3) and len(f4) and sim.draws_on_device > 0
    # the same draws; the dense spectral norms may take another LAPACK path (last bits)
    pd.testing.assert_frame_equal(t3, ref3, rtol=1e-12)


# -- certification of the Lipschitz ViT: certify_table and the PGD audit --------------------


def _lipschitz_vit():
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=8, depth=1, heads=2, mlp_hidden=8,
                    num_classes=3, kind="lipschitz", block="stream", gamma_vo=0.75,
                    mean=(0.5,), std=(0.25,))
    return build_vit(cfg).double().eval()


def test_certify_table_and_audit_on_the_device():
    model = _lipschitz_vit()
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=F64)
    y = torch.tensor([0, 1, 2, 0])
    args = (["lofast_M"], ["pairwise"])
    ref = certify.certify_table(model, x, y, *args, batch_size=3)
    radii = {"lofast_M": torch.tensor(ref["radius_lofast_M_pairwise"].to_numpy())}
    ref_rows, ref_broken = certify.audit(model, x, y, radii, [0.05, 0.5], steps=3, restarts=1)
    with simulated_device() as sim:
        dm = model.to(sim.device)
        table = certify.certify_table(dm, x.to(sim.device), y.to(sim.device), *args,
                                      batch_size=3)
        rows, broken = certify.audit(dm, x.to(sim.device), y.to(sim.device),
                                     {k: v.to(sim.device) for k, v in radii.items()},
                                     [0.05, 0.5], steps=3, restarts=1)
        pre = certify.precompute(dm, x[:2].to(sim.device), ["lofast_M"])
    # certificates stay in float64 on the device: the logits and every bound term
    terms = [t for layer in pre.terms["lofast_M"].values() for t in layer
             if isinstance(t, torch.Tensor)]
    assert pre.logits.dtype == F64 and terms and all(t.dtype == F64 for t in terms)
    assert all(t.device.type == "simdev" for t in terms)
    assert sim.draws_on_device > 0
    cols = [c for c in table.columns if not c.startswith("seconds") and c != "forward_seconds"]
    exact = ["index", "label", "prediction", "correct"]
    assert table[exact].equals(ref[exact])
    # the device's kernels may sum in another order (a last-bit difference on some CPUs' BLAS)
    pd.testing.assert_frame_equal(table[cols], ref[cols], check_exact=False, rtol=1e-12,
                                  atol=0.0)
    assert rows == ref_rows and torch.equal(_host(broken), ref_broken)


# -- the text PGD audit (OLSA text classifier, embeddings space) ----------------------------


def _olsa_text(attention: str = "olsa"):
    from attncert.text.models import OLSAClassifier

    torch.manual_seed(0)
    model = OLSAClassifier(12, max_len=8, dim=8, depth=1, heads=2, attention=attention,
                           alpha1=1.0, residual="averaged", residual_init=0.1).double().eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 12, (6, 8), generator=g)
    ids[:, 0] = 1
    mask = torch.ones(6, 8, dtype=torch.bool)
    y = torch.tensor([0, 1, 0, 1, 0, 1])
    return model, ids, mask, y


def test_text_audit_on_the_device():
    from attncert.text.attacks import audit_embeddings

    model, ids, mask, y = _olsa_text()
    radius = torch.full((6,), 0.1, dtype=F64)
    ref = audit_embeddings(model, ids, mask, y, radius, [0.05, 1.0], steps=3, restarts=2)
    with simulated_device() as sim:
        rows = audit_embeddings(model.to(sim.device), ids.to(sim.device), mask.to(sim.device),
                                y.to(sim.device), radius.to(sim.device), [0.05, 1.0], steps=3,
                                restarts=2)
    assert sim.draws_on_device > 0 and rows == ref


@pytest.mark.parametrize("attention", ["olsa", "l2"])  # l2: Kim et al.'s, a control of text
def test_text_olsa_certificates_on_the_device(attention):
    from attncert.text.train_text import certify_rows

    model, ids, mask, y = _olsa_text(attention)
    data = {"ids": ids, "mask": mask, "y": y}
    ref = certify_rows(model, data, batch_size=4)
    with simulated_device() as sim:
        cert = certify_rows(model.to(sim.device), data, sim.device, batch_size=4)
    pd.testing.assert_frame_equal(cert.drop(columns="seconds"), ref.drop(columns="seconds"),
                                  rtol=1e-12)


def test_frozen_encoder_states_on_the_device(tmp_path):
    """The frozen head's encoder states from a model built on the host (as the text stage
    builds it), computed on the device into a memory-mapped file."""
    import transformers

    from attncert.text.evaluate import frozen_states
    from attncert.text.models import FrozenEncoderOLSA

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=12, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16)).eval()
    mask = torch.arange(8).expand(5, 8) < torch.tensor([[3], [8], [5], [1], [6]])
    data = {"ids": torch.randint(1, 12, (5, 8)) * mask, "mask": mask, "y": torch.arange(5) % 2}
    ref = frozen_states(FrozenEncoderOLSA(heads=2, encoder=bert, max_len=8), data, "cpu", 2)
    with simulated_device() as sim:
        model = FrozenEncoderOLSA(heads=2, encoder=bert, max_len=8)  # on the host
        out = frozen_states(model, data, sim.device, 2, path=tmp_path / "train.npy")
    assert torch.allclose(out["ids"], ref["ids"], atol=1e-6)


# -- CertViT: the empirical-Lipschitz audit and the Douglas-Rachford record step ------------


def _standard_vit():
    torch.manual_seed(0)
    return build_vit(ViTConfig(image_size=8, channels=1, patch=4, dim=16, depth=1, heads=2,
                               mlp_hidden=16, num_classes=3, kind="standard", block="prenorm",
                               attn_bias=True, mean=(0.3,), std=(0.4,))).eval()


def test_certvit_certificate_audit_and_douglas_rachford_on_the_device():
    model = _standard_vit()
    x = torch.rand(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    cfg = DRConfig(max_pairs=16, iterations=2, batch_size=8, seed=3)
    ref_emp = empirical_lipschitz(model, x, steps=2,
                                  generator=torch.Generator().manual_seed(0))
    ref_dr = constrain(model, x, cfg, include=["blocks.0.mlp.fc1"])
    with simulated_device() as sim:
        dm = model.to(sim.device)
        emp = empirical_lipschitz(dm, x.to(sim.device), steps=2,
                                  generator=torch.Generator(device=sim.device).manual_seed(0))
        dr = constrain(dm, x, cfg, include=["blocks.0.mlp.fc1"])
    adapted = adapt(_standard_vit())
    y = torch.tensor([0, 1, 2, 0])
    ref_cert = certify_global(adapted, x, y, [0.01, 0.1], attack_steps=2)
    with simulated_device() as sim:
        cert = certify_global(adapted.to(sim.device), x.to(sim.device), y.to(sim.device),
                              [0.01, 0.1], attack_steps=2)
    assert cert["audit"] == ref_cert["audit"] and cert["broken"] == 0
    # the exact spectral norms of the bound may take another LAPACK path (last bits)
    torch.testing.assert_close(cert["radius"], ref_cert["radius"], rtol=1e-12, atol=0)
    # the device may run another attention kernel (fused on the CPU): float32's last bits,
    # carried through the ascent's steps (1.03e-6 apart on one CPU)
    assert sim.draws_on_device > 0 and emp == pytest.approx(ref_emp, rel=1e-5)
    assert all(v.device.type == "simdev" for v in dr.weights.values())
    for k, v in ref_dr.weights.items():
        torch.testing.assert_close(_host(dr.weights[k]), v, rtol=1e-5, atol=1e-6)


# -- SpecFormer: MSVP, the attacks of robust_accuracy and the step timer --------------------


BASE = ViTConfig(image_size=8, channels=1, patch=4, dim=8, depth=1, heads=2, mlp_hidden=8,
                 num_classes=3, kind="standard", block="prenorm", attn_bias=True,
                 mean=(0.5,), std=(0.3,))


def test_msvp_on_the_device():
    torch.manual_seed(0)
    model = build_vit(BASE)
    ref = MSVP(model, generator=torch.Generator().manual_seed(1)).train()
    ref_pen = ref()
    with simulated_device() as sim:
        dm = model.to(sim.device)
        msvp = MSVP(dm, generator=torch.Generator(device=sim.device).manual_seed(1)).train()
        pen = msvp()
    assert pen.device.type == "simdev" and torch.equal(_host(pen), ref_pen)


def test_specformer_attacks_and_step_times_on_the_device():
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 3, (8,), generator=g)
    x = torch.rand(8, 1, 8, 8, generator=g)
    torch.manual_seed(0)
    model = build_vit(sf.method_model_config("vanilla", BASE, 0.5)).eval()
    specs = [sf.AttackSpec("clean"), sf.AttackSpec("fgsm", 0.1, 1),
             sf.AttackSpec("pgd_linf", 0.1, 3), sf.AttackSpec("cw_linf", 0.1, 2),
             sf.AttackSpec("pgd_l2", 1.0, 3)]
    ref = sf.robust_accuracy(model, x, y, specs, batch_size=5, seed=0)
    torch.manual_seed(0)
    spec_model = build_vit(sf.method_model_config("specformer", BASE, 0.5))
    cfg = sf.method_train_config("specformer", TrainConfig(lr=1e-2, adversarial="pgd_linf",
                                                           adv_eps=0.03, adv_steps=2),
                                 (1e-3,) * 3)
    with simulated_device() as sim:
        rows = sf.robust_accuracy(model.to(sim.device), x.to(sim.device), y.to(sim.device),
                                  specs, batch_size=5, seed=0)
        times = sf.step_times({"specformer": (spec_model.to(sim.device), cfg)},
                              x.to(sim.device), y.to(sim.device), steps=1, rounds=1, warmup=0)
    assert sim.draws_on_device > 0 and rows == ref and len(times) == 1


def test_mixed_training_batches_on_the_device():
    """An epoch of crop-flip + Mixup / CutMix batches and their losses: no host tensor or
    host sync enters (the mix plan is Python numbers), and the values are the CPU values."""
    g = torch.Generator().manual_seed(0)
    data = {"x": torch.randint(0, 256, (24, 1, 8, 8), generator=g, dtype=torch.uint8),
            "y": torch.randint(0, 3, (24,), generator=g)}
    cfg = TrainConfig(batch_size=8, augment="crop_flip", mixup_alpha=0.8, cutmix_alpha=1.0,
                      mix_prob=1.0, seed=3)
    torch.manual_seed(0)
    model = build_vit(BASE)

    def epoch(device):
        steps = ImageSteps(model.to(device), data, cfg, device)
        keys = steps.plan(1)
        out = []
        for key in keys:
            inputs, y = steps.batch(key)
            out.append(steps.loss(inputs, y, 0)[1].detach())
        return keys, out

    ref_keys, ref = epoch(torch.device("cpu"))
    assert all(m is not None for _, m in ref_keys)
    with simulated_device() as sim:
        keys = ImageSteps(model.to(sim.device), data, cfg, sim.device).plan(1)
        syncs = sim.host_syncs
        _, got = epoch(sim.device)
        assert sim.host_syncs == syncs and sim.draws_on_device > 0
    assert [m for _, m in keys] == [m for _, m in ref_keys]
    # float32's last bits: the device may run another attention kernel (fused on the CPU)
    assert [float(_host(v)) for v in got] == pytest.approx([float(v) for v in ref], rel=1e-6)


# -- base.device ------------------------------------------------------------------------------


def test_resolve_device(monkeypatch):
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")
    # a machine with two visible GPUs, the second one current
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("auto") == resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="only 2 CUDA"):
        resolve_device("cuda:2")


def test_every_generator_comes_from_the_rng_helper():
    """One convention: the package and the notebooks make generators only through
    attncert.pipeline.rng.generator(seed, device)."""
    root = Path(__file__).resolve().parents[1]
    files = [*(root / "src" / "attncert").rglob("*.py"), *(root / "notebooks").glob("*.py")]
    offenders = [f"{p.relative_to(root)}:{i}" for p in files if p.name != "rng.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "Generator(" in line]
    assert len(files) > 20 and offenders == []
