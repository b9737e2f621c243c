"""dvc.yaml, the runner's sections and each notebook's parameters cell agree, for every stage
(every grid point of a matrix stage)."""

import ast
import shlex
from pathlib import Path

import pytest

from attncert import report, runs
from attncert.nbrun import declared_parameters, parse_items, read_notebook
from attncert.params import load_params

ROOT = Path(__file__).resolve().parents[1]
PARAMS = load_params(ROOT / report.PARAMS_FILE)
STAGES = report.read_stages(ROOT / report.DVC_FILE)


def _resolve(text: str, item: dict | None = None) -> str:
    return report.resolve(text, PARAMS, item)


def _dvc_name(run: report.StageRun) -> str:
    """The stage's name as DVC expands it (``train_vit@mnist-1-2-0.5``)."""
    return f"{run.stage}@{'-'.join(map(str, run.item.values()))}" if run.item else run.stage


# (stage name, spec, item) for every stage and every matrix item, as DVC expands them
EXPANDED = [(_dvc_name(r), STAGES[r.stage], dict(r.item))
            for r in report.stage_runs(STAGES, PARAMS)]
IDS = [e[0] for e in EXPANDED]


def _names_raw(entries) -> list[str]:
    out = []
    for e in entries or []:
        out.extend(e.keys() if isinstance(e, dict) else [e])
    return out


def _names(entries, item) -> list[str]:
    return [_resolve(x, item) for x in _names_raw(entries)]


def _runner_args(cmd: str):
    argv = shlex.split(cmd)
    i = argv.index("attncert.nbrun")
    assert argv[:i] == ["python", "-m"], cmd
    notebook, output, rest = argv[i + 1], argv[i + 2], argv[i + 3:]
    sections = [rest[j + 1] for j, a in enumerate(rest) if a == "--section"]
    items = [rest[j + 1] for j, a in enumerate(rest) if a == "--item"]
    return notebook, output, sections, items


@pytest.mark.parametrize(("stage", "spec", "item"), EXPANDED, ids=IDS)
def test_stage_sections_params_and_notebook_agree(stage, spec, item):
    notebook, output, sections, items = _runner_args(_resolve(spec["cmd"], item))
    PARAMS.flat(sections, parse_items(items))  # the item is a valid grid point
    # DVC tracks every section passed, except the grid lists of a matrix stage (a new grid
    # value must not rerun the existing points): those sections appear by their other keys.
    expected = []
    for s in sections:
        lists = [k for k, v in PARAMS.flat([s]).items() if isinstance(v, list)]
        if "." not in s and set(lists) & set(parse_items(items)):
            expected += [f"{s}.{k}" for k in PARAMS.flat([s]) if k not in lists]
        else:
            expected.append(s)
    assert sorted(expected) == sorted(_names(spec.get("params"), item)), (
        f"{stage}: --section list and dvc.yaml params differ")
    nb = read_notebook(ROOT / notebook)
    passed = PARAMS.notebook_parameters(sections, declared_parameters(nb), parse_items(items))
    assert sorted(declared_parameters(nb)) == sorted(passed), (
        f"{stage}: notebook parameters and params.yaml sections differ")
    assert notebook in _names(spec["deps"], item)
    assert output.startswith("reports/notebooks/") and output in _names(spec["outs"], item)


@pytest.mark.parametrize(("stage", "spec", "item"), EXPANDED, ids=IDS)
def test_declared_paths_exist(stage, spec, item):
    produced = [p for _, s, it in EXPANDED
                for p in _names(s.get("outs"), it) + _names(s.get("metrics"), it)]
    for dep in _names(spec["deps"], item):
        # a dependency is an output, inside one, or a folder of outputs (figures: results/vit)
        made = any(dep == p or dep.startswith(p + "/") or p.startswith(dep + "/")
                   for p in produced)
        assert made or (ROOT / dep).exists(), f"{stage}: dependency {dep} missing"


#: grid points beyond params.yaml's grid: a float written "1.0", a two-digit depth
OTHER_POINTS = [{"dataset": "svhn", "depth": 12, "heads": 1, "gamma_vo": 1.0},
                {"dataset": "cifar100", "depth": 3, "heads": 16, "gamma_vo": 0.125}]


def _item_paths(spec, item) -> list[str]:
    """A matrix stage's paths that name the grid point: every out, metric and plot, and the
    cmd's arguments and deps that use every item key."""
    whole = [p for p in shlex.split(spec["cmd"]) + _names_raw(spec["deps"])
             if all(f"${{item.{k}}}" in p for k in item)]
    return whole + [p for f in ("outs", "metrics", "plots") for p in _names_raw(spec.get(f))]


GRID_CASES = ([e for e in EXPANDED if e[2]]
              + [(f"{n}@other{i}", s, p) for n, s in STAGES.items() if "matrix" in s
                 for i, p in enumerate(OTHER_POINTS)])


@pytest.mark.parametrize(("stage", "spec", "item"), GRID_CASES, ids=[c[0] for c in GRID_CASES])
def test_grid_paths_follow_run_name(stage, spec, item):
    """dvc.yaml's ${item.*} path template is the one attncert.runs.run_name builds."""
    name = runs.run_name(**item)
    paths = [_resolve(p, item) for p in _item_paths(spec, item)]
    assert paths, f"{stage}: no path names the grid point"
    bad = [p for p in paths if f"/{name}/" not in p and not p.endswith(f"/{name}.ipynb")]
    assert not bad, f"{stage}: {bad} do not name the grid point {name} as runs.run_name does"


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
