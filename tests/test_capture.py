"""What a CUDA-graph capture of a training step cannot hold, checked on the CPU.

Under ``base.compile: graphs`` a training run's compiled forward and backward are captured as
CUDA graphs (:mod:`attncert.training.compiled`); a capture fails on a host synchronisation, on
a copy from the host to the device, and on the cuSOLVER / MAGMA solvers that read their status
on the host (an OLSA text model's capture failed on an H200 until its head normalised by a
closed form instead of an SVD). On a CPU none of these fails, so every model kind the bench
and the cost model time (:func:`attncert.cost.kinds.bench_models`) runs its training forward and
backward on the simulated device of ``tests/simdevice.py`` as the compiled graph computes it
(``torch.compiler.is_compiling()`` true), and the three counts must be zero exactly for the
kinds that train under graphs: a kind that names a ``cuda_graphs_blocker`` must be one that
fails here, so a fix shows and a new blocker is caught before a GPU sees it.
"""

import contextlib
import copy

import pytest
import torch
from simdevice import simulated_device

from attncert.cost.kinds import bench_models
from attncert.stages.registry import load_params
from attncert.text.orthogonal import SCHATTEN_LOG2_P, SpectralNormLinear, schatten_norm
from attncert.training import compiled


@pytest.fixture(scope="module")
def kinds(smoke):
    return bench_models(load_params(smoke))


def _capture_faults(model: torch.nn.Module, batch: tuple, monkeypatch, attack: bool = False
                    ) -> list[str]:
    """What a capture of the model's compiled training forward and backward would trip on
    (``attack``: a pass of PGD adversarial training's attack, the input's gradient only)."""
    from attncert.training.compiled import input_gradients_only

    with simulated_device() as sim:
        model = model.to(sim.device).train()
        args = [t.to(sim.device) for t in batch]
        sim.host_to_device = 0  # the model and batch moved over: from here on, none
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            if attack:
                x = args[0].requires_grad_(True)
                with input_gradients_only(model):
                    loss = torch.nn.functional.cross_entropy(model(x), args[-1])
                    torch.autograd.grad(loss, x)
            else:
                logits = model(*args[:-1])
                torch.nn.functional.cross_entropy(logits, args[-1]).backward()
    return ([f"{sim.host_syncs} host synchronisations"] * bool(sim.host_syncs)
            + [f"{sim.host_to_device} host-to-device copies"] * bool(sim.host_to_device)
            + sorted(set(sim.solvers)))


def test_the_training_forward_of_every_bench_kind_is_capturable(kinds, monkeypatch):
    for kind, (model, make_batch, _) in kinds.items():
        faults = _capture_faults(model, make_batch(2), monkeypatch)
        blocker = compiled.graphs_blocker(model)
        assert bool(faults) == bool(blocker), (kind, faults, blocker)
    assert len(kinds) == 7  # the frozen-encoder head among them


def test_the_attack_passes_of_adversarial_training_are_capturable(kinds, monkeypatch):
    from attncert.cost.bench import ADVERSARIAL_KINDS

    for kind in ADVERSARIAL_KINDS:
        model, make_batch, _ = kinds[kind]
        assert _capture_faults(model, make_batch(2), monkeypatch, attack=True) == [], kind


def test_the_l2_attention_olsa_model_is_capturable(monkeypatch):
    from attncert.text.models import OLSAClassifier

    torch.manual_seed(0)
    model = OLSAClassifier(12, max_len=10, dim=8, depth=2, heads=2, attention="l2")
    batch = (torch.randint(1, 12, (3, 10)), torch.ones(3, 10, dtype=torch.bool),
             torch.zeros(3, dtype=torch.long))
    assert _capture_faults(model, batch, monkeypatch) == []
    assert compiled.graphs_blocker(model) is None


