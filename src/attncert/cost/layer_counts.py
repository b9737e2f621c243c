"""Counts of the bound computations on one residual attention layer (float64): the
certificate terms of a bound variant and the tightness study's PGD ascent, at a layer of the
params' shape (:func:`attncert.bounds.bench.bench_layer`)."""

from __future__ import annotations

import functools

import torch

from attncert.cost.counting import Counts, count, count_call
from attncert.pipeline import rng

#: the batch at which the certificate terms' memory is counted (:func:`layer_certificate_counts`)
PEAK_BATCH = 32


@functools.cache
def layer_certificate_counts(n: int, d: int, h: int, variant: str) -> Counts:
    """The eps-independent certificate terms of one residual attention layer (float64), as
    the variant's own ``terms`` computes them (:mod:`attncert.bounds.variants`); a variant
    priced at nothing beyond the forward pass counts zero, an unknown one fails.

    FLOPs per point and kernels: the more of one point's and a batch of :data:`PEAK_BATCH`'s
    (a batch iterates until its slowest point converges). Bytes per point: the most bytes the
    tensors of a batch of :data:`PEAK_BATCH` points hold at once, divided by
    :data:`PEAK_BATCH`. For a batch that runs the same steps, the live bytes at every moment
    are a + s B (a, s >= 0, B the batch), so this is at least every moment's s: what a point
    adds to the peak at any batch, at most. A batch whose slowest point takes more steps holds
    a larger Krylov basis (32, 64, 128 or 200 columns: past 64 steps, which the KW steps of
    the certificates' norms always take, it holds 128); that is not counted. The total output
    of the Lanczos steps, which free their temporaries, would be some 30 times it."""
    from attncert.bounds.bench import bench_layer
    from attncert.bounds.variants import Layer
    from attncert.bounds.variants import variant as lookup

    spec = lookup(variant)
    if spec.cost == "none":
        return Counts(0.0, 0.0, 0)

    def make(b):
        w, x = bench_layer(n, d, h, b, torch.float64)
        layer = Layer(x, w, True, 1.0, 1.0)
        return lambda: spec.terms(layer)
    f1, k1, _, _ = count_call(make(1))  # FLOPs per sample: batched Lanczos runs per sample
    fb, kb, _, peak = count_call(make(PEAK_BATCH), peak=True)
    return Counts(0.0, max(f1, fb / PEAK_BATCH), max(k1, kb), peak / PEAK_BATCH)


@functools.cache
def layer_pgd_counts(n: int, d: int, h: int) -> tuple[Counts, Counts]:
    """The tightness study's PGD ascent on one layer (float64), per input: (its set-up, the
    Jacobian start direction by Lanczos; one step), from runs of 2 and 4 steps (restarts run
    batched: they multiply FLOPs, not kernels)."""
    from attncert.bounds import pgd_sensitivity
    from attncert.bounds.bench import bench_layer

    w, x = bench_layer(n, d, h, 1, torch.float64)
    runs = {k: count(lambda k=k: pgd_sensitivity(
        x, w, 0.05, True, steps=k, restarts=1, generator=rng.generator(0)))
        for k in (2, 4)}
    step_f, step_k = ((runs[4][i] - runs[2][i]) / 2 for i in (0, 1))
    setup = Counts(0.0, max(runs[2][0] - 2 * step_f, 0.0), max(runs[2][1] - 2 * step_k, 0))
    return setup, Counts(0.0, max(step_f, 0.0), max(step_k, 0))
