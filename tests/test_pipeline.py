"""dvc.yaml, the runner's sections and each notebook's parameters cell agree, for every stage."""

import ast
import re
import shlex
from pathlib import Path

import pytest

from attncert.nbrun import declared_parameters, read_notebook
from attncert.params import load_params, read_yaml

ROOT = Path(__file__).resolve().parents[1]
DVC = read_yaml(ROOT / "dvc.yaml")
PARAMS = load_params(ROOT / "params.yaml")
STAGES = DVC["stages"]


def _resolve(path: str) -> str:
    """Substitute ${section.key} templates from params.yaml, as DVC does."""
    def sub(m):
        section, key = m.group(1).split(".")
        return str(getattr(PARAMS[section], key))
    return re.sub(r"\$\{([^}]+)\}", sub, path)


def _names(entries) -> list[str]:
    out = []
    for e in entries or []:
        out.extend(e.keys() if isinstance(e, dict) else [e])
    return [_resolve(x) for x in out]


def _runner_args(cmd: str):
    argv = shlex.split(cmd)
    i = argv.index("attncert.nbrun")
    assert argv[:i] == ["python", "-m"], cmd
    notebook, output, rest = argv[i + 1], argv[i + 2], argv[i + 3:]
    sections = [rest[j + 1] for j, a in enumerate(rest) if a == "--section"]
    return notebook, output, sections


@pytest.mark.parametrize("stage", list(STAGES))
def test_stage_sections_params_and_notebook_agree(stage):
    spec = STAGES[stage]
    notebook, output, sections = _runner_args(spec["cmd"])
    assert sorted(sections) == sorted(_names(spec.get("params"))), (
        f"{stage}: --section list and dvc.yaml params differ")
    nb = read_notebook(ROOT / notebook)
    assert sorted(declared_parameters(nb)) == sorted(PARAMS.flat(sections)), (
        f"{stage}: notebook parameters and params.yaml sections differ")
    assert notebook in _names(spec["deps"])
    assert output.startswith("reports/notebooks/") and output in _names(spec["outs"])


@pytest.mark.parametrize("stage", list(STAGES))
def test_declared_paths_exist(stage):
    for dep in _names(STAGES[stage]["deps"]):
        produced = any(dep in _names(s.get("outs")) for s in STAGES.values())
        assert produced or (ROOT / dep).exists(), f"{stage}: dependency {dep} missing"


def test_notebooks_are_numbered_in_pipeline_order():
    numbers = [int(Path(_runner_args(s["cmd"])[0]).name[:2]) for s in STAGES.values()]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    declared = sorted(Path(_runner_args(s["cmd"])[0]).name for s in STAGES.values())
    assert on_disk == declared, "every notebook belongs to a stage"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.py")), ids=lambda p: p.name)
def test_notebooks_are_thin(path):
    """No function or class definitions in notebooks: they belong in src/attncert."""
    tree = ast.parse(path.read_text())
    defs = [n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defs, f"{path.name} defines {defs}"
