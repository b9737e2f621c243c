"""Counting one call's matrix-product FLOPs and GPU kernels (FLOPs fitted as a + b * batch from
batch 1 and 2) of the project's models built at a params file's shapes, and the GPUs' peaks.
The shapes come from elsewhere: the datasets' (:mod:`attncert.pipeline.datasets`), the hub
ViTs' (:data:`attncert.models.config.HF_VITS`), the frozen encoders'
(:data:`attncert.text.tokenize.ENCODERS`)."""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

from attncert.pipeline.datasets import TABLE

#: public dataset facts (:data:`attncert.pipeline.datasets.TABLE`): (channels, image size, classes,
#: training images, test images) per image dataset
DATASETS = {n: (d.channels, d.size, d.classes, d.splits["train"], d.splits["test"])
            for n, d in TABLE.items() if d.kind == "image"}
#: the text stage's datasets: labelled examples per split
TEXT_SIZES = {n: dict(d.splits) for n, d in TABLE.items() if d.kind == "text"}
SST2 = TEXT_SIZES["sst2"]


@dataclass(frozen=True)
class GPU:
    """Dense peak FLOP/s per precision (vendor data sheet, without sparsity), and the seconds
    per kernel launch (:data:`KERNEL_SECONDS`, or measured: :func:`calibrated`)."""

    name: str
    bf16: float
    tf32: float
    fp32: float
    fp64: float
    kernel_seconds: float = 8e-6
    calibration: str = ""  # where kernel_seconds was measured ("" = the default constant)
    #: ((stage, seconds per kernel), ...): the constant measured on the model kind a stage
    #: trains (:func:`attncert.cost.calibrate.calibrated`); other stages use kernel_seconds
    kernel_seconds_by_stage: tuple[tuple[str, float], ...] = ()
    #: ((bench model kind, seconds per kernel), ...): each measured kind's own constant, which
    #: the work on a model of that kind takes before its stage's
    kernel_seconds_by_kind: tuple[tuple[str, float], ...] = ()
    #: ((training step kind, eager / CUDA-graph step time), ...): counted when the params
    #: train under CUDA graphs (:func:`attncert.cost.graphs.with_graphs`); empty: eager
    graphs_speedup: tuple[tuple[str, float], ...] = ()
    graphs_source: str = ""  # where the speed-ups were measured
    #: ((stage, measured / estimated), ...): the pilot's calibration of each stage's work
    #: (:func:`attncert.cost.graphs.with_pilot`); a stage without one: 1
    pilot_by_stage: tuple[tuple[str, float], ...] = ()
    pilot_source: str = ""

    def kernel_seconds_for(self, stage: str, kind: str = "") -> float:
        """Seconds per kernel of ``stage``'s work on a model of bench ``kind`` ("": none): the
        kind's measured constant, else the stage's, else :attr:`kernel_seconds`."""
        by_kind = dict(self.kernel_seconds_by_kind)
        if kind in by_kind:
            return by_kind[kind]
        return dict(self.kernel_seconds_by_stage).get(stage, self.kernel_seconds)

    def graphs_speedup_for(self, key: str) -> float:
        """How much faster a training step of kind ``key`` runs replayed as CUDA graphs (1:
        eager, unmeasured, or no key)."""
        return dict(self.graphs_speedup).get(key, 1.0) if key else 1.0


GPUS = {
    "h100": GPU("NVIDIA H100 SXM", bf16=989e12, tf32=495e12, fp32=67e12, fp64=67e12),
    "a100": GPU("NVIDIA A100 SXM", bf16=312e12, tf32=156e12, fp32=19.5e12, fp64=19.5e12),
}
#: seconds per GPU kernel (launch and dispatch of eager PyTorch): the floor of a small step;
#: a GPU self-check measures it (``make gpu-check``: :func:`calibrated`)
KERNEL_SECONDS = GPU.__dataclass_fields__["kernel_seconds"].default
UTILISATION = 0.3


# -- counting ----------------------------------------------------------------------------------


