"""Shared test helpers: repository paths and the offline dataset mirror."""

from __future__ import annotations

import os
import shutil
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


#: the files that take longest (the pipeline through dvc, the paper-shaped dry run), first:
#: `make test` hands whole files to two workers in collection order (xdist's loadfile without
#: its reordering by test count, which would start them last and leave one worker idle)
LONGEST_FIRST = ("test_dvc_pipeline.py", "test_paper_dryrun.py")


def pytest_collection_modifyitems(session, config, items):
    """The longest files first; the order within a file is kept (a stable sort)."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    """A params file at the smoke scale (tiny shapes: a cost estimate runs in seconds)."""
    from attncert.pipeline import profile

    tmp = tmp_path_factory.mktemp("smoke-params")
    shutil.copy(ROOT / "params.yaml", tmp / "params.yaml")
    shutil.copytree(ROOT / "profiles", tmp / "profiles")
    profile.apply("smoke", tmp)
    return tmp / "params.yaml"


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


@pytest.fixture(name="metrics_tree")
def metrics_tree_fixture(tmp_path):
    """Fake metrics of every stage in the stages' formats (tests/reportdata.py), for the
    report tests: (params, root)."""
    from reportdata import metrics_tree

    return metrics_tree(tmp_path)
