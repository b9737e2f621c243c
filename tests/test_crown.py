"""CROWN through auto_LiRPA on the Lipschitz ViT: the patches, the bridge equals the model, the
bounds contain every sampled and attacked output, the combination, failures as rows."""

import math

import pandas as pd
import pytest
import torch

from attncert.attacks import pgd_l2
from attncert.crown import PATCHES, CrownCertifier, CrownViT, apply_patches, certify_points, study
from attncert.crown.bridge import margin_spec
from attncert.models.vit import ViTConfig, build_vit


def tiny_vit(seed: int = 0, pool: str = "mean") -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=8, depth=1, heads=2, mlp_hidden=8,
                    num_classes=3, pool=pool, radius_attn=1.0, gamma_qk=1.0, gamma_vo=0.5,
                    mean=(0.3,), std=(0.5,))
    model = build_vit(cfg).double().eval()
    with torch.no_grad():  # spread the logits so that some points certify
        model.head.weight.mul_(4.0)
    return model


def sample_ball(x: torch.Tensor, eps: float, n: int, g: torch.Generator) -> torch.Tensor:
    d = torch.randn((n, *x.shape[1:]), generator=g, dtype=x.dtype)
    d = d / d.flatten(1).norm(dim=1).view(-1, 1, 1, 1)
    r = eps * torch.rand(n, generator=g, dtype=x.dtype) ** (1 / d[0].numel())
    return x + d * r.view(-1, 1, 1, 1)


def test_patches_are_idempotent():
    assert apply_patches() == PATCHES and len(PATCHES) == 6


@pytest.mark.parametrize("pool", ["mean", "cls"])
def test_bridge_equals_the_vit(pool):
    model = tiny_vit(1, pool)
    x = torch.rand(5, 1, 8, 8, dtype=torch.float64)
    assert torch.allclose(CrownViT(model).double()(x), model(x), atol=1e-6, rtol=0)


def test_margin_spec_rows():
    c = margin_spec(torch.tensor([2, 0]), 3)
    assert c.shape == (2, 2, 3)
    assert torch.equal(c[0], torch.tensor([[-1.0, 0, 1], [0, -1, 1]], dtype=torch.float64))


def test_crown_bounds_contain_sampled_and_attacked_outputs():
    model = tiny_vit()
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    g = torch.Generator().manual_seed(0)
    for k in range(2):
        x = torch.rand(1, 1, 8, 8, generator=g, dtype=torch.float64)
        eps = 0.3
        lower, upper = cert.output_bounds(x, eps)
        pts = sample_ball(x, eps, 2000, g)
        with torch.no_grad():
            out = model(pts)
        assert (out >= lower - 1e-9).all() and (out <= upper + 1e-9).all()
        y = model(x).argmax(1)
        margin = cert.margin_lower(x, y, eps)
        xa, _ = pgd_l2(model, x.expand(4, -1, -1, -1), y.expand(4), eps, 30, 2, generator=g)
        with torch.no_grad():
            logits = torch.cat([model(xa), out])
        gaps = logits[:, y] - logits  # (N, C): f_y - f_j
        others = [j for j in range(3) if j != int(y)]
        assert (gaps[:, others] >= margin - 1e-9).all(), k


def test_combination_certifies_at_least_either_method():
    model = tiny_vit()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(6, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    eps = [0.02, 0.1]
    lofast = study.lofast_frame(model, x, y, "lofast_M", eps)
    crown, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, dtype=torch.float64)
    t1, t2 = study.tables(lofast, crown, eps, 1, "CROWN")
    assert len(t1) == 2 and len(t2) == 2
    for r in t2:
        assert r["combined_acc"] >= max(r["crown_acc"], r["lofast_acc"])
        assert r["combined_seconds"] <= r["crown_seconds"] + lofast["seconds"].mean() + 1e-12
    assert crown["certified"].any()  # the tiny model certifies some points at 0.02


def test_failures_are_rows_not_exceptions():
    model = tiny_vit()
    x = torch.rand(2, 1, 8, 8, dtype=torch.float64)
    y = model(x).argmax(1)
    broken = CrownCertifier(None, 3, torch.float64, 0.0, "NotImplementedError: op")
    rows = certify_points(broken, x, y, [0.1])
    assert [r["status"] for r in rows] == ["unsupported", "unsupported"]
    assert not any(r["certified"] for r in rows)
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    rows = certify_points(cert, x, y, [1e6])  # the bounds leave 1/x's domain or overflow
    assert all(r["status"] in ("domain", "overflow", "ok") and not r["certified"]
               for r in rows)
    skip = torch.tensor([[True], [False]])
    rows = certify_points(cert, x, y, [0.05], skip=skip)
    assert rows[0]["status"] == "skipped" and rows[0]["seconds"] == 0.0
    assert rows[1]["status"] == "ok" and math.isfinite(rows[1]["margin_lower"])
    assert isinstance(pd.DataFrame(rows), pd.DataFrame)


def test_time_limit_is_recorded_when_the_alarm_is_caught_and_rethrown():
    """auto_LiRPA catches some errors and retries; a TimeLimit turned into a TypeError inside
    the block must still be recorded as the time limit, not as an error."""
    import time

    from attncert.crown.bridge import TimeLimit, time_limit

    with pytest.raises(TypeError), time_limit(0.05) as alarm:
        try:
            time.sleep(1.0)
        except TimeLimit:
            raise TypeError("a call retried after the alarm") from None
    assert alarm.fired
    with time_limit(5.0) as quiet:
        pass
    assert not quiet.fired