#: the version of the kernel count: 2 counts an optimiser step as the runs take it on CUDA,
#: fused (:func:`counted_optimizer`, :func:`multi_tensor_launches`), a step of a run (not its
#: first, which creates the optimiser's state), and no profiler marks or attention-backend
#: choice as kernels; 1 counted the loop over the parameters that a CPU runs, a set of kernels
#: per parameter, at a run's first step. A GPU calibration divides a measured step time by the
#: count, so it holds for the version it was counted with (:func:`attncert.cost.calibrate.
#: calibrated`); ``version=1`` reproduces the old count (:func:`attncert.cost.calibrate.recount`).
COUNTING = 2
#: CUDA's multi-tensor apply (``_foreach_*`` and ``_fused_*`` ops): elements per chunk (a
#: block), and per launch at most this many tensors (depth 5, the fewest of any depth) and
#: blocks, with the large kernel arguments of CUDA 12.1 or later
MULTI_TENSOR = {"chunk": 65536, "tensors": 210, "blocks": 2240}


def multi_tensor_launches(tensors: list[Tensor]) -> int:
    """The kernels one multi-tensor op over ``tensors`` launches on CUDA: CUDA's loop, which
    fills a launch with the chunks of one tensor after another (empty tensors skipped) and
    launches when it holds :data:`MULTI_TENSOR`'s most tensors (at a tensor's last chunk) or
    blocks, or at the last chunk of all (at the fewest tensors a launch of any depth holds,
    so no fewer than CUDA makes)."""
    sizes = [t.numel() for t in tensors if t.numel()]
    launches = held = blocks = 0
    for i, n in enumerate(sizes):
        chunks = -(-n // MULTI_TENSOR["chunk"])
        held += 1
        for c in range(chunks):
            blocks += 1
            end = c == chunks - 1
            if ((held == MULTI_TENSOR["tensors"] and end) or blocks == MULTI_TENSOR["blocks"]
                    or (end and i == len(sizes) - 1)):
                launches += 1
                blocks, held = 0, (0 if end else 1)
    return launches


def counted_optimizer(params, lr: float = 1e-4, version: int = COUNTING
                      ) -> torch.optim.Optimizer:
    """AdamW as the runs step it on CUDA: fused, one multi-tensor kernel for all parameters
    (:func:`attncert.training.loop.fused_on_cuda`; on the CPU the runs loop over them);
    ``version=1``: torch's default on the CPU, the loop the first count took."""
    return torch.optim.AdamW(params, lr=lr, **({"fused": True} if version >= 2 else {}))


class _KernelCounter(TorchDispatchMode):
    """Counts the aten calls that launch work (views and metadata-only calls excluded); a
    multi-tensor call as the kernels it launches on CUDA (:func:`multi_tensor_launches`);
    ``version``: :data:`COUNTING`'s."""

    SKIP = {"detach", "view", "_unsafe_view", "t", "expand", "permute", "transpose",
            "unsqueeze", "squeeze", "slice", "select", "alias", "lift_fresh", "reshape",
            "as_strided", "unbind", "split", "split_with_sizes", "chunk", "narrow", "empty",
            "empty_like", "empty_strided", "_to_copy_noop", "size", "stride"}
    #: skipped since version 2: a profiler's marks and the choice of an attention kernel
    SKIP_2 = {"_record_function_enter_new", "_record_function_exit", "_fused_sdp_choice"}

    def __init__(self, version: int = COUNTING, peak: bool = False):
        super().__init__()
        self.track = peak  # the peak of the bytes held (:meth:`_hold`): ~20% slower
        if version not in (1, COUNTING):
            raise ValueError(f"kernel count version {version}: this code counts 1 or "
                             f"{COUNTING}")
        self.version = version
        self.skip = self.SKIP | (self.SKIP_2 if version >= 2 else set())
        self.kernels = 0
        self.bytes = 0  # the bytes of every counted call's tensor outputs
        self.live = self.peak = 0  # bytes of the storages the calls' tensors hold, live / most
        self._refs: dict[int, int] = {}  # per storage: the tensors seen on it still alive
        self._sizes: dict[int, int] = {}
        self._held: dict[int, int] = {}  # id of a tensor seen -> its storage

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves((out, args, kwargs)) if self.track else ():
            if isinstance(t, Tensor):
                self._hold(t)
        name = func.overloadpacket.__name__
        if name in self.skip or getattr(func, "is_view", False):
            return out
        lists = [a for a in args if isinstance(a, (list, tuple)) and a
                 and isinstance(a[0], Tensor)]
        multi = self.version >= 2 and name.startswith(("_foreach_", "_fused_")) and lists
        self.kernels += multi_tensor_launches(lists[0]) if multi else 1
        self.bytes += sum(t.numel() * t.element_size() for t in tree_leaves(out)
                          if isinstance(t, Tensor))
        return out

    def _hold(self, t: Tensor) -> None:
        """Count ``t``'s storage as live until the last tensor seen on it is freed: every op's
        inputs and outputs (views, in-place results, allocations such as ``empty``), so the
        peak holds the call's inputs and everything it allocates."""
        if id(t) in self._held:
            return
        try:
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):  # no storage (meta, fake or sparse tensors)
            return
        if not size or t.device.type == "meta":
            return
        if key not in self._refs:
            self._refs[key], self._sizes[key] = 0, size
            self.live += size
            self.peak = max(self.peak, self.live)
        self._refs[key] += 1
        self._held[id(t)] = key
        weakref.finalize(t, self._release, id(t))

    def _release(self, ident: int) -> None:
        key = self._held.pop(ident)
        self._refs[key] -= 1
        if not self._refs[key]:
            del self._refs[key]
            self.live -= self._sizes.pop(key)


