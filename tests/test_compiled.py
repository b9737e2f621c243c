"""Compiled training (``base.compile``, :mod:`attncert.training.compiled`): the same losses
and weights as eager within float tolerance, the same resume behaviour, the model eager again
afterwards, and the modes resolved per device. The CUDA-graph case runs on a GPU only
(``make gpu-check``)."""

import dataclasses

import pytest
import torch
from test_train import fresh_model, toy_data

from attncert.training import compiled
from attncert.training.train import TrainConfig, train

CFG = TrainConfig(epochs=2, batch_size=16, lr=3e-3, warmup_steps=2, seed=1, margin="lmt",
                  lmt_offset=0.05)
#: PGD adversarial training (SpecFormer's twins), two attack steps
ADV = dataclasses.replace(CFG, epochs=1, adversarial="pgd_linf", adv_eps=0.1, adv_steps=2)
#: the ``lofast`` margin (the cpu grid's), its radius ramped: a new value every step
LOFAST = dataclasses.replace(CFG, margin="lofast", lofast_eps=0.1, lofast_ramp=0.5,
                             lofast_mix=0.5, attn_entropy=0.01)

#: SpecFormer's MSVP penalty (its power-iteration vectors updated in place every step)
MSVP_CFG = dataclasses.replace(CFG, msvp_lambda=(0.05, 0.05, 0.05))
#: an attention-entropy term beside the LMT margin (the frontier's ``ent`` axis)
ENTROPY = dataclasses.replace(CFG, epochs=1, attn_entropy=0.05)


@pytest.fixture
def mode():
    """Sets the process's compile mode for one test and restores eager afterwards."""
    yield compiled.set_mode
    compiled.set_mode("off")


def _run(tmp_path, name, device, callback=None, config=CFG):
    model = fresh_model()
    rows = train(model, toy_data(64, 0), toy_data(32, 1), config, tmp_path / name,
                 device=device, progress=False, callback=callback, precision="fp32")
    return model, rows


def _interrupted_and_resumed(tmp_path, config):
    """(model, rows) of a run stopped after its first epoch and run again: it resumes from
    its checkpoint, compiled again where the mode compiles."""

    class Stop(Exception):
        pass

    def stop(epoch, _row):
        if epoch == 1:
            raise Stop

    with pytest.raises(Stop):
        _run(tmp_path, "resumed", "cpu", stop, config=config)
    return _run(tmp_path, "resumed", "cpu", config=config)


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

    resumed, rows_r = _interrupted_and_resumed(tmp_path, CFG)
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
@pytest.mark.parametrize("config", [CFG, ADV, LOFAST, ENTROPY, MSVP_CFG],
                         ids=["standard", "adversarial", "lofast", "entropy", "msvp"])
def test_cuda_graph_training_equals_eager(tmp_path, mode, config):
    from torch._dynamo.utils import counters

    eager, rows_e = _run(tmp_path, "eager", "cuda", config=config)
    mode("graphs")
    counters.clear()
    model, rows_g = _run(tmp_path, "graphs", "cuda", config=config)
    _same(eager, model, rows_e, rows_g, 1e-3)
    if config is MSVP_CFG:  # its in-place vectors replayed, not a silent fallback from graphs
        assert not counters["inductor"]["cudagraph_skips"], dict(counters["inductor"])
        _same_vectors(tmp_path, ("eager", "graphs"), 1e-3)


def test_compiled_adversarial_training_equals_eager(tmp_path, mode):
    """PGD adversarial training, its attack's passes compiled too: eager's losses, accuracy and
    weights (the same random starts), the parameters trainable again afterwards."""
    eager, rows_e = _run(tmp_path, "eager", "cpu", config=ADV)
    mode("compile")
    model, rows_c = _run(tmp_path, "compiled", "cpu", config=ADV)
    _same(eager, model, rows_e, rows_c, 1e-4)
    assert all(p.requires_grad for p in model.parameters())
    torch._dynamo.reset()