@pytest.mark.parametrize("hidden", [None, 4])
def test_the_frozen_encoder_head_is_capturable(hidden, monkeypatch):
    """It trains on the encoder's states (floats); its map to a narrower head (OLSA sec. 5.1's
    hidden width) is a wide matrix normalised by its Schatten norm (matrix products, no SVD):
    compiled, the same logits from one graph, with or without the map, holding no solver."""
    import transformers

    from attncert.text.models import FrozenEncoderOLSA

    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(
        vocab_size=12, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=16, max_position_embeddings=16)).eval()
    model = FrozenEncoderOLSA(heads=2, encoder=bert, max_len=6, hidden=hidden)
    states = torch.randn(3, 6, 8)
    batch = (states, torch.ones(3, 6, dtype=torch.bool), torch.zeros(3, dtype=torch.long))
    assert _capture_faults(copy.deepcopy(model), batch, monkeypatch) == []
    assert compiled.graphs_blocker(model) is None
    graphs = []

    def backend(gm, inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    model.eval()
    want = model(states, batch[1])
    got = torch.compile(model, backend=backend)(states, batch[1])
    torch._dynamo.reset()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    assert len(graphs) == 1, graphs  # no break: nothing runs between graphs
    assert not any("linalg" in op or "svd" in op for g in graphs for op in g), graphs


def test_the_simulated_device_sees_what_a_capture_cannot_hold(monkeypatch):
    """The check itself fails on each fault: an SVD, a copy from the host, a sync."""
    w = torch.randn(3, 4)

    class Faulty(torch.nn.Module):
        def __init__(self, fault):
            super().__init__()
            self.w, self.fault = torch.nn.Parameter(w.clone()), fault

        def forward(self, x):
            y = x @ self.w.T
            if self.fault == "svd":
                return y / torch.linalg.matrix_norm(self.w, 2)
            if self.fault == "copy":
                return y * torch.tensor([1.0, 2.0, 3.0]).to(x.device)
            if self.fault == "sync":
                return y * float(y.detach().abs().max())
            return y

    batch = (torch.randn(5, 4), torch.zeros(5, dtype=torch.long))
    assert _capture_faults(Faulty(None), batch, monkeypatch) == []
    assert _capture_faults(Faulty("svd"), batch, monkeypatch) == ["aten::_linalg_svd"]
    assert _capture_faults(Faulty("copy"), batch, monkeypatch) == ["1 host-to-device copies"]
    assert _capture_faults(Faulty("sync"), batch, monkeypatch) == ["1 host synchronisations"]


@pytest.mark.parametrize("shape", [(2, 16), (1, 16), (2, 1), (5, 7), (7, 5)])
def test_the_spectrally_normalised_head_is_unit_or_below(shape):
    """W / ||W||_2 by the closed form of a 2 x 2 Gram matrix (up to two rows: exact) or by the
    Schatten norm of order 2^14 (more: at most 1, at least rank^(-1/p)): the applied head
    keeps W's direction, and its gradient is finite at orthonormal rows (repeated singular
    values, where the closed form's square root is 0)."""
    torch.manual_seed(0)
    head = SpectralNormLinear(shape[1], shape[0]).double()
    floor = 1.0 if shape[0] <= 2 else min(shape) ** (-1 / 2 ** SCHATTEN_LOG2_P)
    for w in (head.weight.detach().clone(), torch.randn(shape, dtype=torch.float64)):
        with torch.no_grad():
            head.weight.copy_(w)
        eff = head.weight_effective()
        norm = torch.linalg.matrix_norm(eff, 2).item()
        assert floor - 1e-12 <= norm <= 1 + 1e-12, (norm, floor)
        assert torch.allclose(eff * torch.linalg.matrix_norm(w, 2) / norm, w, atol=1e-12)
        head.weight.grad = None
        eff.sum().backward()
        assert torch.isfinite(head.weight.grad).all()


@pytest.mark.parametrize("shape", [(3, 5), (6, 4), (256, 768)])
def test_the_schatten_norm_is_the_svd_s_and_bounds_the_spectral_norm(shape):
    """(sum s_i^p)^(1/p) from the singular values, at orders 2 to 2^14; never below the
    largest singular value (up to rounding), at most rank^(1/p) above it (reached by equal
    singular values, the semi-orthogonal start); float32 at least, outside autocast."""
    torch.manual_seed(0)
    w = torch.randn(shape, dtype=torch.float64)
    s = torch.linalg.svdvals(w)
    for log2_p in (1, 2, 3, 5, 9, SCHATTEN_LOG2_P):
        p = 2 ** log2_p
        want = s[0] * ((s / s[0]) ** p).sum() ** (1 / p)
        assert schatten_norm(w, log2_p).item() == pytest.approx(want.item(), rel=1e-12)
    got = schatten_norm(w).item()
    assert s[0].item() * (1 - 1e-12) <= got <= s[0].item() * min(shape) ** (1 / 2 ** 14)
    flat = torch.nn.init.orthogonal_(torch.empty(shape, dtype=torch.float64))
    assert schatten_norm(flat).item() == pytest.approx(min(shape) ** (1 / 2 ** 14), rel=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = schatten_norm(w.float())
    assert low.dtype == torch.float32 and low.item() == pytest.approx(got, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        schatten_norm(w, 0)


def test_the_closed_form_gradient_matches_the_svd():
    torch.manual_seed(1)
    w = torch.randn(2, 9, dtype=torch.float64, requires_grad=True)
    head = SpectralNormLinear(9, 2).double()
    with torch.no_grad():
        head.weight.copy_(w)
    x = torch.randn(4, 9, dtype=torch.float64)
    head(x).square().sum().backward()
    (torch.nn.functional.linear(x, w / torch.linalg.matrix_norm(w, 2))
     .square().sum().backward())
    assert torch.allclose(head.weight.grad, w.grad, rtol=1e-9, atol=1e-12)


def _images(model, n=3):
    c = model.config
    return (torch.rand(n, c.channels, c.image_size, c.image_size),
            torch.zeros(n, dtype=torch.long))


LIPSCHITZ = {"kind": "lipschitz", "attn_bias": False, "block": "stream", "pool": "mean"}


@pytest.mark.parametrize("variant", [
    LIPSCHITZ, {**LIPSCHITZ, "qk_tied": True}, {**LIPSCHITZ, "attn_orthogonal": True},
    *({"attention": a} for a in ("dot", "l2", "lnformer", "cosine"))])
def test_every_vit_variant_is_capturable(variant, monkeypatch):
    """The Lipschitz ViT with its attention options (the frontier's axes) and the standard
    ViT with every attention variant (SpecFormer's and the frontier's baselines)."""
    from helpers import tiny_vit

    model = tiny_vit(**variant)
    assert _capture_faults(model, _images(model), monkeypatch) == []


@pytest.mark.parametrize("norm", ["project", "center"])
def test_certvit_s_adapted_vit_is_capturable(norm, monkeypatch):
    """CertViT's fine-tunes train the adapted model: L2 attention, Lipschitz norms."""
    from helpers import tiny_vit

    from attncert.certvit.adapt import Adaptation, adapt

    model = adapt(tiny_vit(kind="standard", block="prenorm", pool="cls"), Adaptation(norm=norm))
    assert _capture_faults(model, _images(model), monkeypatch) == []


@pytest.mark.parametrize("variant", [LIPSCHITZ, {**LIPSCHITZ, "attn_orthogonal": True}])
def test_the_lofast_margin_s_whole_loss_is_capturable_and_one_graph(variant, monkeypatch):
    """The ``lofast`` margin's whole training loss, what runs before its compiled part (the
    components' structure, the radius) and that part (forward pass, the constants on the
    device, the surrogate bound's Schatten norms, the entropy term) with its backward, and a
    radius-0 step's (the forward pass and the entropy term), hold no sync, copy or solver
    once the model and the batch are on the device; the compiled part is one graph without a
    solver, with eager's value."""
    from helpers import tiny_vit

    from attncert.training.certified_training import lofast_loss, margin_loss

    model = tiny_vit(**variant)
    x, y = _images(model, 4)
    with simulated_device() as sim:
        on_sim = copy.deepcopy(model).to(sim.device).train()
        xs, ys = x.to(sim.device), y.to(sim.device)
        sim.host_to_device, sim.host_syncs, sim.solvers = 0, 0, []
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            # the simulated device has no autocast module; the loss only switches it off
            m.setattr(torch, "autocast", lambda *a, **k: contextlib.nullcontext())
            _, loss = lofast_loss(on_sim, xs, ys, 0.1, 5.0, 0.5, 1.0, 0.1)
            loss.backward()
            # radius 0 with the entropy term: the forward pass and entropy only
            lofast_loss(on_sim, xs, ys, 0.0, 5.0, 0.5, 1.0, 0.1)[1].backward()
        assert (sim.host_syncs, sim.host_to_device, sim.solvers) == (0, 0, [])
    args = (x, y, torch.tensor(0.1, dtype=torch.float64), model.train().components(exact=False),
            5.0, 0.5, 1.0, 0.1)
    graphs = []

    def backend(gm, inputs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    torch._dynamo.reset()
    want = margin_loss(model, *args)[1]
    got = torch.compile(margin_loss, backend=backend)(model, *args)[1]
    torch._dynamo.reset()
    torch.testing.assert_close(got, want)
    assert len(graphs) == 1, len(graphs)
    solvers = ("svd", "eig", "qr", "cholesky", "solve", "lstsq", "inv")  # matrix_exp is products
    assert not any(k in op for g in graphs for op in g for k in solvers)


@pytest.mark.parametrize("variant", [{"kind": "standard"}, LIPSCHITZ])
def test_the_msvp_penalty_is_capturable_and_one_graph(variant, monkeypatch):
    """SpecFormer's MSVP penalty, its power step updating the vectors in place and the
    penalty's backward, holds no sync, copy or solver on the device, and compiles to one graph
    that the vectors' change from step to step does not recompile, with eager's values."""
    from helpers import tiny_vit

    from attncert.msvp import MSVP, penalty

    model = tiny_vit(**variant).train()
    with simulated_device() as sim:
        on_sim = copy.deepcopy(model).to(sim.device).train()
        msvp = MSVP(on_sim, 0.1, 0.1, 0.1).to(sim.device).train()
        sim.host_to_device, sim.host_syncs, sim.solvers = 0, 0, []
        with monkeypatch.context() as m:
            m.setattr(torch.compiler, "is_compiling", lambda: True)
            for _ in range(2):
                penalty(on_sim, msvp).backward()
        assert (sim.host_syncs, sim.host_to_device, sim.solvers) == (0, 0, [])
    msvp = MSVP(model, 0.1, 0.1, 0.1).train()
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled_penalty = torch.compile(penalty, backend=backend)
    eager = copy.deepcopy(msvp)
    for _ in range(3):
        torch.testing.assert_close(compiled_penalty(model, msvp), penalty(model, eager))
    torch._dynamo.reset()
    assert len(graphs) == 1, len(graphs)
    for (k, v), w in zip(msvp.state_dict().items(), eager.state_dict().values(), strict=True):
        torch.testing.assert_close(v, w, msg=k)
