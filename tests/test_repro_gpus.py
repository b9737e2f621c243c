"""scripts/repro-gpus: units longest first to a pool of one worker per GPU; a failing unit
does not stop the others, and the run exits non-zero naming it; a failing cost model stops the
run before any unit; ids index an inherited CUDA_VISIBLE_DEVICES; stale units rerun through
the pool."""

import os
import subprocess
from pathlib import Path

from checkout import commit_all, copy_worktree

from attncert.pipeline import profile

FAKE_DVC = """#!/usr/bin/env bash
echo "CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES $*" >>"$DVC_LOG"
echo "${OMP_NUM_THREADS:-} ${MKL_NUM_THREADS:-} $*" >>"$DVC_LOG.threads"
case "$*" in
  "stage list --name-only")
    printf 'data\\ntrain_vit@mnist-1-2-0.5\\ncertify_vit@mnist-1-2-0.5\\nspecformer_runs@mnist\\n'
    printf 'specformer_certified\\nspecformer\\ntext_unit@sst2-olsa\\ntext\\ncertvit_main\\n'
    printf 'certvit_imagenet\\ncertvit\\n'
    printf 'crown_unit@mnist-3\\ncrown\\ntightness\\nfigures\\n' ;;
  "status --json")  # the i-th call prints line i of $DVC_STATUS (none: nothing stale)
    n=$(grep -c "status --json" "$DVC_LOG")
    if [ -n "${DVC_STATUS:-}" ]; then sed -n "${n}p" "$DVC_STATUS"; fi ;;
  *"--single-item ${FAIL_UNIT:-none}"*) echo "simulated failure" >&2; exit 1 ;;
esac
"""
FAKE_PYTHON = """#!/usr/bin/env bash
if [ "$*" = "-m attncert.cost order" ]; then echo "cost: simulated failure" >&2; exit 1; fi
exec "$REAL_PYTHON" "$@"
"""
UNITS = ["train_vit@mnist-1-2-0.5 certify_vit@mnist-1-2-0.5", "specformer_runs@mnist",
         "specformer_certified", "text_unit@sst2-olsa", "certvit_main", "certvit_imagenet",
         "crown_unit@mnist-3"]


def _run_with_fake_dvc(tmp_path, venv_env, *args, fail_order=False, **env_extra):
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
    if fail_order:
        (bin_dir / "python").write_text(FAKE_PYTHON)
        (bin_dir / "python").chmod(0o755)
        real = subprocess.run(["bash", "-c", "command -v python"], env=venv_env,
                              capture_output=True, text=True, check=True).stdout.strip()
        env_extra["REAL_PYTHON"] = real
    env = {**venv_env, "PATH": f"{bin_dir}{os.pathsep}{venv_env['PATH']}", "DVC_LOG": str(log),
           **env_extra}
    for key in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(key, None)
        if key in env_extra:
            env[key] = env_extra[key]
    proc = subprocess.run(["bash", "scripts/repro-gpus", *args], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=900)
    return repo, log, proc


def _ran(log) -> list[str]:
    return [c.split(" --single-item ", 1)[1] for c in log.read_text().splitlines()
            if "--single-item" in c]


def test_a_failing_unit_does_not_stop_the_others(tmp_path, venv_env):
    repo, log, proc = _run_with_fake_dvc(tmp_path, venv_env, "0", "1",
                                         FAIL_UNIT="text_unit@sst2-olsa")
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


def test_a_failing_cost_model_stops_the_run_before_any_unit(tmp_path, venv_env):
    """`cost order` raising must not leave every unit to the final repro on one GPU."""
    _, log, proc = _run_with_fake_dvc(tmp_path, venv_env, "0", "1", fail_order=True)
    assert proc.returncode != 0
    assert "cost: simulated failure" in proc.stderr
    calls = log.read_text()
    assert "repro" not in calls, calls  # neither a unit, nor data, nor the final repro


def test_ids_index_an_inherited_mask(tmp_path, venv_env):
    """With CUDA_VISIBLE_DEVICES inherited (UUID and MIG entries too), id k is its k-th entry."""
    mask = "GPU-aaaa, GPU-bbbb,MIG-cccc"
    _, log, proc = _run_with_fake_dvc(tmp_path, venv_env, "0", "2", CUDA_VISIBLE_DEVICES=mask)
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert sorted(_ran(log)) == sorted(UNITS)
    assert {c.split()[0] for c in calls if "--single-item" in c} == {
        "CUDA_VISIBLE_DEVICES=GPU-aaaa", "CUDA_VISIBLE_DEVICES=MIG-cccc"}
    assert calls[-1] == "CUDA_VISIBLE_DEVICES=GPU-aaaa repro"
    _, log, proc = _run_with_fake_dvc(tmp_path / "beyond", venv_env, "0", "3",
                                      CUDA_VISIBLE_DEVICES=mask)
    assert proc.returncode == 2 and "not an index of the inherited" in proc.stderr
    assert "repro" not in log.read_text()


