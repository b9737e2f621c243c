"""scripts/repro-gpus: units longest first to a pool of one worker per GPU; a failing unit
does not stop the others, and the run exits non-zero naming it."""

import os
import subprocess
from pathlib import Path

from checkout import commit_all, copy_worktree

from attncert.pipeline import profile

FAKE_DVC = """#!/usr/bin/env bash
echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*" >>"$DVC_LOG"
case "$*" in
  "stage list --name-only")
    printf 'data\\ntrain_vit@mnist-1-2-0.5\\ncertify_vit@mnist-1-2-0.5\\nspecformer_runs@mnist\\n'
    printf 'specformer_certified\\nspecformer\\ntext_unit@sst2-olsa\\ntext\\ncertvit_main\\n'
    printf 'certvit_imagenet\\ncertvit\\n'
    printf 'crown_unit@mnist-3\\ncrown\\ntightness\\nfigures\\n' ;;
  *"--single-item text_unit@sst2-olsa"*) echo "text: simulated failure" >&2; exit 1 ;;
esac
"""


def _run_with_fake_dvc(tmp_path, venv_env, *args):
    """scripts/repro-gpus ``args`` in a smoke-scale copy of the repository, with the fake dvc
    above on PATH (no GPU here: below the paper scale the workers use the CPU; small shapes
    keep the cost estimate behind the order to seconds): (repo, dvc call log, process)."""
    repo = copy_worktree(tmp_path / "repo")
    commit_all(repo, "snapshot")
    profile.apply("smoke", repo)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dvc").write_text(FAKE_DVC)
    (bin_dir / "dvc").chmod(0o755)
    log = tmp_path / "dvc.log"
    log.touch()
    env = {**venv_env, "PATH": f"{bin_dir}{os.pathsep}{venv_env['PATH']}", "DVC_LOG": str(log)}
    proc = subprocess.run(["bash", "scripts/repro-gpus", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)
    return repo, log, proc


def test_a_failing_unit_does_not_stop_the_others(tmp_path, venv_env):
    repo, log, proc = _run_with_fake_dvc(tmp_path, venv_env, "0", "1")
    assert proc.returncode == 1, proc.stderr
    assert "these units failed" in proc.stderr and "  text_unit@sst2-olsa" in proc.stderr
    calls = log.read_text().splitlines()
    ran = [c.split(" --single-item ", 1)[1] for c in calls if "--single-item" in c]
    assert sorted(ran) == sorted(["train_vit@mnist-1-2-0.5 certify_vit@mnist-1-2-0.5",
                                  "specformer_runs@mnist", "specformer_certified",
                                  "text_unit@sst2-olsa", "certvit_main", "certvit_imagenet",
                                  "crown_unit@mnist-3"])
    # the gathering stages (specformer, text, certvit, crown) wait for the final repro
    assert {c.split()[0] for c in calls if "--single-item" in c} <= {
        "CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"}  # one GPU per worker slot
    assert not any(c.endswith(" repro") for c in calls), "no final repro after a failure"
    assert Path(repo / "params.yaml").is_file()


def test_the_unit_list_for_several_nodes(tmp_path, venv_env):
    """--list prints every unit once, longest first, and runs nothing."""
    repo, log, proc = _run_with_fake_dvc(tmp_path, venv_env, "--list")
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.splitlines()) == sorted([
        "train_vit@mnist-1-2-0.5 certify_vit@mnist-1-2-0.5", "specformer_runs@mnist",
        "specformer_certified", "text_unit@sst2-olsa", "certvit_main", "certvit_imagenet",
        "crown_unit@mnist-3"])
    assert "repro" not in log.read_text()
