"""Measured seconds per CROWN bound of the crown stage's ViT at its paper shape (``python -m
attncert.cost crown``), and their record (``docs/crown_bench.json``), which the cost table
reads (:func:`attncert.cost.pricing.crown_bound_seconds`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from attncert.cost.bench import _sync
from attncert.cost.counting import random_images
from attncert.pipeline.datasets import stand_in


def bench_crown(params, device: str = "auto", points: int = 2,
                methods: list[str] | None = None, depths: list[int] | None = None,
                batch: int = 1) -> Iterator[dict[str, Any]]:
    """Seconds per CROWN bound of the crown stage's ViT at its paper shape (every depth, every
    method of ``crown.methods``, the smallest ``cert_eps``, ``crown.bound_dtype``), on
    ``points`` random images of the first dataset's shape, ``batch`` of them bounded by one
    call (:func:`attncert.crown.bridge.certify_batch`; the row's ``batch``). The weights are
    the untrained initialisation: a bound's cost follows the graph's shape, not the weights'
    values. Build time (once per model) is reported apart; a bound that fails (a domain error
    of loose intermediate bounds, the time limit) counts with the seconds it ran, and its
    status shows; a batch that does not fit in the device's memory is a row of NaN seconds,
    "out_of_memory".
    ``methods``, ``depths``: subsets of ``crown.methods``, ``crown.depths`` (None: all). Yields
    a row as each (depth, method) ends, so a caller keeps what finished before an
    out-of-memory kill; ``peak_gb``: the device's peak allocation during the bounds (CUDA) or
    the process's peak resident memory so far (CPU)."""
    from attncert.crown.bridge import CrownCertifier, certify_batch
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
        cert = CrownCertifier.from_vit(model, x.shape[1:], dtype)
        for method in methods or c.methods:
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            _sync(dev)
            try:
                out = [r for s in range(0, points, batch)
                       for r in certify_batch(cert, x[s:s + batch], y[s:s + batch],
                                              min(c.cert_eps), method, c.time_limit,
                                              c.alpha_iterations)]
            except torch.OutOfMemoryError:  # a batch of several points: the row says so
                torch.cuda.empty_cache()
                out = [{"seconds": float("nan"), "status": "out_of_memory"}]
            _sync(dev)
            yield {"depth": depth, "method": method, "batch": batch, "device": str(dev),
                   "dtype": c.bound_dtype, "tokens": (cfg.image_size // cfg.patch) ** 2,
                   "build_seconds": cert.build_seconds,
                   "seconds_per_bound": sum(r["seconds"] for r in out) / len(out),
                   "status": ",".join(sorted({r["status"] for r in out})),
                   "peak_gb": _peak_gb(dev)}
        del cert, model


def _peak_gb(dev: torch.device) -> float:
    if dev.type == "cuda":
        return torch.cuda.max_memory_allocated(dev) / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def merge_crown_bench(path, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge :func:`bench_crown` ``rows`` into the JSON file at ``path`` (a row replaces the
    row of the same device type, depth, method and batch; others are kept), each row dated (a row's
    own date, machine and torch, when it has them, are kept); written atomically."""
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
    return merge_rows(path, new, lambda r: (r["device"].split(":")[0], r["depth"], r["method"],
                                            r.get("batch", 1)), ordered=True)
