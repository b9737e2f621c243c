"""What this machine offers the pipeline, and the guard that keeps the paper scale off the CPU.

    python -m attncert.pipeline.doctor               # torch, CUDA, driver, GPUs, free memory,
                                                     # bf16, one training step of each model
    python -m attncert.pipeline.doctor --gpus 0 1 2  # exit 2 unless every id is a visible GPU
    python -m attncert.pipeline.doctor --no-steps    # the report without the model steps

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
    from attncert.training.train import resolve_device

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
        return f"no GPU visible ({_cuda_summary()}): every worker runs on the CPU"
    missing = [i for i in ids if int(i) >= count]
    if missing:
        raise DeviceError(f"GPU id(s) {missing} not visible: {count} CUDA device(s) found "
                          f"({_cuda_summary() if not count else 'ids 0..' + str(count - 1)})")
    return f"GPUs {' '.join(ids)} visible"


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
    ap.add_argument("--no-steps", action="store_true", help="skip the model steps")
    ap.add_argument("--calibrate", metavar="PATH", nargs="?", const=CALIBRATION,
                    help="time each model kind's step on the GPU and write the cost model's "
                         f"per-kernel constant to PATH (default {CALIBRATION})")
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args(argv)
    try:
        from attncert.stages.registry import load_params

        params = load_params(args.params)
        if args.gpus is not None:
            print(f"doctor: {check_gpu_ids(args.gpus, params['base'].scale)}")
            return 0
        for what, value in report():
            print(f"{what:>20}  {value}")
        if args.no_steps:
            return 0
        device = args.device or params["base"].device
        if args.calibrate:
            from attncert.cost.calibrate import measure

            record = measure(params, device, args.batch, path=args.calibrate)
            for r in record["steps"]:
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
