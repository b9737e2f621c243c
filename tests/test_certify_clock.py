"""Certificate timings synchronise a CUDA device before reading the clock."""

import torch

from attncert import certify


def test_the_clock_synchronises_the_tensor_s_cuda_device(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))

    class OnCuda:  # what the clock reads of a CUDA tensor
        is_cuda = True
        device = torch.device("cuda", 1)

    t0 = certify._clock(OnCuda())
    assert calls == [torch.device("cuda", 1)]
    assert certify._clock(torch.zeros(1)) >= t0 and len(calls) == 1  # CPU: no synchronise
