"""The notebook runner: typed parameters, and errors before any cell runs."""

import json
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

from attncert.pipeline.nbrun import (
    NotebookError,
    check_parameters,
    declared_parameters,
    read_notebook,
)

ROOT = Path(__file__).resolve().parents[1]

NOTEBOOK = '''# %% tags=["parameters"]
params_file = "params.yaml"

# %%
import json, pathlib
from attncert.stages import data as stage
from attncert.pipeline.context import setup
p, ctx = setup(stage, params_file, base=False, device=False)
pathlib.Path(p.metrics).write_text(json.dumps({k: [type(v).__name__, v] for k, v in dict(
    datasets=p.datasets, max_train=p.max_train, download=p.download,
    grid_per_class=p.grid_per_class, processed_dir=ctx.processed_dir).items()}))
'''


@pytest.fixture
def project(tmp_path):
    (tmp_path / "params.yaml").write_text((ROOT / "params.yaml").read_text())
    (tmp_path / "nb.py").write_text(NOTEBOOK)
    return tmp_path


def _set(project, old, new):
    p = project / "params.yaml"
    text = p.read_text()
    assert old in text
    p.write_text(text.replace(old, new, 1))


def _run(project, venv_env, *extra):
    cmd = [sys.executable, "-m", "attncert.pipeline.nbrun", "nb.py", "out.ipynb", "--section",
           "data", *extra]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=project, env=venv_env, capture_output=True, text=True)
    return proc, time.perf_counter() - t0


def test_the_notebook_reads_its_typed_section(project, venv_env):
    """nbrun passes the params file; the notebook's setup reads its own section, typed."""
    _set(project, "metrics: reports/metrics/data.json", "metrics: seen.json")
    _set(project, "max_train: 0 ", "max_train: 12 ")
    proc, _ = _run(project, venv_env)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((project / "seen.json").read_text())
    assert seen["max_train"] == ["int", 12]
    assert seen["download"] == ["bool", True]
    assert seen["datasets"][0] == "list" and "sst2" in seen["datasets"][1]
    assert seen["processed_dir"] == ["str", "data/processed"]
    nb = nbformat.read(project / "out.ipynb", 4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)


GRID = '''# %% tags=["parameters"]
params_file = "params.yaml"
point = {}

# %%
import json, pathlib
from attncert.stages import train_vit as stage
from attncert.pipeline.context import setup
p, ctx = setup(stage, params_file, point=point, device=False)
pathlib.Path("seen.json").write_text(json.dumps({"point": point, "name": ctx.point.name,
                                                 "depth": ctx.point.depth, "dim": p.vit.dim}))
'''


def test_a_grid_point_reaches_the_notebook(project, venv_env):
    """``--item`` pairs are checked against the grid before the kernel starts and reach the
    notebook as ``point``; setup makes the typed grid point from them."""
    venv_env = {**venv_env, "ATTNCERT_ALLOW_CPU_PAPER": "1"}  # the paper params on this CPU
    (project / "nb.py").write_text(GRID)
    items = ["--item", "dataset=svhn", "--item", "depth=3", "--item", "heads=4", "--item",
             "gamma_vo=0.5"]
    proc, _ = _run(project, venv_env, "--section", "vit_grid", "--section", "train_vit", *items)
    assert proc.returncode == 0, proc.stderr
    seen = json.loads((project / "seen.json").read_text())
    assert seen["point"] == {"dataset": "svhn", "depth": "3", "heads": "4", "gamma_vo": "0.5"}
    assert seen["name"] == "svhn-L3-H4-vo0.5" and seen["depth"] == 3 and seen["dim"] == 384
    proc, _ = _run(project, venv_env, "--section", "vit_grid", *items[:-2], "--item",
                   "gamma_vo=0.3")
    assert proc.returncode == 2 and "gamma_vo=0.3: not in vit_grid.gamma_vo" in proc.stderr
    (project / "nb.py").write_text(GRID.replace("point = {}\n", ""))
    proc, _ = _run(project, venv_env, "--section", "vit_grid", *items)
    assert proc.returncode == 2 and "'point' is passed but not declared" in proc.stderr


@pytest.mark.parametrize(
    "old,new,key",
    [
        ("  max_train: 0 ", "  max_trian: 0 ", "data.max_trian"),
        ("  max_train: 0 ", "  max_train: '1e3' ", "data.max_train"),
        ("  max_train: 0 ", "  max_train: -3 ", "data.max_train"),
        ("imagenette, sst2,", "imagenette, sst3,", "data.datasets"),
        ("  device: auto ", "  device: tpu ", "base.device"),
        ("cert_eps: [0.01, 0.03,", "cert_eps: [-0.01, 0.03,", "tightness.cert_eps"),
        ("  attack_steps: 300", "  attack_steps: 3e2", "tightness.attack_steps"),
    ],
)
def test_bad_params_fail_before_execution(project, venv_env, old, new, key):
    _set(project, old, new)
    proc, seconds = _run(project, venv_env)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], proc.stderr
    assert not (project / "out.ipynb").exists()
    assert seconds < 20