def test_compiled_lofast_margin_training_equals_eager_and_resumes(tmp_path, mode):
    """The ``lofast`` margin's whole loss compiled (forward pass, surrogate bound, backward:
    :func:`attncert.training.compiled.compiled_loss`): eager's losses, accuracy and weights,
    the radius a tensor input (no recompilation as it ramps), the same resume."""
    from torch._dynamo.utils import counters

    eager, rows_e = _run(tmp_path, "eager", "cpu", config=LOFAST)
    mode("compile")
    counters.clear()
    model, rows_c = _run(tmp_path, "compiled", "cpu", config=LOFAST)
    assert "forward" not in vars(model) and not hasattr(model, compiled._LOSSES)
    _same(eager, model, rows_e, rows_c, 1e-4)
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])  # no recompiles
    assert not counters["recompiles"], dict(counters["recompiles"])

    resumed, rows_r = _interrupted_and_resumed(tmp_path, LOFAST)
    _same(eager, resumed, rows_e, rows_r, 1e-4)
    torch._dynamo.reset()


def _eager_then_compiled(tmp_path, mode, monkeypatch, config, module, name):
    """(eager model, rows, compiled model, rows) of two runs of ``config``, the loss term
    ``module.name`` spied on: eager in the first run, traced by ``torch.compile`` in the
    second (the term ran compiled, not only the forward pass)."""
    traced, real = [], getattr(module, name)

    def spy(*args):
        traced.append(torch.compiler.is_compiling())
        return real(*args)

    monkeypatch.setattr(module, name, spy)
    eager, rows_e = _run(tmp_path, "eager", "cpu", config=config)
    assert traced and not any(traced)
    traced.clear()
    mode("compile")
    model, rows_c = _run(tmp_path, "compiled", "cpu", config=config)
    assert traced and all(traced), f"{name} ran compiled"
    return eager, rows_e, model, rows_c


def _same_vectors(tmp_path, runs, tol):
    """The MSVP power-iteration vectors checkpointed by two runs agree."""
    a, b = (torch.load(tmp_path / run / "last.pt", weights_only=True)["msvp"] for run in runs)
    assert a.keys() == b.keys() and a
    for k, v in a.items():
        torch.testing.assert_close(b[k], v, rtol=tol, atol=tol / 10)


def test_compiled_entropy_term_training_equals_eager(tmp_path, mode, monkeypatch):
    """The attention-entropy term with another margin: its forward pass and entropy compiled
    as one function (:func:`attncert.training.certified_training.entropy_forward`), eager's
    losses, accuracy and weights."""
    from attncert.training import certified_training as ct

    eager, rows_e, model, rows_c = _eager_then_compiled(tmp_path, mode, monkeypatch, ENTROPY,
                                                        ct, "entropy_forward")
    _same(eager, model, rows_e, rows_c, 1e-4)
    torch._dynamo.reset()


def test_compiled_msvp_training_equals_eager_and_resumes(tmp_path, mode, monkeypatch):
    """SpecFormer's MSVP penalty compiled as a graph of its own (its power step updating the
    vectors in place inside it: :func:`attncert.msvp.penalty`): eager's losses, accuracy,
    weights and power-iteration vectors, and the same resume."""
    from attncert.training import train as train_module

    eager, rows_e, model, rows_c = _eager_then_compiled(tmp_path, mode, monkeypatch, MSVP_CFG,
                                                        train_module, "penalty")
    _same(eager, model, rows_e, rows_c, 1e-4)
    _same_vectors(tmp_path, ("eager", "compiled"), 1e-4)
    resumed, rows_r = _interrupted_and_resumed(tmp_path, MSVP_CFG)
    _same(eager, resumed, rows_e, rows_r, 1e-4)
    _same_vectors(tmp_path, ("eager", "resumed"), 1e-4)
    torch._dynamo.reset()


