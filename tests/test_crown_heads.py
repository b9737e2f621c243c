"""The CROWN graph's attention bounds all heads in one batched product: its CROWN and
alpha-CROWN margins equal those of the graph with one branch per head (``split_heads``, the
reference), both compute the ViT, and the batched form launches fewer kernels a bound."""

import pytest
import torch
from torch import nn

from attncert.cost.counting import count
from attncert.crown import CrownCertifier
from attncert.crown.graph import CrownViT
from attncert.models.vit import ViTConfig, build_vit

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def four_head_vit(depth: int = 2) -> nn.Module:
    torch.manual_seed(4)
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=8, depth=depth, heads=4, mlp_hidden=8,
                    num_classes=3, pool="mean", radius_attn=1.0, gamma_qk=1.0, gamma_vo=0.5,
                    mean=(0.3,), std=(0.5,))
    model = build_vit(cfg).double().eval()
    with torch.no_grad():
        model.head.weight.mul_(4.0)
    return model


def per_head_certifier(model: nn.Module) -> CrownCertifier:
    return CrownCertifier.from_vit(model, (1, 8, 8), split_heads=True)


def test_the_reference_computes_the_vit():
    model = four_head_vit()
    x = torch.rand(3, 1, 8, 8, dtype=torch.float64)
    with torch.no_grad():
        for split in (False, True):
            net = CrownViT(model, split_heads=split).double()
            assert torch.allclose(net(x), model(x), atol=1e-10, rtol=0), split


@pytest.mark.parametrize("method", ["crown", "alpha_crown"])
def test_batched_heads_bound_as_one_branch_per_head(method):
    model = four_head_vit()
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    ours = CrownCertifier.from_vit(model, (1, 8, 8))
    ref = per_head_certifier(model)
    for eps in (0.02, 0.05) if method == "crown" else (0.02,):
        a = ours.margin_lower(x, y, eps, method, 3)
        b = ref.margin_lower(x, y, eps, method, 3)
        assert torch.isfinite(a).all()
        assert torch.allclose(a, b, atol=1e-12, rtol=0), (eps, (a - b).abs().max())
    lo, up = ours.output_bounds(x, 0.1)
    rlo, rup = ref.output_bounds(x, 0.1)
    assert torch.allclose(lo, rlo, atol=1e-12, rtol=0) and torch.allclose(up, rup, atol=1e-12,
                                                                          rtol=0)


def test_batched_heads_launch_fewer_kernels():
    """The reason for the batched form: CROWN's backward passes (one per node that needs
    intermediate bounds) launch, on a GPU, one kernel after another."""
    model = four_head_vit(depth=1)
    x = torch.rand(1, 1, 8, 8, dtype=torch.float64)
    y = model(x).argmax(1)
    kernels = [count(CrownCertifier.from_vit(model, (1, 8, 8), split_heads=split)
                     .margin_call(x, y, 0.1))[1] for split in (False, True)]
    assert kernels[0] * 2 < kernels[1], kernels