def test_unknown_section_is_an_error(project, venv_env):
    proc, _ = _run(project, venv_env, "--section", "trian")
    assert proc.returncode == 2 and "trian: unknown section" in proc.stderr


def test_notebook_must_declare_what_is_passed(project, venv_env):
    (project / "nb.py").write_text(NOTEBOOK.replace('params_file = "params.yaml"\n', "x = 1\n"))
    proc, _ = _run(project, venv_env)
    assert proc.returncode == 2 and "'params_file' is passed but not declared" in proc.stderr


def test_declared_parameters(tmp_path):
    p = tmp_path / "nb.py"
    p.write_text('# %% tags=["parameters"]\na = 1\nb: int = 2\n\n# %%\nc = 3\n')
    nb = read_notebook(p)
    assert declared_parameters(nb) == ["a", "b"]
    with pytest.raises(NotebookError, match="'a' is not passed"):
        check_parameters(nb, {"b": 2}, "nb.py")
    p.write_text("# %%\na = 1\n")
    with pytest.raises(NotebookError, match="exactly one cell tagged 'parameters'"):
        declared_parameters(read_notebook(p))


CONSOLE = '''# %% tags=["parameters"]
params_file = ""

# %%
import warnings
import tqdm.auto  # transformers and datasets import it: "IProgress not found" without ipywidgets
from attncert.pipeline import progress
progress.LINE_SECONDS = 0.2   # a plain line every 0.2 s: this loop lasts about a second
print("the report's own output")
for _ in progress.bar(range(10), desc="slow loop"):
    __import__("time").sleep(0.1)
progress.write("a console message")
'''


def test_progress_goes_to_the_console_not_the_report(project, venv_env):
    """The console (not a terminal here: CI, a log) shows the notebook's start and end with its
    time and the loop's progress as whole lines; the report holds the notebook's own output
    and none of the progress, and no kernel notice or WARNING line reaches the console."""
    (project / "nb.py").write_text(CONSOLE)
    proc, _ = _run(project, venv_env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0] == "nbrun: nb: started" and lines[-1].startswith("nbrun: nb: done in ")
    loop = [ln for ln in lines if ln.startswith("slow loop:")]
    assert loop and loop[-1].startswith("slow loop: 100%") and "10/10" in loop[-1]
    assert len(loop) < 10, "whole lines at most every LINE_SECONDS, not one per update"
    assert "a console message" in lines
    assert "\r" not in proc.stderr and "WARNING" not in proc.stderr
    assert "encryption" not in proc.stderr and "IProgress" not in proc.stderr
    assert "the report's own output" not in proc.stdout + proc.stderr
    nb = nbformat.read(project / "out.ipynb", 4)
    outputs = [o for c in nb.cells for o in c.get("outputs", [])]
    texts = "".join(o.get("text", "") for o in outputs)
    assert "the report's own output" in texts
    assert "slow loop" not in texts and "console message" not in texts
    assert not any(o.get("name") == "stderr" for o in outputs), "no stderr block in the report"


def test_progress_lines_and_heartbeat(tmp_path, monkeypatch):
    """Off a terminal: a loop shorter than LINE_SECONDS writes nothing, a longer one whole
    lines; the relay prints a heartbeat after a silence and copies what the kernel wrote."""
    import io

    from attncert.pipeline import progress

    console = tmp_path / "console.log"
    console.write_text("")
    monkeypatch.setenv(progress.CONSOLE_ENV, str(console))
    monkeypatch.setenv(progress.TTY_ENV, "0")
    monkeypatch.setattr(progress, "LINE_SECONDS", 0.05)
    for _ in progress.bar(range(3), desc="quick"):
        pass
    assert console.read_text() == ""
    for _ in progress.bar(range(4), desc="slow"):
        time.sleep(0.05)
    text = console.read_text()
    assert "\r" not in text and text.splitlines()[-1].startswith("slow: 100%")
    out = io.StringIO()
    with progress.Relay(str(console), out, "nbrun: x", heartbeat=0.1, poll=0.02):
        time.sleep(0.3)
    assert out.getvalue().startswith(text) and "nbrun: x: running," in out.getvalue()
    assert progress.elapsed(42) == "42 s" and progress.elapsed(185) == "3 min 05 s"
    assert progress.elapsed(7620) == "2 h 07 min"


def test_the_runner_does_not_import_what_only_drawing_or_compiling_needs():
    """The runner validates the whole params file, importing every stage, before each notebook:
    seaborn (with scipy) and ``torch._dynamo`` load only where a figure draws or a run compiles
    (about three of the runner's seven seconds of imports on a 2-core machine)."""
    code = ("import sys, attncert.pipeline.nbrun, attncert.stages.registry; "
            "print(sorted(m for m in ('seaborn', 'scipy', 'torch._dynamo') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
    from attncert.figures import sns

    assert callable(sns.color_palette)  # loaded at first use
