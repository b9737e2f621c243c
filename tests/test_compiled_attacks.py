"""The audits' attack model compiled (``base.compile``): the PGD audit finds what eager finds,
a compiled attack that fails goes on eager with the same random starts, and an eager mode or a
model already in the attack's precision leaves the model as it is. The CUDA-graph case needs a
GPU (``make gpu-check``)."""

import pytest
import torch
from test_train import fresh_model

from attncert import attacks
from attncert.training import compiled


def _audit_inputs():
    model = fresh_model().double().eval()
    g = torch.Generator().manual_seed(3)
    x = torch.rand(6, 1, 8, 8, generator=g, dtype=torch.float64)
    y = model(x).argmax(1)
    return model, x, y


def _audit(model, x, y, attacker):
    return attacks.verified_pgd_l2(model, x, y, 0.8, steps=5, restarts=2,
                                   generator=torch.Generator(x.device).manual_seed(0),
                                   attack_model=attacker)


def test_a_compiled_attack_finds_what_eager_finds():
    model, x, y = _audit_inputs()
    eager = attacks.attack_copy(model, mode="off")
    assert "forward" not in vars(eager)
    torch._dynamo.reset()
    fast = attacks.attack_copy(model, mode="compile")
    assert "forward" in vars(fast) and "forward" not in vars(model)
    want, got = _audit(model, x, y, eager), _audit(model, x, y, fast)
    torch._dynamo.reset()
    # fused kernels round differently: a point at the boundary may fall either way
    assert int((got[1] != want[1]).sum()) <= 1
    both = got[1] == want[1]
    assert torch.allclose(got[0][both], want[0][both], atol=1e-4)
    assert compiled.uncompile(fast) and "forward" not in vars(fast)
    assert not compiled.uncompile(fast)


def test_a_failing_compiled_attack_goes_on_eager(monkeypatch, capsys):
    model, x, y = _audit_inputs()
    want = _audit(model, x, y, attacks.attack_copy(model, mode="off"))

    calls = []

    def broken(fn, **_):  # fails after the first random start was drawn
        def run(*args, **kwargs):
            calls.append(1)
            if len(calls) >= 3:
                raise RuntimeError("Cannot copy between CPU and CUDA tensors during capture")
            return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(torch, "compile", broken)
    attacker = attacks.attack_copy(model, mode="compile")
    got = _audit(model, x, y, attacker)
    assert "forward" not in vars(attacker)  # eager from here on
    assert "runs eager from here on" in capsys.readouterr().out and len(calls) == 3
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])  # the same starts


def test_an_eager_failure_is_not_swallowed(monkeypatch):
    model, x, y = _audit_inputs()
    attacker = attacks.attack_copy(model, mode="off")
    monkeypatch.setattr(attacks, "pgd_l2", lambda *a, **k: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(ValueError):
        _audit(model, x, y, attacker)


def test_the_attack_model_is_eager_on_a_cpu_under_auto():
    model, _, _ = _audit_inputs()
    assert "forward" not in vars(attacks.attack_copy(model, mode="auto"))
    same = fresh_model().float()
    assert attacks.attack_copy(same, mode="compile") is same and "forward" not in vars(same)


def test_an_out_of_memory_error_is_left_to_the_batch_loop(monkeypatch):
    """Out of memory halves the batch (attncert.pipeline.batching); the attack stays compiled."""
    model, x, y = _audit_inputs()
    attacker = attacks.attack_copy(model, mode="compile")

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(attacks, "pgd_l2", oom)
    with pytest.raises(torch.OutOfMemoryError):
        _audit(model, x, y, attacker)
    assert compiled.uncompile(attacker)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_an_attack_under_cuda_graphs_finds_what_eager_finds():
    model, x, y = (t.cuda() for t in _audit_inputs())
    want = _audit(model, x, y, attacks.attack_copy(model, mode="off"))
    torch._dynamo.reset()
    attacker = attacks.attack_copy(model, mode="graphs")
    got = _audit(model, x, y, attacker)
    torch._dynamo.reset()
    assert compiled.uncompile(attacker)  # it ran captured, not through the eager fallback
    assert torch.equal(got[1].cpu(), want[1].cpu())
