"""scripts/gpu-session: the measurements a short GPU lease should make, each step skipped when
the budget left is below its estimate; without CUDA it stops before any step."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a python3 that has CUDA for the checks and records every other call instead of running it
FAKE = """#!/usr/bin/env bash
case "$*" in
  -c*) exit 0 ;;
  *) echo "$*" >>"$CALLS"; sleep "${STEP_SECONDS:-0}" ;;
esac
"""


def _session(tmp_path, budget, **env):
    fake = tmp_path / "python3"
    fake.write_text(FAKE)
    fake.chmod(0o755)
    calls = tmp_path / "calls.txt"
    out = tmp_path / "out"
    proc = subprocess.run([str(ROOT / "scripts/gpu-session"), str(budget), str(out)],
                          env={**os.environ, "PYTHON": str(fake), "CALLS": str(calls), **env},
                          capture_output=True, text=True, timeout=120)
    lines = calls.read_text().splitlines() if calls.exists() else []
    return proc, lines, (out / "summary.txt").read_text()


def test_every_step_runs_within_a_budget_that_holds_them(tmp_path):
    proc, calls, summary = _session(tmp_path, 600)
    assert proc.returncode == 0, proc.stderr
    assert [c.split()[1] for c in calls] == ["attncert.cost", "pytest", "attncert.cost",
                                             "attncert.pipeline.doctor", "attncert.cost"]
    crown, bench = calls[0], calls[2]
    assert crown.split()[2] == "crown" and "--bound-batch 4" in crown and "--write" in crown
    assert "--write-compile" in bench and "--kinds" in bench
    assert bench.index("PGD training") < bench.index("OLSA text") < bench.index("PGD audit")
    concurrency = calls[4]
    assert "--concurrent 1 8" in concurrency and "--write-concurrency" in concurrency
    assert summary.count("exit 0") == 5


def test_a_short_budget_skips_the_steps_it_cannot_hold(tmp_path):
    proc, calls, summary = _session(tmp_path, 100)
    assert proc.returncode == 0
    assert [c.split()[1] for c in calls] == ["attncert.pipeline.doctor", "attncert.cost"]
    assert "crown: skipped" in summary and "tests: skipped" in summary
    assert "bench: skipped" in summary


def test_without_cuda_it_stops_before_any_step(tmp_path):
    proc = subprocess.run([str(ROOT / "scripts/gpu-session"), "600", str(tmp_path / "out")],
                          env={**os.environ, "PYTHON": sys.executable}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "out" / "crown.log").exists()
