"""Compiled training forward passes (``base.compile``): kernel fusion by ``torch.compile`` and,
on CUDA, CUDA graphs that replay a step's kernels without paying a launch for each.

The models of this study are small (a few hundred dimensions, a few to a few hundred tokens),
so an eager training step is thousands of short kernels and the GPU waits on their launches.
Measured on one H200 (docs/gpus.md, 2026-11-28, batch 128, bf16): the grid's Lipschitz ViT
45-53 ms a step eager, 19 ms compiled, 4 ms compiled with CUDA graphs.

:func:`compiled_forward` compiles ``model.forward`` for the duration of a training run only
(the training loop, :func:`attncert.training.loop.run_epochs`, enters it): the module, its
parameters and its state dict are untouched, so checkpoints are the same as eager ones, and
after the run the model is eager again: certificates, PGD audits and the attention
diagnostics always run the eager model (float64 certificates are never compiled). A loss term
outside ``forward`` is compiled where it asks (:func:`compiled_loss`): whole with the forward
pass it runs itself (the ``lofast`` margin, its bound by matrix products only, and the
attention-entropy term), or as a graph of its own (SpecFormer's MSVP penalty,
:func:`attncert.msvp.penalty`); the other terms (the LMT and OLSA margins) stay eager.

Modes (:data:`MODES`): ``off`` (eager: the reference), ``compile`` (``torch.compile``'s default
mode), ``graphs`` (mode ``reduce-overhead``: CUDA graphs on CUDA; on a CPU the same as
``compile``), ``auto`` (``graphs`` on CUDA, ``off`` elsewhere: on a 2-core CPU the compile time
of each of the study's many small models outweighs what it saves). A model that cannot be
captured (:func:`graphs_blocker`: none does now) trains eager where ``graphs`` was asked for.
PGD adversarial training runs several forward passes a step: its attack calls the model through
:func:`each_call_a_step` and the training pass follows :func:`new_step`, so every pass replays
its own graph step. The stage runner applies
``base.compile`` with :func:`set_mode` (:func:`attncert.pipeline.runtime.configure`); it is a
runtime key (``BASE_RUNTIME``): changing it reruns nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from attncert.pipeline import runtime

__all__ = ["MODES", "compile_attack_model", "compiled_forward", "compiled_loss",
           "each_call_a_step", "graphs_blocker", "input_gradients_only", "new_step", "resolve",
           "set_mode", "step_begin", "uncompile"]

#: ``base.compile`` values -> ``torch.compile``'s mode (None: eager)
MODES = {"off": None, "compile": "default", "graphs": "reduce-overhead", "auto": None}
if tuple(MODES) != runtime.COMPILE_MODES:  # a bug: keep the two lists one
    raise RuntimeError(f"compile modes differ: {tuple(MODES)} vs {runtime.COMPILE_MODES}")


def set_mode(mode: str) -> None:
    """The process's compile mode (``base.compile``, held by
    :func:`attncert.pipeline.runtime.set_compile_mode`), used by every later training run."""
    runtime.set_compile_mode(mode)


def graphs_blocker(model: nn.Module | None = None) -> str | None:
    """Why a training run of ``model`` cannot replay CUDA graphs, or None.

    A model says so with a ``cuda_graphs_blocker`` attribute (none does: the OLSA models'
    capture failed on an H200 on 2026-11-28 on an SVD in the forward pass, now a closed form or
    a Schatten norm of matrix products, :func:`attncert.text.orthogonal.head_norm`;
    ``tests/test_capture.py`` checks every kind). No training recipe blocks it: PGD
    adversarial training's passes are graph steps of their own (:func:`each_call_a_step`)."""
    reason = getattr(model, "cuda_graphs_blocker", None)
    if reason:
        return f"{type(model).__name__}: {reason}"
    return None


def resolve(dev: torch.device, mode: str | None = None, model: nn.Module | None = None) -> str:
    """``mode`` (default: the process's) for a run on ``dev``: ``auto`` becomes ``graphs`` on
    CUDA and ``off`` elsewhere; ``graphs`` on a device without CUDA graphs is ``compile``;
    ``graphs`` for a model that cannot be captured (:func:`graphs_blocker`) is ``off``, eager,
    named on the console."""
    mode = runtime.compile_mode() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"compile mode {mode!r}; one of {', '.join(MODES)}")
    if mode == "auto":
        mode = "graphs" if dev.type == "cuda" else "off"
    if mode == "graphs" and dev.type != "cuda":
        return "compile"
    if mode == "graphs" and (why := graphs_blocker(model)):
        print(f"base.compile: eager, not CUDA graphs, for this run: {why}", flush=True)
        return "off"
    return mode


#: set on a model while :func:`compiled_forward` holds it: whether its forward replays graphs
_GRAPHS = "_attncert_graphs"
#: set on a model while :func:`compiled_forward` holds it: (mode, {function: its compiled form})
_LOSSES = "_attncert_compiled_losses"


