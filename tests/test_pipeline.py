"""dvc.yaml, the runner's sections and each notebook's parameters cell agree, for every stage
(every grid point of a matrix stage)."""

import ast
import importlib
import re
import shlex
from pathlib import Path

import pytest

from attncert.pipeline import runs
from attncert.pipeline.nbrun import declared_parameters, parse_items, read_notebook
from attncert.pipeline.params import BASE_RUNTIME
from attncert.pipeline.shapes import VIT_SECTION, uses_presets
from attncert.report import rows as report
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]
PARAMS = load_params(ROOT / report.PARAMS_FILE)
STAGES = report.read_stages(ROOT / report.DVC_FILE)


def _resolve(text: str, item: dict | None = None, key: str | None = None) -> str:
    return report.resolve(text, PARAMS, item, key)


def _dvc_name(run: report.StageRun) -> str:
    """The stage's name as DVC expands it (``train_vit@mnist-1-2-0.5``)."""
    return f"{run.stage}@{run.key}" if run.item else run.stage


# (stage name, spec, item, key) for every stage and every matrix item, as DVC expands them
RUNS = report.stage_runs(STAGES, PARAMS)
EXPANDED = [(_dvc_name(r), STAGES[r.stage], dict(r.item)) for r in RUNS]
EXPANDED_KEYS = {_dvc_name(r): r.key for r in RUNS}
IDS = [e[0] for e in EXPANDED]


def _names_raw(entries) -> list[str]:
    out = []
    for e in entries or []:
        out.extend(e.keys() if isinstance(e, dict) else [e])
    return out


def _names(entries, item, key=None) -> list[str]:
    return [_resolve(x, item, key) for x in _names_raw(entries)]


def _runner_args(cmd: str):
    argv = shlex.split(cmd)
    i = argv.index("attncert.pipeline.nbrun")
    assert argv[:i] == ["python", "-m"], cmd
    notebook, output, rest = argv[i + 1], argv[i + 2], argv[i + 3:]
    sections = [rest[j + 1] for j, a in enumerate(rest) if a == "--section"]
    items = [rest[j + 1] for j, a in enumerate(rest) if a == "--item"]
    return notebook, output, sections, items


def _unit(cmd: str) -> dict[str, str]:
    """The ``--unit`` nbrun passes as the notebook's ``unit`` parameter ({} without one)."""
    argv = shlex.split(cmd)
    return {"unit": argv[argv.index("--unit") + 1]} if "--unit" in argv else {}


@pytest.mark.parametrize(("stage", "spec", "item"), EXPANDED, ids=IDS)
def test_stage_sections_params_and_notebook_agree(stage, spec, item):
    key = EXPANDED_KEYS[stage]
    cmd = _resolve(spec["cmd"], item, key)
    notebook, output, sections, items = _runner_args(cmd)
    PARAMS.grid_point(sections, parse_items(items))  # raises unless a valid grid point
    # DVC tracks every section passed, except the grid lists of a matrix stage (a new grid
    # value must not rerun the existing points): those sections appear by their other keys.
    expected = []
    for s in sections:
        lists = [k for k, v in PARAMS.fields(s).items() if isinstance(v, list)]
        if s == "base":  # its runtime keys (threads) are no stage's param
            expected += [f"base.{k}" for k in PARAMS.fields(s) if k not in BASE_RUNTIME]
        elif "." not in s and set(lists) & set(parse_items(items)):
            expected += [f"{s}.{k}" for k in PARAMS.fields(s) if k not in lists]
        else:
            expected.append(s)
    assert sorted(expected) == sorted(_names(spec.get("params"), item, key)), (
        f"{stage}: --section list and dvc.yaml params differ")
    nb = read_notebook(ROOT / notebook)
    passed = {"params_file", *_unit(cmd), *(["point"] if items else [])}
    assert sorted(declared_parameters(nb)) == sorted(passed), (
        f"{stage}: the notebook's parameters and what nbrun passes differ")
    # the sections the notebook's stage module reads are the ones DVC tracks
    module = re.search(r"^from attncert\.stages import (\w+) as stage$",
                       "\n".join(c.source for c in nb.cells), re.M)
    assert module, f"{notebook}: imports no stage module as `stage`"
    mod = importlib.import_module(f"attncert.stages.{module.group(1)}")
    reads = {mod.SECTION, *getattr(mod, "SECTIONS", {})} | ({"base"} if mod.SECTION != "data"
                                                            else set())
    if any(map(uses_presets, [mod.Params, *getattr(mod, "SECTIONS", {}).values()])):
        reads.add(VIT_SECTION)  # a section names a shape of the vit section
    tracked = {s.split(".")[0] for s in sections}
    assert reads <= tracked, f"{stage}: reads {sorted(reads - tracked)} untracked"
    assert notebook in _names(spec["deps"], item, key)
    assert output.startswith("reports/notebooks/") and output in _names(spec["outs"], item, key)


@pytest.mark.parametrize(("stage", "spec", "item"), EXPANDED, ids=IDS)
def test_declared_paths_exist(stage, spec, item):
    produced = [p for name, s, it in EXPANDED
                for p in (_names(s.get("outs"), it, EXPANDED_KEYS[name])
                          + _names(s.get("metrics"), it, EXPANDED_KEYS[name]))]
    for dep in _names(spec["deps"], item, EXPANDED_KEYS[stage]):
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


#: the ViT grid's matrix stages (train_vit, certify_vit): their paths name the grid point
GRID_KEYS = {"dataset", "depth", "heads", "gamma_vo"}
GRID_CASES = ([e for e in EXPANDED if set(e[2]) == GRID_KEYS]
              + [(f"{n}@other{i}", s, p) for n, s in STAGES.items()
                 if set(s.get("matrix", ())) == GRID_KEYS for i, p in enumerate(OTHER_POINTS)])


@pytest.mark.parametrize(("stage", "spec", "item"), GRID_CASES, ids=[c[0] for c in GRID_CASES])
def test_grid_paths_follow_run_name(stage, spec, item):
    """dvc.yaml's ${item.*} path template is the one attncert.pipeline.runs.run_name builds."""
    name = runs.run_name(**item)
    paths = [_resolve(p, item) for p in _item_paths(spec, item)]
    assert paths, f"{stage}: no path names the grid point"
    bad = [p for p in paths if f"/{name}/" not in p
           and not p.endswith((f"/{name}.ipynb", f"/{name}.json"))]
    assert not bad, f"{stage}: {bad} do not name the grid point {name} as runs.run_name does"


def test_notebooks_are_numbered_in_pipeline_order():
    """Stages in notebook order; a number is one step (its units, then what gathers them)."""
    names = [Path(_runner_args(s["cmd"])[0]).name for s in STAGES.values()]
    numbers = [int(n[:2]) for n in names]
    assert numbers == sorted(numbers)
    for k in {n[:2] for n in names}:  # one step: NN_<stage>.py and its units' NN_<stage>_*.py
        step = sorted({n for n in names if n[:2] == k}, key=len)
        assert all(n.startswith(step[0].removesuffix(".py")) for n in step), step
    on_disk = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.py"))
    declared = sorted(set(names))
    assert on_disk == declared, "every notebook belongs to a stage"


@pytest.mark.parametrize("path", sorted((ROOT / "notebooks").glob("*.py")), ids=lambda p: p.name)
def test_notebooks_are_thin(path):
    """No function or class definitions in notebooks: they belong in src/attncert."""
    tree = ast.parse(path.read_text())
    defs = [n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defs, f"{path.name} defines {defs}"
