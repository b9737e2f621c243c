"""What a stage sets before any work: math-library threads and deterministic algorithms.

Every notebook calls :func:`configure` right after parsing ``base``. ``base.threads`` fixes
the CPU threads of PyTorch's math libraries (0 keeps PyTorch's default, one per physical
core): the thread count changes the order of float reductions, so two runs with different
counts differ in their last digits and, through training, in their trained models.
``base.deterministic`` turns on :func:`torch.use_deterministic_algorithms` (``warn_only``:
an operation without a deterministic kernel warns instead of stopping the stage), switches
off cuDNN's benchmark autotuning and sets the cuBLAS workspace that deterministic GEMMs need
(read when the first cuBLAS handle is made, so this runs before any CUDA work). On a GPU
this makes a run repeat on the same machine and software; across machines and library
versions numbers still agree only statistically.
"""

from __future__ import annotations

import os

import torch

#: the cuBLAS workspace setting deterministic GEMMs need (CUDA's documentation)
CUBLAS_WORKSPACE = ":4096:8"


def configure(base) -> None:
    """Apply ``base.threads``, ``base.deterministic`` and ``base.compile`` (a
    :class:`attncert.pipeline.params.BaseParams`; :mod:`attncert.training.compiled`) to this
    process."""
    from attncert.training import compiled

    compiled.set_mode(base.compile)
    if base.threads:
        torch.set_num_threads(base.threads)
    if base.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
        torch.backends.cudnn.benchmark = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    else:
        torch.use_deterministic_algorithms(False)
