"""What a stage sets before any work: math-library threads and deterministic algorithms.

Every notebook calls :func:`configure` right after parsing ``base``. ``base.threads`` fixes
the CPU threads of PyTorch's math libraries (0 keeps PyTorch's default: OMP_NUM_THREADS when
set, as ``scripts/repro-gpus --cpu N`` sets it for each worker, else one per physical
core): the thread count changes the order of float reductions, so two runs with different
counts differ in their last digits and, through training, in their trained models.
``base.deterministic`` turns on :func:`torch.use_deterministic_algorithms` (``warn_only``:
an operation without a deterministic kernel warns instead of stopping the stage), switches
off cuDNN's benchmark autotuning and sets the cuBLAS workspace that deterministic GEMMs need
(read when the first cuBLAS handle is made, so this runs before any CUDA work). On a GPU
this makes a run repeat on the same machine and software; across machines and library
versions numbers still agree only statistically.

:func:`configure` also has a notebook's kernel report its GPU memory: after every cell it
writes the process's peak CUDA allocation to the file ``nbrun`` names in
``$ATTNCERT_GPU_PEAK_FILE`` (:func:`record_gpu_peak`), which becomes the stage headline's
``gpu_peak_gb``. Nothing is written on a CPU run.
"""

from __future__ import annotations

import os

import torch

#: the cuBLAS workspace setting deterministic GEMMs need (CUDA's documentation)
CUBLAS_WORKSPACE = ":4096:8"
#: the file a notebook's kernel writes its peak GPU memory to (set by attncert.pipeline.nbrun)
GPU_PEAK_ENV = "ATTNCERT_GPU_PEAK_FILE"
_HOOKED: set[int] = set()
#: ``base.compile``'s values (:mod:`attncert.training.compiled` maps them to torch.compile's)
COMPILE_MODES = ("off", "compile", "graphs", "auto")
_compile_mode = "off"


def set_compile_mode(mode: str) -> None:
    """The process's compile mode (``base.compile``), used by every later training run
    (:func:`attncert.training.compiled.resolve` reads it)."""
    global _compile_mode
    if mode not in COMPILE_MODES:
        raise ValueError(f"base.compile: {mode!r}; one of {', '.join(COMPILE_MODES)}")
    _compile_mode = mode


def compile_mode() -> str:
    """The process's compile mode (:func:`set_compile_mode`; ``off`` until it is set)."""
    return _compile_mode


def configure(base) -> None:
    """Apply ``base.threads``, ``base.deterministic``, ``base.compile`` and
    ``base.batch_memory`` (a :class:`attncert.pipeline.params.BaseParams`;
    :func:`set_compile_mode`, :mod:`attncert.pipeline.batching`) to this process. The training
    code reads the compile mode; nothing here imports it."""
    from attncert.pipeline import batching

    set_compile_mode(base.compile)
    batching.set_memory_share(base.batch_memory)
    record_gpu_peak()
    if base.threads:
        torch.set_num_threads(base.threads)
    if base.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(False)


def gpu_peak_gb() -> float | None:
    """The peak CUDA memory allocated by this process, summed over its devices, in GB (10^9
    bytes); None when CUDA was never initialised here (a CPU run: no context is created)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    from attncert.pipeline.batching import device_peak

    total = sum(device_peak(i) for i in range(torch.cuda.device_count()))
    return round(total / 1e9, 3)


def write_gpu_peak(path: str | os.PathLike) -> None:
    """Write :func:`gpu_peak_gb` to ``path`` (nothing on a CPU run); atomic (a rename)."""
    from attncert.pipeline.io import atomic_path

    peak = gpu_peak_gb()
    if peak is None:
        return
    with atomic_path(path) as tmp:
        tmp.write_text(f"{peak}\n")


def record_gpu_peak() -> None:
    """In a notebook's kernel (IPython) whose runner named a file in ``$ATTNCERT_GPU_PEAK_FILE``:
    after every cell, write the peak GPU memory there (IPython's ``post_run_cell`` event; once
    per kernel). Elsewhere nothing."""
    path = os.environ.get(GPU_PEAK_ENV)
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if not path or shell is None or id(shell) in _HOOKED:
        return
    shell.events.register("post_run_cell", lambda *_: write_gpu_peak(path))
    _HOOKED.add(id(shell))
