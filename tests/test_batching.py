"""A CUDA out-of-memory error halves the batch and retries; results are unchanged."""

import pytest
import torch
from torch import nn

from attncert.pipeline.batching import in_batches


def _oom_above(limit: int):
    def run(a: int, b: int):
        if b - a > limit:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return list(range(a, b))
    return run


def test_an_oom_halves_the_batch_and_keeps_every_item(capsys):
    out = in_batches(10, 8, _oom_above(3), "test loop")
    assert [i for chunk in out for i in chunk] == list(range(10))
    assert max(len(c) for c in out) <= 2  # 8 -> 4 -> 2, kept for the rest
    assert "retrying with 4" in capsys.readouterr().out


def test_a_single_item_that_does_not_fit_still_raises():
    with pytest.raises(torch.OutOfMemoryError):
        in_batches(3, 4, _oom_above(0))
    with pytest.raises(ValueError, match="batch size"):
        in_batches(3, 0, _oom_above(4))


def test_the_audit_and_the_certvit_certificate_back_off(monkeypatch):
    """A model that runs out of memory above 2 images: the PGD audit and CertViT's certificate
    give the results of a run that never did."""
    from attncert import certify
    from attncert.certvit import certificate

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3)).double()

    class Small(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            if len(x) > 2:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")
            return self.inner(x)

    x, y = torch.rand(7, 3, 2, 2, dtype=torch.float64), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    radii = {"r": torch.zeros(7, dtype=torch.float64)}
    want, _ = certify.audit(net, x, y, radii, [0.1], steps=2, restarts=1, batch_size=2)
    got, _ = certify.audit(Small(net), x, y, radii, [0.1], steps=2, restarts=1, batch_size=8)
    assert got == want
    w = net[1].weight
    a = certificate.certify_pairwise(net, x, y, w, 1.0, [0.1], batch_size=2)
    b = certificate.certify_pairwise(Small(net), x, y, w, 1.0, [0.1], batch_size=8)
    assert torch.allclose(a["radius"], b["radius"], rtol=1e-12, atol=0)  # batch-size rounding


def test_specformer_attacks_back_off(capsys):
    """SpecFormer's attacks on a model that runs out of memory above 2 images attack every
    image: the attacks without a random start give the accuracies of a run at batch 2 (a
    retried batch draws new random starts, so the others may differ)."""
    from attncert import specformer as sf

    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))

    class Small(nn.Module):
        def forward(self, x):
            if len(x) > 2:
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")
            return net(x)

    x, y = torch.rand(7, 3, 2, 2), torch.tensor([0, 1, 2, 0, 1, 2, 0])
    specs = sf.attack_specs(2.0, 8.0, 2, [0.5])
    want = sf.robust_accuracy(net, x, y, specs, batch_size=2)
    got = sf.robust_accuracy(Small(), x, y, specs, batch_size=8)
    assert [r["attack"] for r in got] == [r["attack"] for r in want]
    assert [r for r in got if r["kind"] in ("clean", "fgsm")] == [
        r for r in want if r["kind"] in ("clean", "fgsm")]
    assert "out of device memory at batch 7; retrying with 3" in capsys.readouterr().out
