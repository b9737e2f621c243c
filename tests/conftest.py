"""Shared test helpers: repository paths and the offline dataset mirror."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIRROR = Path(os.environ.get("ATTNCERT_DATA_MIRROR", ROOT.parent / "shared" / "datasets"))


def pytest_configure(config):
    """Tests use tiny tensors: one intra-op thread avoids thread-pool overhead that costs
    more than the work itself (100x on a loaded 2-core machine)."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def mirror() -> Path:
    if not (MIRROR / "MNIST" / "raw").is_dir():
        pytest.skip(f"offline dataset mirror not found at {MIRROR}")
    return MIRROR.resolve()


@pytest.fixture
def venv_env() -> dict[str, str]:
    """Environment for subprocesses: this interpreter's bin dir first on PATH."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DVC_NO_ANALYTICS"] = "1"
    return env
