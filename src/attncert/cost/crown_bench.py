"""Measured seconds per CROWN bound of the crown stage's ViT at its paper shape (``python -m
attncert.cost crown``), the kernels a bound launches (``--count-kernels``), and their record
(``docs/crown_bench.json``: ``rows`` and ``kernels``), which the cost table reads
(:func:`attncert.cost.pricing.crown_bound_seconds`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from attncert.cost.bench import _sync
from attncert.cost.counting import count, random_images
from attncert.pipeline.datasets import stand_in

#: the bridge's graph (:data:`attncert.crown.graph.GRAPHS`, unsplit; named here so that the
#: cost table does not import auto_LiRPA), and that of the rows recorded without one (before
#: 2026-11-29: one branch per head)
GRAPH, GRAPH_BEFORE = "batched-heads", "split-heads"


def bench_crown(params, device: str = "auto", points: int = 2,
                methods: list[str] | None = None, depths: list[int] | None = None,
                batch: int = 1, split_heads: bool = False) -> Iterator[dict[str, Any]]:
    """Seconds per CROWN bound of the crown stage's ViT at its paper shape (every depth, every
    method of ``crown.methods``, the smallest ``cert_eps``, ``crown.bound_dtype``), on
    ``points`` random images of the first dataset's shape, ``batch`` of them bounded by one
    call (:func:`attncert.crown.bridge.certify_batch`; the row's ``batch``). The weights are
    the untrained initialisation: a bound's cost follows the graph's shape, not the weights'
    values; alpha-CROWN runs all its iterations (no early stop: the worst case). Build time
    (once per model) is reported apart; a bound that fails (a domain error
    of loose intermediate bounds, the time limit) counts with the seconds it ran, and its
    status shows; a batch that does not fit in the device's memory is a row of NaN seconds,
    "out_of_memory".
    ``methods``, ``depths``: subsets of ``crown.methods``, ``crown.depths`` (None: all). Yields
    a row as each (depth, method) ends, so a caller keeps what finished before an
    out-of-memory kill; ``peak_gb``: the device's peak allocation during the bounds (CUDA) or
    the process's peak resident memory so far (CPU); ``graph``: the attention's form
    (:data:`attncert.crown.graph.GRAPHS`, ``split_heads``)."""
    from attncert.crown.bridge import CrownCertifier, certify_batch
    from attncert.crown.graph import GRAPHS
    from attncert.crown.study import vit_config
    from attncert.models import build_vit
    from attncert.pipeline.device import resolve_device

    if batch < 1 or points < 1:
        raise ValueError(f"crown bench: points and batch must be >= 1, got {points}, {batch}")
    c = params["crown"]
    dev = resolve_device(device)
    dtype = getattr(torch, c.bound_dtype)
    for depth in depths or c.depths:
        cfg = vit_config(stand_in(c.datasets[0]), c, depth)
        torch.manual_seed(0)
        model = build_vit(cfg).to(device=dev, dtype=dtype).eval()
        x, _ = random_images(cfg, points, dtype)
        x = x.to(dev)
        with torch.no_grad():
            y = model(x).argmax(-1)
        cert = CrownCertifier.from_vit(model, x.shape[1:], dtype, split_heads)
        for method in methods or c.methods:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            _sync(dev)
            try:
                out = [r for s in range(0, points, batch)
                       for r in certify_batch(cert, x[s:s + batch], y[s:s + batch],
                                              min(c.cert_eps), method, c.time_limit,
                                              c.alpha_iterations, stop_certified=False)]
            except torch.OutOfMemoryError:  # a batch of several points: the row says so
                torch.cuda.empty_cache()
                out = [{"seconds": float("nan"), "status": "out_of_memory"}]
            _sync(dev)
            yield {"depth": depth, "method": method, "batch": batch, "device": str(dev),
                   "graph": GRAPHS[split_heads],
                   "dtype": c.bound_dtype, "tokens": (cfg.image_size // cfg.patch) ** 2,
                   "build_seconds": cert.build_seconds,
                   "seconds_per_bound": sum(r["seconds"] for r in out) / len(out),
                   "status": ",".join(sorted({r["status"] for r in out})),
                   "peak_gb": _peak_gb(dev)}
        del cert, model


def count_crown_kernels(params, methods: list[str] | None = None,
                        depths: list[int] | None = None, batch: int = 1,
                        split_heads: bool = False, d_head: int = 4) -> Iterator[dict[str, Any]]:
    """The kernels one call of auto_LiRPA launches to bound ``batch`` points of the crown
    stage's ViT (every depth and method, as :func:`bench_crown`), counted on the CPU
    (:func:`attncert.cost.counting.count`) on a copy ``d_head`` wide a head: the count follows
    the graph (its nodes, the tokens, the heads, the batch), not the width (the same at 4 and 8
    wide a head, ``tests/test_crown_heads.py``, and at 4 and 8 for the paper shape's depth 3;
    at 1 wide a head auto_LiRPA takes other paths), and a GPU runs these bounds launch-bound (a
    bound of the paper shape's 43 GFLOP took 9.3 s on an H200). alpha-CROWN is counted at 1
    and 2 of its iterations and extended linearly to ``crown.alpha_iterations`` (each iteration
    one pass through the graph and its gradient; no early stop: the worst case). Yields a row
    per (depth, method)."""
    import dataclasses

    from attncert.crown.bridge import CrownCertifier
    from attncert.crown.graph import GRAPHS
    from attncert.crown.study import vit_config
    from attncert.models import build_vit

    if batch < 1 or d_head < 1:
        raise ValueError(f"crown kernels: batch and d_head must be >= 1, got {batch}, {d_head}")
    c = params["crown"]
    for depth in depths or c.depths:
        cfg = vit_config(stand_in(c.datasets[0]), c, depth)
        cfg = dataclasses.replace(cfg, dim=cfg.heads * d_head, mlp_hidden=cfg.heads * d_head)
        torch.manual_seed(0)
        model = build_vit(cfg).double().eval()
        x, _ = random_images(cfg, batch, torch.float64)
        with torch.no_grad():
            y = model(x).argmax(-1)
        cert = CrownCertifier.from_vit(model, x.shape[1:], torch.float64, split_heads)
        for method in methods or c.methods:
            eps = min(c.cert_eps)
            if method == "alpha_crown":
                one, two = (count(cert.margin_call(x, y, eps, method, n, False))[1]
                            for n in (1, 2))
                kernels = one + (c.alpha_iterations - 1) * (two - one)
            else:
                kernels = count(cert.margin_call(x, y, eps, method))[1]
            yield {"depth": depth, "method": method, "batch": batch, "graph": GRAPHS[split_heads],
                   "tokens": (cfg.image_size // cfg.patch) ** 2, "heads": cfg.heads,
                   "alpha_iterations": c.alpha_iterations if method == "alpha_crown" else 0,
                   "kernels": int(kernels)}


def merge_crown_kernels(path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge :func:`count_crown_kernels` ``rows`` into the record's ``kernels`` (a row replaces
    the one of the same graph, depth, method and batch), each dated."""
    import datetime

    from attncert.pipeline.io import merge_rows

    date = datetime.date.today().isoformat()
    return merge_rows(path, [{"date": date} | r for r in rows], kernel_key, field="kernels",
                      ordered=True, update=lambda rec: rec.setdefault("kernels", []))


def kernel_key(row: dict[str, Any]) -> tuple:
    return row["graph"], row["depth"], row["method"], row["batch"]


def row_key(row: dict[str, Any]) -> tuple:
    """A timed row's key: device type, depth, method, batch and graph (the rows measured
    before the graph was named are the split-heads graph's)."""
    return (row["device"].split(":")[0], row["depth"], row["method"], row.get("batch", 1),
            row.get("graph", GRAPH_BEFORE))


def _peak_gb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def merge_crown_bench(path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge :func:`bench_crown` ``rows`` into the JSON file at ``path`` (a row replaces the
    row of the same device type, depth, method, batch and graph; others are kept), each row
    dated (a row's own date, machine and torch, when it has them, are kept); written
    atomically."""
    import datetime
    import platform

    from attncert.pipeline.io import merge_rows

    types = {r["device"].split(":")[0] for r in rows}
    date = datetime.date.today().isoformat()
    if all("machine" in r for r in rows):  # measured elsewhere: as recorded there
        machine = ""
    elif "cuda" in types:
        machine = torch.cuda.get_device_name() if torch.cuda.is_available() else "cuda"
    else:
        machine = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    new = [{"date": date, "machine": machine, "torch": torch.__version__} | r for r in rows]
    return merge_rows(path, new, row_key, ordered=True)
