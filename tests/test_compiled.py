"""Compiled training (``base.compile``, :mod:`attncert.training.compiled`): the same losses
and weights as eager within float tolerance, the same resume behaviour, the model eager again
afterwards, and the modes resolved per device. The CUDA-graph case runs on a GPU only
(``make gpu-check``)."""

import pytest
import torch
from test_train import fresh_model, toy_data

from attncert.training import compiled
from attncert.training.train import TrainConfig, train

CFG = TrainConfig(epochs=2, batch_size=16, lr=3e-3, warmup_steps=2, seed=1, margin="lmt",
                  lmt_offset=0.05)


@pytest.fixture
def mode():
    """Sets the process's compile mode for one test and restores eager afterwards."""
    yield compiled.set_mode
    compiled.set_mode("off")


def _run(tmp_path, name, device, callback=None):
    model = fresh_model()
    rows = train(model, toy_data(64, 0), toy_data(32, 1), CFG, tmp_path / name, device=device,
                 progress=False, callback=callback, precision="fp32")
    return model, rows


def _same(eager, other, rows_e, rows_o, tol):
    for (k, a), b in zip(eager.state_dict().items(), other.state_dict().values(), strict=True):
        assert torch.allclose(a, b.to(a.device), rtol=tol, atol=tol), k
    for r, s in zip(rows_e, rows_o, strict=True):
        assert r["train_loss"] == pytest.approx(s["train_loss"], rel=tol, abs=tol)
        assert r["test_acc"] == s["test_acc"]


def test_resolve_and_bad_mode(mode):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [compiled.resolve(cpu, m) for m in compiled.MODES] == ["off", "compile", "compile",
                                                                   "off"]
    assert [compiled.resolve(cuda, m) for m in compiled.MODES] == ["off", "compile", "graphs",
                                                                    "graphs"]
    with pytest.raises(ValueError, match="base.compile"):
        mode("fast")
    mode("auto")
    assert compiled.resolve(cpu) == "off" and compiled.resolve(cuda) == "graphs"


def test_compiled_training_equals_eager_and_resumes(tmp_path, mode):
    from torch._dynamo.utils import counters

    eager, rows_e = _run(tmp_path, "eager", "cpu")
    mode("compile")
    counters.clear()
    model, rows_c = _run(tmp_path, "compiled", "cpu")
    assert counters["stats"]["unique_graphs"] >= 1  # the forward pass was compiled
    assert "forward" not in vars(model)  # eager again: certificates never run compiled
    _same(eager, model, rows_e, rows_c, 1e-4)

    class Stop(Exception):
        pass

    def stop(epoch, _row):
        if epoch == 1:
            raise Stop

    with pytest.raises(Stop):
        _run(tmp_path, "resumed", "cpu", stop)
    resumed, rows_r = _run(tmp_path, "resumed", "cpu")  # compiled again from the checkpoint
    _same(eager, resumed, rows_e, rows_r, 1e-4)


def test_compiled_forward_is_undone_on_error():
    model = fresh_model()
    with pytest.raises(RuntimeError, match="inside"):
        with compiled.compiled_forward(model, "compile"):
            assert "forward" in vars(model)
            raise RuntimeError("inside")
    assert "forward" not in vars(model)
    with compiled.compiled_forward(model, "off"):
        assert "forward" not in vars(model)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_training_equals_eager(tmp_path, mode):
    eager, rows_e = _run(tmp_path, "eager", "cuda")
    mode("graphs")
    model, rows_g = _run(tmp_path, "graphs", "cuda")
    _same(eager, model, rows_e, rows_g, 1e-3)