@dataclass(frozen=True)
class Counts:
    """FLOPs of one call = per_call + per_sample * batch; kernels of one call;
    ``bytes_per_sample``: what one more sample adds to the memory's peak, at most (:func:`fit`:
    to the bytes the call's operations output, every allocation the call makes;
    :func:`layer_certificate_counts`: from the most bytes its tensors hold at once)."""

    per_call: float
    per_sample: float
    kernels: float
    bytes_per_sample: float = 0.0

    def flops(self, batch: int) -> float:
        return self.per_call + self.per_sample * batch


def count(fn: Callable[[], Any], version: int = COUNTING) -> tuple[float, int]:
    """(matmul FLOPs, kernels) of one call of ``fn`` (on the CPU; ``version``: the count's,
    :data:`COUNTING`)."""
    f, k, *_ = count_call(fn, version)
    return f, k


#: FLOP formulas torch's counter lacks: the CPU's fused attention (the one the count runs)
#: counted as torch counts the CUDA kernels that replace it there
FLOP_FORMULAS = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu:
        lambda q, k, v, *_, out_shape=None, **__: sdpa_flop_count(q, k, v),
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        lambda g, q, k, v, *_, out_shape=None, **__: sdpa_backward_flop_count(g, q, k, v),
}


def count_call(fn: Callable[[], Any], version: int = COUNTING, peak: bool = False
               ) -> tuple[float, int, int, int]:
    """(matmul FLOPs, kernels, bytes output by the kernels, with ``peak`` the most bytes its
    tensors held at once, else 0) of one call of ``fn``."""
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as flops, \
            _KernelCounter(version, peak) as kernels:
        fn()
    return float(flops.get_total_flops()), kernels.kernels, kernels.bytes, kernels.peak


def fit(make: Callable[[int], Callable[[], Any]]) -> Counts:
    """:class:`Counts` from calls at batch 1 and 2 (``make(b)`` returns the call)."""
    f1, k1, b1, _ = count_call(make(1))
    f2, _, b2, _ = count_call(make(2))
    return Counts(max(2 * f1 - f2, 0.0), max(f2 - f1, 0.0), k1, float(max(b2 - b1, 0)))


# -- the models at the params' shapes ------------------------------------------------------


def random_images(cfg, b: int, dtype=torch.float32) -> tuple[Tensor, Tensor]:
    x = torch.rand(b, cfg.channels, cfg.image_size, cfg.image_size, dtype=dtype)
    return x, torch.zeros(b, dtype=torch.long)


def train_step(model: nn.Module, batch: Callable[[int], tuple], loss_fn=None, msvp=None,
               after: Callable[[], None] | None = None, version: int = COUNTING
               ) -> Callable[[int], Callable[[], None]]:
    """make(b): one training step (forward, loss, backward, AdamW, then ``after()``: the
    step's work after the optimiser, such as OLSA's re-projection) at batch b; a step of a
    run, not its first (:func:`_warmed`); ``version=1``: as the first count took it (the CPU's
    optimiser, a run's first step)."""
    opt = counted_optimizer([p for p in model.parameters() if p.requires_grad],
                            version=version)
    loss_fn = loss_fn or (lambda out, y: nn.functional.cross_entropy(out, y))

    def make(b):
        args = batch(b)

        def step():
            model.train()
            loss = loss_fn(model(*args[:-1]), args[-1])
            if msvp is not None:
                loss = loss + msvp()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after is not None:
                after()
        return _warmed(step, opt) if version >= 2 else step
    return make


