"""Attention diagnostics (attncert.diagnostics) on constructed models whose answer is known."""

import math

import pytest
import torch
from torch import nn

from attncert import diagnostics as dg
from attncert.layers import MultiHeadAttention
from attncert.models import ViTConfig, build_vit

F64 = torch.float64
SHAPE = dict(image_size=8, channels=1, patch=2, dim=8, depth=2, heads=2, mlp_hidden=12,
             num_classes=3)


def vit(**kw):
    torch.manual_seed(0)
    return build_vit(ViTConfig(**{**SHAPE, **kw})).double().eval()


def images(b=12, seed=0):
    return torch.rand(b, 1, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=F64)


def labels_of(model, x):
    with torch.no_grad():
        return model(x).argmax(-1)


def zero_(linear: nn.Module) -> None:
    """W = 0 (a NormConstrainedLinear's effective matrix is then 0 too)."""
    with torch.no_grad():
        linear.weight.zero_()


@pytest.mark.parametrize("kind", ["standard", "lipschitz"])
def test_exactly_uniform_attention_has_entropy_one_and_no_gap(kind):
    model = vit(kind=kind)
    for attn in dg.attention_layers(model).values():
        zero_(attn.q)  # every logit 0: exactly uniform rows
    x = images()
    d = dg.attention_diagnostics(model, x, labels_of(model, x), batch_size=5)
    assert d["entropy"] == pytest.approx([1.0, 1.0], abs=1e-12)
    assert d["acc"] == 1.0 and d["acc_uniform"] == 1.0 and d["uniform_gap"] == 0.0
    assert d["logit_max"] == 0.0
    assert d["n"] == 12 and d["layers"] == ["blocks.0.attn", "blocks.1.attn"]


def test_one_hot_attention_has_entropy_zero():
    """Orthogonal tokens of norm 30 and W^Q = W^K = I: each row is the identity to 1e-40."""
    attn = MultiHeadAttention(dim=8, heads=1, lipschitz=False).double()
    with torch.no_grad():
        for m in (attn.q, attn.k):
            m.weight.copy_(torch.eye(8, dtype=F64))
    tokens = 30.0 * torch.eye(8, dtype=F64)[:6].expand(4, 6, 8)

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn, self.head = attn, nn.Linear(8, 3).double()

        def forward(self, t):
            return self.head((t + self.attn(t)).mean(1))

    model = Pooled()
    d = dg.attention_diagnostics(model, tokens, labels_of(model, tokens))
    assert d["entropy"] == pytest.approx([0.0], abs=1e-9)
    assert d["identity_gap"] == 0.0  # the trained pattern is the identity
    assert d["logit_max"] == pytest.approx(900.0 / math.sqrt(8))
    assert d["logit_cap"] is None  # a standard attention has no structural cap


@pytest.mark.parametrize("kind", ["standard", "lipschitz"])
def test_a_model_that_ignores_attention_has_no_gap(kind):
    model = vit(kind=kind)
    for attn in dg.attention_layers(model).values():
        zero_(attn.o)  # no value path: the attention branch outputs 0 whatever its pattern
    x = images(30)
    d = dg.attention_diagnostics(model, x, labels_of(model, x))
    assert d["acc"] == d["acc_uniform"] == d["acc_identity"] == 1.0
    assert d["uniform_gap"] == d["identity_gap"] == 0.0
    assert 0.0 < d["entropy_mean"] < 1.0  # the pattern itself is not uniform


def test_the_ablations_replace_the_pattern_and_are_undone():
    """A standard ViT with large Q/K: uniform and identity change its logits; after the block,
    the model is itself again; the replacement is the stated matrix."""
    model = vit(kind="standard")
    with torch.no_grad():
        for attn in dg.attention_layers(model).values():
            attn.q.weight.mul_(20)
    x = images()
    before = model(x)
    for mode in dg.ABLATIONS:
        with dg.override_attention(model, mode) as calls:
            changed = model(x)
            p = model.blocks[0].attn.compute_probs(torch.zeros(3, 5, 8, dtype=F64))
        assert calls["blocks.0.attn"] >= 1
        assert not torch.allclose(changed, before)
        want = torch.eye(5, dtype=F64) if mode == "identity" else torch.full((5, 5), 0.2,
                                                                              dtype=F64)
        torch.testing.assert_close(p, want.expand(3, 2, 5, 5))
    torch.testing.assert_close(model(x), before)
    assert "compute_probs" not in vars(model.blocks[0].attn)