def test_each_pass_of_adversarial_training_is_a_graph_step(monkeypatch):
    """Under graphs each of the attack's passes (clean, each step, the last iterate) and the
    training pass after them begins a CUDA-graph step, so a replay overwrites only outputs
    already read; the attack's passes differentiate the input only (the parameters' gradients
    off: a compiled backward would compute them too). Eager, no step is marked."""
    from attncert.training.compiled import input_gradients_only
    from attncert.training.train import step_loss

    marks = []
    monkeypatch.setattr(torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    model = fresh_model().train()
    trainable = []  # per forward pass: whether the parameters required gradients
    model.register_forward_pre_hook(
        lambda m, _: trainable.append(all(p.requires_grad for p in m.parameters())))
    data = toy_data(8, 0)
    x, y = data["x"].float() / 255, data["y"]
    passes = [False] * (ADV.adv_steps + 2) + [True]
    step_loss(model, x, y, ADV, generator=torch.Generator().manual_seed(0))
    assert marks == [] and trainable == passes
    trainable.clear()
    with compiled.compiled_forward(model, "graphs"):
        _, loss = step_loss(model, x, y, ADV, generator=torch.Generator().manual_seed(0))
        loss.backward()
    assert len(marks) == len(passes) and trainable == passes
    assert all(p.grad is not None for p in model.parameters())
    torch._dynamo.reset()
    model.head.weight.requires_grad_(False)  # a frozen parameter stays frozen
    with pytest.raises(RuntimeError, match="inside"):
        with input_gradients_only(model):
            assert not any(p.requires_grad for p in model.parameters())
            raise RuntimeError("inside")
    assert not model.head.weight.requires_grad
    assert all(p.requires_grad for n, p in model.named_parameters() if n != "head.weight")


def _text_models():
    from attncert.text.lofast import LipschitzTextTransformer, TextTransformerConfig
    from attncert.text.models import OLSAClassifier
    from attncert.text.standard import StandardTextTransformer

    torch.manual_seed(0)
    cfg = TextTransformerConfig(vocab_size=12, max_len=10, dim=8, depth=2, heads=2,
                                mlp_hidden=16, radius_attn=1.0, gamma_qk=1.0, gamma_vo=1.0)
    return {"olsa": OLSAClassifier(12, max_len=10, dim=8, depth=2, heads=2),
            "olsa-l2": OLSAClassifier(12, max_len=10, dim=8, depth=2, heads=2, attention="l2"),
            "lofast": LipschitzTextTransformer(cfg),
            "standard": StandardTextTransformer(12, 10, 8, 2, 2, 16)}


def _padded(longest, rows=6, width=10):
    """ids (rows, width) and a right-padded mask whose longest sentence has ``longest`` tokens."""
    g = torch.Generator().manual_seed(longest)
    lengths = torch.randint(1, longest + 1, (rows,), generator=g)
    lengths[0] = longest
    mask = torch.arange(width)[None] < lengths[:, None]
    return torch.randint(1, 12, (rows, width), generator=g).masked_fill(~mask, 0), mask


@pytest.mark.parametrize("kind", ["olsa", "olsa-l2", "lofast", "standard"])
def test_text_models_compile_whole_at_the_padded_length(kind, monkeypatch):
    """Eager text models drop the all-padding positions (a host sync on the longest length);
    compiled they keep the padded length: the same logits, one graph without a break, and no
    recompilation for batches whose longest sentence differs."""
    from torch._dynamo.utils import counters

    model = _text_models()[kind].double().eval()
    ids, mask = _padded(6)
    eager = model(ids, mask)
    with monkeypatch.context() as m:  # what the compiled forward computes, run eagerly
        m.setattr(torch.compiler, "is_compiling", lambda: True)
        assert torch.allclose(model(ids, mask), eager, rtol=1e-10, atol=1e-12)
    torch._dynamo.reset()
    counters.clear()
    traced = torch.compile(model, backend="eager", fullgraph=True)  # fullgraph: no break
    for longest in (6, 3, 9):
        ids, mask = _padded(longest)
        assert torch.allclose(traced(ids, mask), model(ids, mask), rtol=1e-10, atol=1e-12)
    assert counters["stats"]["unique_graphs"] == 1
    torch._dynamo.reset()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("kind", ["olsa", "olsa-l2", "lofast", "standard"])
def test_text_models_under_cuda_graphs_equal_eager(kind, mode):
    model = _text_models()[kind].cuda().train()
    with compiled.compiled_forward(model, "graphs"):
        for longest in (6, 3, 9):
            ids, mask = (t.cuda() for t in _padded(longest))
            compiled.step_begin("graphs", ids.device)
            got = model(ids, mask).detach().clone()
            want = type(model).forward(model, ids, mask)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()


def test_runs_that_cannot_be_captured_run_eager_under_graphs(mode, capsys):
    from attncert.text.models import OLSAClassifier

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    vit = fresh_model()
    assert compiled.graphs_blocker(_text_models()["olsa"]) is None  # captured since head_norm

    class Blocked(OLSAClassifier):  # a model that names why it cannot be captured
        cuda_graphs_blocker = "a host round trip"

    olsa = Blocked(12, max_len=10, dim=8, depth=2, heads=2)
    assert compiled.graphs_blocker(olsa) == "Blocked: a host round trip"
    assert compiled.graphs_blocker(vit) is None
    for m in ("graphs", "auto"):
        assert compiled.resolve(cuda, m, olsa) == "off"
        assert compiled.resolve(cuda, m, vit) == "graphs"
    assert "Blocked" in capsys.readouterr().out
    assert compiled.resolve(cpu, "graphs", olsa) == "compile"  # no graphs to capture there
    assert compiled.resolve(cuda, "compile", olsa) == "compile"


@pytest.mark.parametrize("kind", ["olsa", "olsa-l2"])
def test_olsa_training_forward_compiles_whole_with_its_batched_maps(kind):
    """The training forward (its orthogonal maps computed as one batch,
    :func:`attncert.text.orthogonal.orthogonal_weights`) compiles to one graph without a break,
    with eager's logits and gradients."""
    _compiles_whole(_text_models()[kind].double().train(), *_padded(6))


def _compiles_whole(model, *args) -> list:
    """``model(*args)`` compiled with ``fullgraph`` (a break fails) gives eager's output and
    gradients; returns the names of the parameters that got one."""
    eager = model(*args)
    eager.square().sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    torch._dynamo.reset()
    out = torch.compile(model, backend="eager", fullgraph=True)(*args)
    out.square().sum().backward()
    torch._dynamo.reset()
    torch.testing.assert_close(out, eager, rtol=1e-10, atol=1e-12)
    assert grads.keys() == {n for n, p in model.named_parameters() if p.grad is not None}
    for n, p in model.named_parameters():
        if n in grads:
            torch.testing.assert_close(p.grad, grads[n], rtol=1e-8, atol=1e-10)
    return list(grads)


def _frozen_head():
    """The OLSA head over a frozen encoder of width 12, through its map to 8 features (trained:
    singular values spread), on the encoder's cached states (floats) with a padded mask."""
    from attncert.cost.kinds import StandInEncoder
    from attncert.text.models import FrozenEncoderOLSA

    torch.manual_seed(0)
    model = FrozenEncoderOLSA(heads=2, max_len=10, encoder=StandInEncoder(12), hidden=8)
    with torch.no_grad():
        model.project_in.weight.mul_(torch.rand(8, 1) * 2 + 0.5)
    _, mask = _padded(6)
    return model, 2 * torch.nn.functional.normalize(torch.randn(6, 10, 12), dim=-1), mask


def test_the_frozen_head_s_training_forward_compiles_whole():
    """Its map's norm is a Schatten norm of matrix products (no SVD, no break): one graph,
    eager's logits and gradients."""
    model, states, mask = _frozen_head()
    assert "project_in.weight" in _compiles_whole(model.double().train(), states.double(), mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_the_frozen_head_under_cuda_graphs_equals_eager(mode):
    model, states, mask = _frozen_head()
    model = model.cuda().train()
    states, mask = states.cuda(), mask.cuda()
    with compiled.compiled_forward(model, "graphs"):
        for _ in range(3):
            compiled.step_begin("graphs", states.device)
            got = model(states, mask).detach().clone()
            want = type(model).forward(model, states, mask)
            assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)
    torch._dynamo.reset()