@contextlib.contextmanager
def compiled_forward(model: nn.Module, mode: str) -> Iterator[None]:
    """Within the block ``model(...)`` runs ``model.forward`` compiled in ``mode`` (a resolved
    mode, :func:`resolve`), and so does a loss :func:`compiled_loss` names; afterwards the
    model is eager again. ``off``: nothing changes."""
    if mode == "off":
        yield
        return
    if "forward" in vars(model):
        raise ValueError(f"{type(model).__name__}.forward is already replaced on the instance")
    model.forward = torch.compile(model.forward, mode=MODES[mode])
    setattr(model, _GRAPHS, mode == "graphs")
    setattr(model, _LOSSES, (mode, {}))
    try:
        yield
    finally:
        del model.forward
        delattr(model, _GRAPHS)
        delattr(model, _LOSSES)


def compiled_loss(model: nn.Module, fn: Callable) -> Callable:
    """``fn``, a training loss term whose first argument is ``model`` (the ``lofast`` margin's
    and the attention entropy's, which run the forward pass themselves for the attention
    layers' inputs; MSVP's penalty, which reads the weights only), compiled as the forward pass
    is while :func:`compiled_forward` holds ``model`` (one compiled form per function and run:
    its forward, terms and backward one graph); otherwise ``fn``.
    Its tensors are inputs of the graph, its other arguments constants: what changes from step
    to step must come as a tensor."""
    held = getattr(model, _LOSSES, None)
    if held is None:
        return fn
    mode, cache = held
    if fn not in cache:
        cache[fn] = torch.compile(fn, mode=MODES[mode])
    return cache[fn]


def new_step(model: nn.Module) -> None:
    """Mark a new CUDA-graph step when ``model``'s forward replays graphs
    (:func:`compiled_forward` in ``graphs``): the outputs of its earlier replays may be
    overwritten from here on. Otherwise nothing."""
    if getattr(model, _GRAPHS, False):
        torch.compiler.cudagraph_mark_step_begin()


def each_call_a_step(model: nn.Module) -> Callable:
    """``model`` as a function whose every call is a new CUDA-graph step (:func:`new_step`):
    for a loop of forward passes, each of whose outputs (and input gradients) is read before
    the next call, such as PGD's steps inside adversarial training. A model that does not
    replay graphs is returned as it is."""
    if not getattr(model, _GRAPHS, False):
        return model

    def call(*args, **kwargs):
        new_step(model)
        return model(*args, **kwargs)

    return call


def step_begin(mode: str, dev: torch.device) -> None:
    """Before a training step's forward pass under CUDA graphs: the outputs of the previous
    step's replay may be overwritten from here on (each step reads its own outputs only)."""
    if mode == "graphs" and dev.type == "cuda":
        torch.compiler.cudagraph_mark_step_begin()


_ATTACK = "_attncert_compiled_attack"


def compile_attack_model(model: nn.Module, dev: torch.device, mode: str | None = None) -> str:
    """Compile the forward pass of ``model``, a throwaway float32 copy an attack runs on
    (:func:`attncert.attacks.attack_copy`), in ``mode`` (default: the process's
    ``base.compile``) resolved for ``dev`` (:func:`resolve`: ``auto`` is CUDA graphs on CUDA,
    eager on a CPU). Each call marks a new CUDA-graph step, so a replay may overwrite the
    previous call's outputs: an attack reads each step's logits and input gradient before its
    next forward pass. Returns the resolved mode; :func:`uncompile` undoes it. Certificates
    never run compiled: an attack only proposes candidates, each confirmed on the certified
    float64 model (:func:`attncert.attacks.confirm_l2`)."""
    how = resolve(dev, mode, model)
    if how == "off":
        return how
    if "forward" in vars(model):
        raise ValueError(f"{type(model).__name__}.forward is already replaced on the instance")
    fn = torch.compile(model.forward, mode=MODES[how])

    def forward(*args, **kwargs):
        step_begin(how, dev)
        return fn(*args, **kwargs)

    model.forward = forward
    setattr(model, _ATTACK, how)
    return how


def uncompile(model: nn.Module) -> bool:
    """Undo :func:`compile_attack_model` (the model eager again); False when it was not."""
    if getattr(model, _ATTACK, None) is None:
        return False
    del model.forward
    delattr(model, _ATTACK)
    return True


@contextlib.contextmanager
def input_gradients_only(model: nn.Module) -> Iterator[None]:
    """Within the block no parameter of ``model`` requires a gradient (each one's flag is
    restored afterwards): an attack's backward passes then compute the input's gradient alone,
    compiled as eager (a compiled backward would otherwise compute every weight's gradient
    too). The values of every pass are unchanged."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
