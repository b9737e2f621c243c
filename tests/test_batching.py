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
    from attncert.specformer import methods as sf

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


class _FakeCuda:
    """CUDA's memory counters for a loop whose batch of k items peaks at k MB above what it
    started with, on a device of ``total`` MB."""

    MB = 2 ** 20

    def __init__(self, monkeypatch, total: int = 100):
        self.allocated, self.peak, self.total = 10 * self.MB, 40 * self.MB, total * self.MB
        cuda = torch.cuda
        for name, fn in {"is_available": lambda: True, "current_device": lambda: 0,
                         "memory_allocated": lambda i=0: self.allocated,
                         "max_memory_allocated": lambda i=0: self.peak,
                         "reset_peak_memory_stats": self.reset,
                         "get_device_properties": lambda i=0: type(
                             "P", (), {"total_memory": self.total})()}.items():
            monkeypatch.setattr(cuda, name, fn)

    def reset(self, i=0):
        self.peak = self.allocated

    def run(self, a: int, b: int) -> list[int]:
        self.peak = max(self.peak, self.allocated + (b - a) * self.MB)
        return list(range(a, b))


def _growing(monkeypatch) -> "_FakeCuda":
    """Every loop on a simulated CUDA device of ample memory, its batch grown (share 0.5)."""
    from attncert.pipeline import batching

    fake = _FakeCuda(monkeypatch, total=10 ** 6)
    monkeypatch.setattr(batching, "_share", 0.5)
    monkeypatch.setattr(batching, "_cuda_index", lambda device: 0)
    return fake


def _record_loops(monkeypatch, module) -> list[list[int]]:
    """``module``'s in_batches loops, each recorded as the sizes of its batches."""
    calls: list[list[int]] = []

    def recorded(n, batch_size, run, *args, **kwargs):
        sizes: list[int] = []
        calls.append(sizes)
        return in_batches(n, batch_size, lambda a, b: sizes.append(b - a) or run(a, b),
                          *args, **kwargs)

    monkeypatch.setattr(module, "in_batches", recorded)
    return calls


def test_batches_grow_to_the_share_of_device_memory(monkeypatch):
    """On a CUDA device the batch doubles while twice its peak fits in base.batch_memory of
    the device (here 50 of 100 MB, 10 MB already allocated: 4 -> 8 -> 16 -> 32; 64 would
    need 74),
    covering every item once in order; on the CPU, or with a share of 0, it never grows."""
    from attncert.pipeline import batching

    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(batching, "_share", 0.5)
    seen = []
    out = in_batches(100, 4, fake.run, device="cuda", done=seen.append)
    assert [len(c) for c in out][:5] == [4, 8, 16, 32, 32] and max(seen) == 32
    assert [i for c in out for i in c] == list(range(100)) and sum(seen) == 100
    assert batching.device_peak(0) == 42 * fake.MB  # the largest peak across the resets
    assert {len(c) for c in in_batches(20, 4, fake.run, device="cpu")} == {4}
    monkeypatch.setattr(batching, "_share", 0.0)
    assert {len(c) for c in in_batches(20, 4, fake.run, device="cuda")} == {4}
    with pytest.raises(ValueError, match="base.batch_memory"):
        batching.set_memory_share(1.0)


def test_an_oom_stops_the_growth(monkeypatch, capsys):
    from attncert.pipeline import batching

    fake = _FakeCuda(monkeypatch)
    monkeypatch.setattr(batching, "_share", 0.5)

    def run(a: int, b: int):
        if b - a > 8:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return fake.run(a, b)

    out = in_batches(60, 4, run, device="cuda")
    assert [len(c) for c in out][:4] == [4, 8, 8, 8] and sum(map(len, out)) == 60
    assert "retrying with 8" in capsys.readouterr().out


def test_certificates_do_not_depend_on_the_grown_batch(monkeypatch):
    """certify_table's rows with the batch grown from 2 equal those at a fixed batch (within
    the tolerance of the spectral norms' iterations, whose starts depend on the split)."""
    from test_certify import _model

    from attncert import certify

    model = _model()
    x = torch.rand(12, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = torch.tensor([0, 1, 2] * 4)
    kw = {"variants": ("global", "lofast_M"), "tests": ("pairwise",), "progress": False}
    fixed = certify.certify_table(model, x, y, batch_size=2, **kw)
    _growing(monkeypatch)
    calls = _record_loops(monkeypatch, certify)
    grown = certify.certify_table(model, x, y, batch_size=2, **kw)
    assert calls == [[2, 4, 6]]
    assert grown[["index", "prediction"]].equals(fixed[["index", "prediction"]])
    for c in (c for c in fixed if c.startswith("radius_")):
        assert torch.allclose(torch.tensor(grown[c].to_numpy()), torch.tensor(fixed[c].to_numpy()),
                              rtol=1e-3, atol=1e-9), c


def test_an_audit_s_batch_grows_once_for_every_radius(monkeypatch):
    """certify.audit sizes one batch for all its radii: the second radius starts at the size
    the first reached (each radius used to start again from the params' size), and a
    BatchSize passed to in_batches carries its size from one loop to the next."""
    from test_certify import _model

    from attncert import certify
    from attncert.pipeline import batching

    fake = _growing(monkeypatch)
    size = batching.BatchSize(2, "shared", "cuda")
    first = in_batches(20, size, fake.run)
    assert [len(c) for c in first] == [2, 4, 8, 6] and size.size == 16
    assert [len(c) for c in in_batches(20, size, fake.run)] == [16, 4]
    with pytest.raises(ValueError, match="integer"):
        batching.BatchSize(2.5)

    model = _model()
    x = torch.rand(12, 1, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    y = model(x).argmax(1)
    calls = _record_loops(monkeypatch, certify)
    rows, _ = certify.audit(model, x, y, {"r": torch.zeros(12, dtype=torch.float64)},
                            [0.1, 0.2, 0.3], steps=2, restarts=1, batch_size=2)
    forward, *radii = calls
    assert forward == [2, 4, 6] and len(radii) == 3 and len(rows) == 3
    # each radius attacks the points still standing, from the size the last one reached
    assert [sum(c) for c in radii] == [r["attacked"] for r in rows] and rows[0]["attacked"] == 12
    assert radii[0] == [2, 4, 6] and radii[1][0] == 8 and len(radii[2]) == 1


def test_the_text_audit_grows_one_batch_for_every_radius(monkeypatch):
    """audit_embeddings attacks the sentences in batches grown once for all its radii (as
    certify.audit does), every sentence still standing at every radius (the correctly
    classified ones here: none is broken at these radii)."""
    from test_device import _olsa_text

    from attncert.text import attacks

    model, ids, mask, y = _olsa_text()
    radius = torch.full((6,), 0.1, dtype=torch.float64)
    fixed = attacks.audit_embeddings(model, ids, mask, y, radius, [0.05, 1.0], steps=2,
                                     restarts=1, batch_size=2)
    _growing(monkeypatch)
    calls = _record_loops(monkeypatch, attacks)
    grown = attacks.audit_embeddings(model, ids, mask, y, radius, [0.05, 1.0], steps=2,
                                     restarts=1, batch_size=2)
    n = int((model(ids, mask).argmax(1) == y).sum())
    assert 2 < n < 6 and calls == [[2, n - 2], [n]]
    assert [r["attacked"] for r in grown] == [r["attacked"] for r in fixed] == [n, n]
    assert [r["robust_acc"] for r in grown] == [n / 6] * 2
    assert [r["broken"] for r in grown] == [0, 0]
