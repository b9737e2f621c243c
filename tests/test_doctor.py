"""The paper scale never lands on the CPU silently; GPU ids are checked; the doctor report."""

import os
import subprocess
import sys

import pytest
import torch

from attncert.pipeline import doctor
from attncert.pipeline.doctor import (
    ALLOW_CPU_ENV,
    CPU_WORKERS_NOTE,
    DeviceError,
    check_cpu_workers,
    check_gpu_ids,
    require_device,
)

NO_GPU = not torch.cuda.is_available()


@pytest.mark.skipif(not NO_GPU, reason="the refusal needs a machine without a usable GPU")
@pytest.mark.parametrize("device", ["auto", "cpu"])
def test_paper_scale_refuses_the_cpu(device):
    with pytest.raises(DeviceError, match="paper scale would run on the CPU") as exc:
        require_device("paper", device, ["train_vit"], env={})
    assert "\n" not in str(exc.value) and "SCALE=cpu" in str(exc.value)


def test_other_scales_stages_and_the_override_pass():
    require_device("cpu", "cpu", ["train_vit"], env={})
    require_device("smoke", "auto", ["text"], env={})
    require_device("paper", "cpu", ["data"], env={})  # data and figures need no device
    require_device("paper", "cpu", ["base.scale", "figures"], env={})
    require_device("paper", "cpu", ["crown"], env={ALLOW_CPU_ENV: "1"})


def test_nbrun_refuses_before_the_kernel_starts(tmp_path, venv_env):
    """The runner's one-line refusal, exit 2, at the committed paper params on this CPU."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    (tmp_path / "params.yaml").write_text((root / "params.yaml").read_text()
                                          .replace("device: auto ", "device: cpu  ", 1))
    (tmp_path / "nb.py").write_text('# %% tags=["parameters"]\ncrown = {}\n')
    env = {k: v for k, v in venv_env.items() if k != ALLOW_CPU_ENV}
    proc = subprocess.run([sys.executable, "-m", "attncert.pipeline.nbrun", "nb.py", "out.ipynb",
                           "--section", "crown"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0
    assert "paper scale would run on the CPU" in proc.stderr
    assert not (tmp_path / "out.ipynb").exists()


def test_gpu_ids_are_checked():
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(DeviceError, match="not visible"):
        check_gpu_ids([str(visible)], "paper", env={})
    if not visible:  # below the paper scale a machine without GPUs runs the workers on the CPU
        assert "CPU" in check_gpu_ids(["0", "1"], "smoke", env={})
    with pytest.raises(DeviceError, match="indices"):
        check_gpu_ids(["cuda:0"])
    with pytest.raises(DeviceError, match="repeat"):
        check_gpu_ids(["0", "0"])
    assert doctor.main(["--gpus", str(visible + 3)]) == 2  # the committed (paper) params


def test_cpu_workers_are_checked():
    """--cpu N: at least one worker, below the paper scale, base.device cpu or auto; a note
    when the workers ask for more threads than there are CPUs."""
    cores = len(os.sched_getaffinity(0))
    note = check_cpu_workers(2, "cpu", "auto", env={})
    assert CPU_WORKERS_NOTE in note and f"on {cores} CPU(s)" in note
    assert "more workers" in check_cpu_workers(cores + 1, "smoke", "cpu", env={})
    if cores >= 2:
        assert "base.threads 0 gives" in check_cpu_workers(2, "cpu", "cpu", threads=cores,
                                                           env={})
    with pytest.raises(DeviceError, match="at least 1"):
        check_cpu_workers(0, "cpu", "auto", env={})
    with pytest.raises(DeviceError, match="see no GPU"):
        check_cpu_workers(2, "cpu", "cuda", env={})
    with pytest.raises(DeviceError, match="paper scale would run on the CPU"):
        check_cpu_workers(2, "paper", "auto", env={})
    assert CPU_WORKERS_NOTE in check_cpu_workers(2, "paper", "auto", env={ALLOW_CPU_ENV: "1"})
    assert doctor.main(["--cpu-workers", "2"]) == 2  # the committed (paper) params


def test_doctor_reports_and_steps_every_model_kind():
    rows = dict(doctor.report())
    assert rows["torch"] == torch.__version__
    assert "GPUs" in rows or "cuda:0" in rows
    steps = doctor.model_steps(_smoke_params(), "cpu", batch=2)
    assert {r["model"] for r in steps} >= {"lipschitz ViT (train_vit)", "OLSA text",
                                          "SpecFormer (MSVP)", "LoFAST text"}
    assert all(r["ms_per_step"] > 0 and r["device"] == "cpu" for r in steps)


def _smoke_params():
    """The smoke profile's shapes (the doctor's steps at the paper shapes take minutes here)."""
    from pathlib import Path

    from attncert.pipeline import profile
    from attncert.pipeline.params import read_yaml
    from attncert.stages.registry import validate

    root = Path(__file__).resolve().parents[1]
    tree = read_yaml(root / "params.yaml")
    for key, value in profile.flatten(profile.overrides("smoke", root)).items():
        *parents, leaf = key.split(".")
        node = tree
        for part in parents:
            node = node[part]
        node[leaf] = value
    return validate(tree, "smoke params")


def test_a_paper_run_on_too_little_disk_is_refused_and_fp64_is_measured():
    from attncert.pipeline.doctor import ALLOW_LOW_DISK_ENV, PAPER_DISK_GB, check_disk, fp64_row

    with pytest.raises(DeviceError, match=f"needs about {PAPER_DISK_GB:.0f} GB"):
        check_disk("paper", env={}, free_gb=PAPER_DISK_GB - 1)
    assert "needs about" in check_disk("paper", env={ALLOW_LOW_DISK_ENV: "1"}, free_gb=10.0)
    assert "needs" not in check_disk("smoke", env={}, free_gb=1.0)
    assert check_disk("paper", env={}, free_gb=PAPER_DISK_GB + 1).startswith(
        f"{PAPER_DISK_GB + 1:.0f} GB free")
    row = fp64_row("cpu", n=128)
    assert row.startswith("float64 ") and "float32" in row
