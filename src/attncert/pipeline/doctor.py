"""What this machine offers the pipeline, and the guard that keeps the paper scale off the CPU.

    python -m attncert.pipeline.doctor               # torch, CUDA, driver, GPUs, free memory,
                                                     # bf16, one training step of each model
    python -m attncert.pipeline.doctor --gpus 0 1 2  # exit 2 unless every id is a visible GPU
    python -m attncert.pipeline.doctor --cpu-workers 2   # exit 2 unless this scale may run so
    python -m attncert.pipeline.doctor --no-steps    # the report without the model steps

The report also gives the free disk where the pipeline writes (against what the paper scale
needs, :data:`PAPER_DISK_GB`) and, per GPU, the float64 against float32 matrix throughput:
certificates, Douglas-Rachford and CROWN run in float64, which many cards run at 1/32 or 1/64
of float32. ``--gpus`` (what ``scripts/repro-gpus`` calls) also refuses a paper-scale run on
too little free disk.

At the paper scale a stage that trains or certifies refuses to start on a CPU
(:func:`require_device`): a paper-scale run there takes months. The runner
(:mod:`attncert.pipeline.nbrun`) calls it before any notebook cell runs, so the refusal is one line.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterable, Sequence
from typing import Any

#: params.yaml sections whose stages train or certify models (data and figures need no GPU).
DEVICE_SECTIONS = frozenset({"tightness", "vit_grid", "train_vit", "certify_vit", "frontier",
                             "specformer", "certvit", "crown", "text"})
#: where ``--calibrate`` writes (attncert.cost.calibrate.CALIBRATION_FILE, without importing it)
CALIBRATION = "reports/gpu_check.json"
#: set to 1 to run the paper scale on a CPU anyway (the paper-shaped dry run of the tests does)
ALLOW_CPU_ENV = "ATTNCERT_ALLOW_CPU_PAPER"
#: free disk (GB) the paper scale needs where it writes: the frozen encoder's memory-mapped
#: states of Yelp (about 59 GB) and QQP (about 40 GB) exist at once in the first wave of
#: units, next to the checkpoints DVC copies into its cache (docs/gpus.md)
PAPER_DISK_GB = 150.0
#: set to 1 to start a paper-scale run on less free disk anyway
ALLOW_LOW_DISK_ENV = "ATTNCERT_ALLOW_LOW_DISK"
#: float64 below this share of float32 throughput is flagged (RTX-class, L40S, A10: 1/64)
SLOW_FP64_SHARE = 1 / 8


class DeviceError(ValueError):
    """The chosen device cannot run this scale (one line: what was found, what to do)."""


def _cuda_summary() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU-only build"
    return (f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable GPU "
            "(driver too old for this CUDA, no GPU visible, or CUDA_VISIBLE_DEVICES empty)")


def require_device(scale: str, device: str, sections: Iterable[str] = DEVICE_SECTIONS,
                   env: dict[str, str] | None = None) -> None:
    """Raise :class:`DeviceError` when a paper-scale stage that trains or certifies would run
    on the CPU (``base.device`` cpu, or auto without a usable GPU). Other scales, stages that
    need no device (data, figures) and ``ATTNCERT_ALLOW_CPU_PAPER=1`` pass."""
    env = os.environ if env is None else env
    if scale != "paper" or env.get(ALLOW_CPU_ENV) == "1":
        return
    if not {s.split(".")[0] for s in sections} & DEVICE_SECTIONS:
        return
    from attncert.pipeline.device import resolve_device

    dev = resolve_device(device)  # cuda / mps that are missing raise their own one line
    if dev.type == "cpu":
        found = ("base.device is cpu" if device == "cpu" else
                 f"base.device is {device} and {_cuda_summary()}")
        raise DeviceError(
            f"the paper scale would run on the CPU ({found}); it needs weeks of GPU time "
            "(docs/cost.md). Fix the GPU (python -m attncert.pipeline.doctor), or run a smaller "
            f"scale (make pipeline SCALE=cpu); {ALLOW_CPU_ENV}=1 forces the CPU")


def check_gpu_ids(ids: Sequence[str], scale: str = "paper",
                  env: dict[str, str] | None = None) -> str:
    """Raise :class:`DeviceError` unless every id is a distinct visible CUDA device index.
    A machine with no GPU at all passes below the paper scale (the workers then run on the
    CPU: the tests' two-worker run) and returns a note saying so."""
    import torch

    env = os.environ if env is None else env
    bad = [i for i in ids if not i.isdigit()]
    if bad:
        raise DeviceError(f"GPU ids must be CUDA device indices, got {bad}")
    if len(set(ids)) != len(ids):
        raise DeviceError(f"GPU ids repeat: {list(ids)}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count and (scale != "paper" or env.get(ALLOW_CPU_ENV) == "1"):
        return f"no GPU visible ({_cuda_summary()}): {CPU_WORKERS_NOTE}"
    missing = [i for i in ids if int(i) >= count]
    if missing:
        raise DeviceError(f"GPU id(s) {missing} not visible: {count} CUDA device(s) found "
                          f"({_cuda_summary() if not count else 'ids 0..' + str(count - 1)})")
    return f"GPUs {' '.join(ids)} visible"


#: what :func:`check_gpu_ids` and :func:`check_cpu_workers` say when the workers use the CPU
#: (``scripts/repro-gpus`` reads it to split the cores among them)
CPU_WORKERS_NOTE = "every worker runs on the CPU"


def check_cpu_workers(workers: int, scale: str, device: str, threads: int = 0,
                      env: dict[str, str] | None = None) -> str:
    """Raise :class:`DeviceError` unless ``workers`` concurrent units may share this machine's
    CPU: at least one, below the paper scale (or ``ATTNCERT_ALLOW_CPU_PAPER=1``), and
    ``base.device`` cpu or auto (the workers see no GPU). Returns the split of the cores
    (``base.threads`` 0 lets the script give each worker its share; a set value is each
    worker's, and a note says when the workers then ask for more threads than there are CPUs)."""
    if workers < 1:
        raise DeviceError(f"--cpu takes a number of workers of at least 1, got {workers}")
    if device not in ("auto", "cpu"):
        raise DeviceError(f"base.device is {device}, but the CPU workers see no GPU: set "
                          "base.device to cpu or auto, or give GPU ids instead of --cpu")
    require_device(scale, "cpu", env=env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = cores or 1
    note = f"{workers} worker(s) on {cores} CPU(s): {CPU_WORKERS_NOTE}"
    if workers > cores:
        note += " (more workers than CPUs: each unit runs slower than alone)"
    elif threads and threads * workers > cores:
        note += (f" (base.threads {threads} in each: {threads * workers} threads on {cores} "
                 "CPUs; base.threads 0 gives each worker its share)")
    return note


def _driver() -> str:
    """The NVIDIA driver's version (nvidia-smi) and the CUDA version it supports (the CUDA
    driver API, through torch); "unknown" for what neither says."""
    import shutil
    import subprocess

    import torch

    found = []
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=30).stdout.split()
            found += out[:1]
        except (OSError, subprocess.SubprocessError):
            pass
    api = getattr(torch._C, "_cuda_getDriverVersion", None)
    try:
        v = int(api()) if api else 0
    except RuntimeError:
        v = 0
    if v:
        found.append(f"(CUDA {v // 1000}.{v % 1000 // 10})")
    return " ".join(found) or "unknown"


def free_disk_gb(path: str = ".") -> float:
    """Free space (GB) of the filesystem holding ``path``."""
    import shutil

    return shutil.disk_usage(path).free / 1e9


def check_disk(scale: str, path: str = ".", env: dict[str, str] | None = None,
               free_gb: float | None = None) -> str:
    """Raise :class:`DeviceError` when a paper-scale run would start with less free disk than
    :data:`PAPER_DISK_GB` at ``path`` (``ATTNCERT_ALLOW_LOW_DISK=1`` passes); other scales
    pass. Returns the line the doctor prints."""
    env = os.environ if env is None else env
    free = free_disk_gb(path) if free_gb is None else free_gb
    line = f"{free:.0f} GB free at {os.path.abspath(path)}"
    if scale != "paper":
        return line
    if free < PAPER_DISK_GB and env.get(ALLOW_LOW_DISK_ENV) != "1":
        raise DeviceError(f"{line}; the paper scale needs about {PAPER_DISK_GB:.0f} GB there "
                          f"(the frozen encoder's states of Yelp and QQP, the DVC cache): free "
                          f"some, or set {ALLOW_LOW_DISK_ENV}=1 to start anyway")
    return f"{line} (the paper scale needs about {PAPER_DISK_GB:.0f} GB)"


def matmul_tflops(device: str, dtype: Any, n: int = 4096, reps: int = 5) -> float:
    """Measured dense matmul throughput (TFLOP/s) of ``device`` in ``dtype`` (n x n)."""
    import time

    import torch

    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    cuda = torch.device(device).type == "cuda"
    a @ b  # warm-up
    if cuda:
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    if cuda:
        torch.cuda.synchronize(device)
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def fp64_row(device: str, n: int = 4096) -> str:
    """float64 and float32 matmul throughput of ``device``, flagged when float64 is slow."""
    import torch

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 as float32, not TF32
    try:
        f64 = matmul_tflops(device, torch.float64, n)
        f32 = matmul_tflops(device, torch.float32, n)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    note = (f"; float64 is {f32 / f64:.0f}x slower: certificates, Douglas-Rachford and CROWN "
            "(float64) will take far longer than the cost table's H100 figures"
            if f64 < SLOW_FP64_SHARE * f32 else "")
    return f"float64 {f64:.1f} TFLOP/s, float32 {f32:.1f} TFLOP/s{note}"


def report() -> list[tuple[str, str]]:
    """(what, value) rows: torch, CUDA, driver, each GPU's name, memory and bf16 support."""
    import torch

    rows = [("torch", torch.__version__), ("CUDA (torch build)", str(torch.version.cuda)),
            ("threads", str(torch.get_num_threads()))]
    if not torch.cuda.is_available():
        rows.append(("GPUs", f"none usable: {_cuda_summary()}"))
        return rows
    rows.append(("CUDA driver", _driver()))
    for i in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(i)
        props = torch.cuda.get_device_properties(i)
        rows.append((f"cuda:{i}", f"{props.name}, {free / 2**30:.1f} of {total / 2**30:.1f} GiB "
                                  f"free, compute {props.major}.{props.minor}, bf16 "
                                  f"{'yes' if torch.cuda.is_bf16_supported() else 'no'}"))
        rows.append((f"cuda:{i} matmul", fp64_row(f"cuda:{i}")))
    return rows


def model_steps(params: Any, device: str, batch: int = 8) -> list[dict[str, Any]]:
    """One timed training step of every model kind at its params-file shape on ``device``."""
    from attncert.cost.bench import bench_training

    return bench_training(params, batch=batch, steps=1, device=device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.pipeline.doctor",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--device", default=None, help="default: base.device of the params file")
    ap.add_argument("--gpus", nargs="*", default=None,
                    help="only check that these CUDA device indices are visible")
    ap.add_argument("--cpu-workers", type=int, default=None, metavar="N",
                    help="only check that N workers may share the CPU at this scale")
    ap.add_argument("--no-steps", action="store_true", help="skip the model steps")
    ap.add_argument("--calibrate", metavar="PATH", nargs="?", const=CALIBRATION,
                    help="time each model kind's step on the GPU and write the cost model's "
                         f"per-kernel constant to PATH (default {CALIBRATION})")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        from attncert.stages.registry import load_params

        params = load_params(args.params)
        scale = params["base"].scale
        if args.gpus is not None:
            print(f"doctor: {check_gpu_ids(args.gpus, scale)}")
            print(f"doctor: disk: {check_disk(scale)}")
            return 0
        if args.cpu_workers is not None:
            b = params["base"]
            print(f"doctor: {check_cpu_workers(args.cpu_workers, scale, b.device, b.threads)}")
            print(f"doctor: disk: {check_disk(scale)}")
            return 0
        for what, value in report():
            print(f"{what:>20}  {value}")
        try:
            print(f"{'disk':>20}  {check_disk(scale)}")
        except DeviceError as exc:
            print(f"{'disk':>20}  {exc}")
        if args.no_steps:
            return 0
        device = args.device or params["base"].device
        if args.calibrate:
            from attncert.cost.calibrate import measure

            record = measure(params, device, args.batch, path=args.calibrate)
            for r in record["steps"]:
                if "seconds_per_kernel" not in r:  # its step failed: no constant
                    print(f"{r['model']:>34} {r['status']}")
                    continue
                print(f"{r['model']:>34} {r['ms_per_step']:9.2f} ms  "
                      f"{1e6 * r['seconds_per_kernel']:7.2f} us/kernel  {r['shape']}")
            print(f"per-kernel constant {1e6 * record['kernel_seconds']:.2f} us (from "
                  f"{record['from']}) written to {args.calibrate}")
            return 0
        print(f"one training step per model kind (batch {args.batch}, device {device}, "
              f"{params['base'].scale} scale shapes):")
        for r in model_steps(params, device, args.batch):
            print(f"{r['model']:>34} {r['ms_per_step']:9.1f} ms  {r['precision']:>5}  "
                  f"{r['shape']}")
    except (DeviceError, ValueError) as exc:
        print(f"doctor: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
