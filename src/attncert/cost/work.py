"""Work items: a training run, an evaluation, a certificate pass or a PGD audit, with its FLOPs,
kernels and precision, and its seconds on a GPU at a sustained utilisation."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from attncert.cost.counting import (
    GPU,
    Counts,
    vit_forward64,
)
from attncert.cost.graphs import ADVERSARIAL
from attncert.cost.layer_counts import layer_certificate_counts

# -- work items ---------------------------------------------------------------------------------


@dataclass
class Work:
    stage: str
    what: str
    kind: str  # bf16 | tf32 | fp32 | fp64 (the precision it runs at)
    flops: float
    kernels: float
    unit: str = ""  # the DVC stage it runs in, when the stage is split into units
    fixed_seconds: float = 0.0  # time not from counts (CROWN's bounds: their time budget)
    #: a training run's or an audit's step kind (:func:`attncert.cost.graphs.graphs_key`): its
    #: kernels run at the measured CUDA-graph speed-up when the params train under graphs
    #: ("": eager)
    graphs: str = ""
    #: the bench model kind it runs (:data:`attncert.cost.graphs.LIPSCHITZ_VIT`, ...; "": none),
    #: whose measured per-kernel constant it takes before its stage's
    model: str = ""

    def kernel_seconds(self, gpu: GPU, slowdown: float = 1.0) -> float:
        """The kernels' seconds: count x the per-kernel constant of its model kind (else of
        its stage) x ``slowdown``, over the CUDA-graph speed-up of a training run's step kind
        where it is counted."""
        return (slowdown * self.kernels * gpu.kernel_seconds_for(self.stage, self.model)
                / gpu.graphs_speedup_for(self.graphs))

    def seconds(self, gpu: GPU, utilisation: float, per_gpu: int = 1,
                slowdown: float = 1.0) -> float:
        """Seconds on ``gpu``: its FLOPs at ``utilisation`` of the precision's peak or its
        kernels at the per-kernel latency, whichever is longer. With ``per_gpu`` units sharing
        the GPU, the FLOPs get 1 / ``per_gpu`` of it (at worst, every unit computing at once)
        and each kernel takes ``slowdown`` times as long (the launch latencies of concurrent
        processes overlap: :data:`attncert.cost.plan.CONCURRENCY`)."""
        scale = dict(gpu.pilot_by_stage).get(self.stage, 1.0)  # the pilot's calibration
        return scale * max(per_gpu * self.flops / (getattr(gpu, self.kind) * utilisation),
                           self.kernel_seconds(gpu, slowdown)) + self.fixed_seconds


def n_steps(n: int, batch: int) -> int:
    """Batches of ``batch`` that cover ``n`` examples."""
    return math.ceil(n / batch)


def training_work(stage: str, what: str, c: Mapping[str, Counts], n_train: int, n_eval: int,
                  epochs: int, batch: int, eval_batch: int, attack_steps: int = 0,
                  graphs: str = "") -> list[Work]:
    """``epochs`` of training (+ PGD adversarial examples of ``attack_steps`` per step) and a
    forward pass over ``n_eval`` evaluation images after every epoch. ``graphs``: the step's
    kind for the CUDA-graph speed-up (:func:`attncert.cost.graphs.graphs_key`; adversarial
    training, ``attack_steps`` > 0, is a kind of its own: that kind's PGD-training key)."""
    steps = epochs * n_steps(n_train, batch)
    flops = steps * (c["train"].flops(batch) + attack_steps * c["attack"].flops(batch))
    kernels = steps * (c["train"].kernels + attack_steps * c["attack"].kernels)
    ev = epochs * n_steps(n_eval, eval_batch)
    if attack_steps and graphs:
        graphs = f"{graphs}, {ADVERSARIAL}"
    return [Work(stage, what, "bf16", flops, kernels, graphs=graphs),
            Work(stage, f"{what}: evaluation", "fp32",
                 ev * c["forward"].flops(eval_batch), ev * c["forward"].kernels)]


#: the memory of the GPUs the cost model prices (H100 SXM, A100 SXM: 80 GB), to which an
#: audit's batch grows (``base.batch_memory``: :func:`grown_batches`)
GPU_MEMORY = 80e9
#: what a loop holds before its batches (the model, its attack copy, the points): a bound for
#: the study's models, which hold well under it
LOOP_BASE_BYTES = 2**30
#: the growth rule doubles a batch while twice its peak fits; twice again here, for the memory
#: pools CUDA graphs keep per batch shape and the allocator's rounding
GROWTH_MARGIN = 4


def grown_batches(n: int, batch: int, loops: int, per_sample_bytes: float,
                  share: float) -> int:
    """The batches of ``loops`` loops over ``n`` points (an audit's radii) that start at
    ``batch`` and share one size (:class:`attncert.pipeline.batching.BatchSize`), grown on a
    GPU of :data:`GPU_MEMORY` to ``share`` of it: doubled after a full batch while
    :data:`LOOP_BASE_BYTES` + :data:`GROWTH_MARGIN` x its bytes fit (``per_sample_bytes``: an
    upper bound of a point's, so no fewer batches than the run makes). ``share`` 0: no growth."""
    size, batches = batch, 0
    for _ in range(loops):
        start = 0
        while start < n:
            k = min(size, n - start)
            batches += 1
            if share > 0 and k == size and (LOOP_BASE_BYTES + GROWTH_MARGIN * k * per_sample_bytes
                                            <= share * GPU_MEMORY):
                size *= 2
            start += k
    return batches


def audit_work(stage: str, what: str, c: Counts, n: int, eps: int, steps: int, restarts: int,
               batch: int, graphs: str = "", share: float = 0.0) -> Work:
    """L2 PGD on every point at every eps (no early stop: an upper bound), float32 + TF32;
    ``graphs``: its attack step's kind (:func:`attncert.cost.graphs.graphs_key` with
    ``audit``; "": eager); ``share``: its batch grows to that share of a GPU's memory
    (``base.batch_memory``, :func:`grown_batches`; 0: ``batch`` throughout)."""
    if share <= 0:
        calls = eps * steps * restarts * n_steps(n, batch)
        return Work(stage, what, "tf32", calls * c.flops(batch), calls * c.kernels, graphs=graphs)
    calls = steps * restarts * grown_batches(n, batch, eps, c.bytes_per_sample, share)
    flops = calls * c.per_call + steps * restarts * eps * n * c.per_sample
    return Work(stage, what, "tf32", flops, calls * c.kernels, graphs=graphs)


def certify_work(stage: str, name: str, cfg, n: int, variants, tests: int, batch: int,
                 share: float = 0.0) -> list[Work]:
    """Certificates in float64 (:func:`attncert.certify.certify_table`): per batch one forward
    and each variant's per-layer terms. ``share``: the batches grow as an audit's do
    (:func:`grown_batches`, one loop), a point's bytes taken as its float64 forward's and every
    variant's terms at every layer held at once (an upper bound); 0: ``batch`` throughout."""
    f64 = vit_forward64(cfg)
    tokens = (cfg.image_size // cfg.patch) ** 2 + (cfg.pool == "cls")
    layers = [layer_certificate_counts(tokens, cfg.dim, cfg.heads, v)  # unknown: ValueError
              for v in variants]
    point = f64.bytes_per_sample + cfg.depth * sum(lc.bytes_per_sample for lc in layers)
    batches = grown_batches(n, batch, 1, point, share)
    flops = kernels = 0.0
    for lc in layers:
        flops += (batches * (f64.per_call + cfg.depth * lc.per_call)
                  + n * (f64.per_sample + cfg.depth * lc.per_sample))
        kernels += batches * (f64.kernels + cfg.depth * lc.kernels)
    return [Work(stage, f"{name}: certificates ({len(variants)} variants, {tests} tests)",
                 "fp64", flops, kernels)]