def _warmed(step: Callable[[], None], opt: torch.optim.Optimizer) -> Callable[[], None]:
    """``step`` after one uncounted call when ``opt`` has no state yet: the first step of a
    run creates the optimiser's state (kernels per parameter, once a run, not each step)."""
    if not opt.state:
        step()
    return step


def forward(model: nn.Module, batch: Callable[[int], tuple]) -> Callable[[int], Callable]:
    def make(b):
        args = batch(b)
        return lambda: model.eval()(*args[:-1])
    return make


def attack_step(model: nn.Module, batch: Callable[[int], tuple]) -> Callable[[int], Callable]:
    """make(b): one PGD step (forward and the gradient with respect to the input)."""
    def make(b):
        args = batch(b)

        def step():
            params = [q for q in model.parameters() if q.requires_grad]
            for q in params:  # the input's gradient only, as an attack takes it
                q.requires_grad_(False)
            try:
                x = args[0].clone().requires_grad_(True)
                model.eval()(x, *args[1:-1]).sum().backward()
            finally:
                for q in params:
                    q.requires_grad_(True)
        return step
    return make


def _vit_counts(cfg, train: bool = True, dtype=torch.float32, msvp_lambda=None,
                margin: str = "none"):
    from attncert.models import build_vit
    from attncert.msvp import MSVP

    torch.manual_seed(0)
    model = build_vit(cfg).to(dtype)
    batch = functools.partial(random_images, cfg, dtype=dtype)
    out = {"forward": fit(forward(model, batch)), "attack": fit(attack_step(model, batch))}
    if train:
        msvp = MSVP(model, *msvp_lambda) if msvp_lambda and any(msvp_lambda) else None
        out["train"] = fit(lofast_train_step(model, batch) if margin == "lofast"
                           else train_step(model, batch, msvp=msvp))
    return out


def lofast_train_step(model: nn.Module, batch: Callable[[int], tuple]
                      ) -> Callable[[int], Callable[[], None]]:
    """make(b): one training step with the ``lofast`` margin (the bound's norms and their
    backward pass included: :func:`attncert.training.certified_training.lofast_loss`)."""
    from attncert.training.certified_training import lofast_loss

    opt = counted_optimizer(model.parameters())

    def make(b):
        x, y = batch(b)

        def step():
            model.train()
            _, loss = lofast_loss(model, x, y, eps=0.1, scale=1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        return _warmed(step, opt)
    return make


def vit_counts(cfg, msvp: tuple[float, ...] | None = None, margin: str = "none"
               ) -> dict[str, Counts]:
    """Train step (with the training ``margin``: only "lofast" changes the counts), forward
    and attack step of a ViT config (cached per shape: a norm bound such as gamma_vo changes
    no FLOP, nor do the MSVP penalty's weights, only whether it runs)."""
    on = tuple(1.0 for _ in msvp) if msvp and any(msvp) else None
    return _vit_counts_cached(dataclasses.replace(cfg, gamma_vo=1.0), on,
                              "lofast" if margin == "lofast" else "none")


@functools.cache
def _vit_counts_cached(cfg, msvp, margin):
    return _vit_counts(cfg, msvp_lambda=msvp, margin=margin)


@functools.cache
def pixel_linear_counts(channels: int, size: int, classes: int) -> dict[str, Counts]:
    """Train step, forward and attack step of the linear baseline on pixels
    (:class:`attncert.certvit.baseline.PixelLinear`: the frontier's ``linear`` setting)."""
    from types import SimpleNamespace

    from attncert.certvit.baseline import PixelLinear

    model = PixelLinear(channels * size * size, classes)
    batch = functools.partial(random_images, SimpleNamespace(channels=channels,
                                                             image_size=size))
    return {"train": fit(train_step(model, batch)), "forward": fit(forward(model, batch)),
            "attack": fit(attack_step(model, batch))}


def vit_forward64(cfg) -> Counts:
    """A float64 forward pass (the certificates' precision) of a ViT config (cached)."""
    return _forward64_cached(dataclasses.replace(cfg, gamma_vo=1.0))


@functools.cache
def _forward64_cached(cfg) -> Counts:
    return _vit_counts(cfg, train=False, dtype=torch.float64)["forward"]