def test_uniform_replacement_spreads_over_real_keys_only():
    x = torch.zeros(2, 4, 6)
    mask = torch.tensor([[True, True, False, False], [True, True, True, True]])
    p = dg._replacement("uniform", x, 3, mask)
    assert p.shape == (2, 3, 4, 4)
    torch.testing.assert_close(p[0, 0, 0], torch.tensor([0.5, 0.5, 0.0, 0.0]))
    torch.testing.assert_close(p[1, 2, 3], torch.full((4,), 0.25))
    ent = dg.row_entropy(p, mask)
    torch.testing.assert_close(ent, torch.ones(2))


def test_logit_cap_is_the_constraints_arithmetic():
    cfg = ViTConfig(**{**SHAPE, "radius_attn": 2.0, "gamma_qk": 0.5})
    assert dg.logit_cap(cfg) == pytest.approx(4 * 0.25 / 2)  # d_h = 4
    assert dg.logit_cap(ViTConfig(**SHAPE, kind="standard")) is None
    model = build_vit(cfg).double().eval()
    x = images()
    d = dg.attention_diagnostics(model, x, labels_of(model, x))
    assert d["logit_cap"] == pytest.approx(0.5)
    assert 0 < d["logit_max"] <= d["logit_cap"]  # the constraint holds on data


def test_bad_inputs_are_refused_in_one_line():
    model = vit()
    with pytest.raises(ValueError, match="labels"):
        dg.attention_diagnostics(model, images(3), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="no attention layer"):
        dg.attention_diagnostics(nn.Linear(2, 2), torch.zeros(1, 2), torch.zeros(1).long())
    with pytest.raises(ValueError, match="choose from"):
        with dg.override_attention(model, "random"):
            pass


def test_a_forward_that_bypasses_compute_probs_is_refused():
    class Bypass(MultiHeadAttention):
        def forward(self, x, mask=None):
            return self.o(self.v(x))

    class M(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = Bypass(4, 2, lipschitz=False)

        def forward(self, t):
            return self.attn(t).mean(1)

    with pytest.raises(ValueError, match="compute_probs"):
        dg.attention_diagnostics(M(), torch.rand(3, 5, 4), torch.zeros(3).long())


def test_local_global_radius():
    assert dg.local_global_radius({"lofast_M_pairwise": 1.3, "global_pairwise": 1.0}) == 1.3
    assert dg.local_global_radius({"lofast_M_pairwise": 1.3}) is None
    assert dg.local_global_radius({"lofast_M_pairwise": 1.0, "global_pairwise": 0.0}) is None


@pytest.mark.parametrize("name", ["L2MultiHeadAttention", "LNFormerAttention",
                                  "ScaledCosineAttention"])
def test_every_attention_variant_can_be_replaced(name):
    """The baselines' attention (CertViT's L2 attention, LNFormer, LipsFormer's cosine) forms
    its matrix through compute_probs, so the ablation reaches it and changes the output."""
    import attncert.layers as layers

    torch.manual_seed(0)
    attn = getattr(layers, name)(8, 2).double()
    x = torch.randn(6, 5, 8, dtype=F64)
    before = attn(x)
    with dg.override_attention(attn, "identity") as calls:
        after = attn(x)
    assert calls[""] == 1 and not torch.allclose(after, before)
    torch.testing.assert_close(attn(x), before)


def test_the_diagnostics_do_not_depend_on_the_batches_or_on_a_retried_batch(monkeypatch):
    """The same numbers at batch 5 and in one batch, and when a batch runs out of device
    memory half-way (after its trained pass counted its entropies) and is retried at half its
    size: a batch's sums are added once, after it ran (attncert.pipeline.batching)."""
    model = vit()
    x = images(12)
    y = labels_of(model, x)
    y[:4] = (y[:4] + 1) % 3  # some wrong labels: accuracies below 1
    whole = dg.attention_diagnostics(model, x, y, batch_size=12)
    assert whole["acc"] == pytest.approx(8 / 12)

    def same(d):
        assert d["entropy"] == pytest.approx(whole["entropy"], rel=1e-12)
        assert d["logit_max"] == pytest.approx(whole["logit_max"], rel=1e-12)
        assert {k: d[k] for k in ("acc", "acc_uniform", "acc_identity", "n", "layers")} == {
            k: whole[k] for k in ("acc", "acc_uniform", "acc_identity", "n", "layers")}
    same(dg.attention_diagnostics(model, x, y, batch_size=5))
    real, failed = dg.override_attention, []

    def override_once(m, mode):  # the first ablation of the first batch runs out of memory
        if not failed:
            failed.append(mode)
            raise torch.OutOfMemoryError("simulated")
        return real(m, mode)
    monkeypatch.setattr(dg, "override_attention", override_once)
    retried = dg.attention_diagnostics(model, x, y, batch_size=12)
    assert failed == ["uniform"]
    same(retried)