def test_stale_units_rerun_through_the_pool(tmp_path, venv_env):
    """A unit stale after the pool (an edit during the run) runs through the pool again before
    the final repro; one still stale after that stops the run instead of running serially."""
    status = tmp_path / "status.txt"
    status.write_text('{"crown_unit@mnist-3": [{"changed deps": {}}], "crown": []}\n{}\n')
    _, log, proc = _run_with_fake_dvc(tmp_path / "once", venv_env, "0", "1",
                                      DVC_STATUS=str(status))
    assert proc.returncode == 0, proc.stderr
    assert "rerunning them through the pool" in proc.stderr
    assert sorted(_ran(log)) == sorted(UNITS + ["crown_unit@mnist-3"])
    assert log.read_text().splitlines()[-1].endswith(" repro")
    status.write_text('{"certvit_main": []}\n' * 2)
    _, log, proc = _run_with_fake_dvc(tmp_path / "twice", venv_env, "0", "1",
                                      DVC_STATUS=str(status))
    assert proc.returncode == 1 and "still stale after a second pass" in proc.stderr
    assert not any(c.endswith(" repro") for c in log.read_text().splitlines())


def _threads(log) -> dict[str, str]:
    """unit (or the first word of another dvc call) -> "OMP MKL" threads it ran with."""
    out = {}
    for line in Path(f"{log}.threads").read_text().splitlines():
        omp, mkl, call = line.split(" ", 2)
        out[call.split(" --single-item ", 1)[-1]] = f"{omp} {mkl}".strip()
    return out


def test_cpu_workers_share_the_cores(tmp_path, venv_env):
    """--cpu N: N workers that see no GPU (the data stage and the final repro neither), each
    with its share of the CPUs as OMP/MKL threads; a set OMP_NUM_THREADS is kept."""
    _, log, proc = _run_with_fake_dvc(tmp_path / "share", venv_env, "--cpu", "2",
                                      CUDA_VISIBLE_DEVICES="0")
    assert proc.returncode == 0, proc.stderr
    assert sorted(_ran(log)) == sorted(UNITS)
    assert {c.split()[0] for c in log.read_text().splitlines() if " repro" in c} == {
        "CUDA_VISIBLE_DEVICES="}
    share = str(max(1, len(os.sched_getaffinity(0)) // 2))
    threads = _threads(log)
    assert {threads[u] for u in UNITS} == {f"{share} {share}"}, threads
    assert f"2 workers on the CPU, OMP_NUM_THREADS={share} each" in proc.stderr
    _, log, proc = _run_with_fake_dvc(tmp_path / "set", venv_env, "--cpu", "2",
                                      OMP_NUM_THREADS="3")
    assert proc.returncode == 0, proc.stderr
    assert {_threads(log)[u] for u in UNITS} == {"3 3"}


def test_cpu_workers_refuse_bad_counts_before_any_work(tmp_path, venv_env):
    for i, args in enumerate((["--cpu", "0"], ["--cpu", "two"], ["--cpu"])):
        _, log, proc = _run_with_fake_dvc(tmp_path / str(i), venv_env, *args)
        assert proc.returncode == 2, proc.stderr
        assert ("at least 1" in proc.stderr) if args[1:] == ["0"] else ("usage" in proc.stderr)
        assert "repro" not in log.read_text()


def test_several_workers_per_gpu(tmp_path, venv_env):
    """--per-gpu K: K workers on each GPU id (GPUs in turn: the first units on different GPUs);
    a bad K or --per-gpu with --cpu is refused before any work."""
    _, log, proc = _run_with_fake_dvc(tmp_path / "two", venv_env, "--per-gpu", "2", "0", "1")
    assert proc.returncode == 0, proc.stderr
    assert sorted(_ran(log)) == sorted(UNITS)
    assert "workers on CUDA_VISIBLE_DEVICES 0 1 0 1" in proc.stderr
    assert {c.split()[0] for c in log.read_text().splitlines() if "--single-item" in c} <= {
        "CUDA_VISIBLE_DEVICES=0", "CUDA_VISIBLE_DEVICES=1"}
    for i, args in enumerate((["--per-gpu", "0", "0"], ["--per-gpu", "2"],
                              ["--per-gpu", "2", "--cpu", "2"])):
        _, log, proc = _run_with_fake_dvc(tmp_path / str(i), venv_env, *args)
        assert proc.returncode == 2 and "usage" in proc.stderr, proc.stderr
        assert "repro" not in log.read_text()
