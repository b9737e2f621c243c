"""The stage contract (attncert.stages): one module per dvc.yaml stage, owning its section,
its ``run(p, ctx)`` and its headline rows; notebooks only take their sections, set up the
context once and call ``run``."""

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import pkgutil
import re
import types
import typing
from pathlib import Path

import pytest

from attncert import stages
from attncert.pipeline.records import SplitRun
from attncert.report import rows as report
from attncert.stages import registry

ROOT = Path(__file__).resolve().parents[1]
STAGES = report.read_stages(ROOT / report.DVC_FILE)
MOVED = [s for s in stages.STAGES if importlib.util.find_spec(f"attncert.stages.{s}")]


def test_stage_names_are_dvc_yaml_s():
    assert stages.STAGES == tuple(s for s in STAGES if s not in stages.UNIT_STAGES)
    assert set(stages.UNIT_STAGES) <= set(STAGES)


@pytest.mark.parametrize("unit_stage", sorted(stages.UNIT_STAGES))
def test_a_unit_stage_runs_its_stage_module_s_unit(unit_stage):
    """A unit stage's notebook calls ``run`` of the module of the stage that gathers it (with
    the unit as ``ctx.item``), which runs after it in dvc.yaml."""
    owner = stages.UNIT_STAGES[unit_stage]
    notebook = next(w for w in STAGES[unit_stage]["cmd"].split() if w.startswith("notebooks/"))
    text = (ROOT / notebook).read_text()
    assert f"from attncert.stages import {owner} as stage" in text and "stage.run(" in text
    assert re.search(r"setup\(stage, params_file, unit=(unit|stage\.[A-Z]+)\)", text), (
        f"{notebook} does not pass its unit to setup")
    assert list(STAGES).index(unit_stage) < list(STAGES).index(owner)


def _stage_modules() -> list[str]:
    """The package's modules but the registry of their sections."""
    return sorted(m.name for m in pkgutil.iter_modules(stages.__path__) if m.name != "registry")


def test_every_stage_module_is_a_stage():
    assert _stage_modules() == sorted(stages.STAGES)


@pytest.mark.parametrize("stage", _stage_modules())
def test_one_run_signature(stage):
    """Every stage module: ``run(p, ctx)`` and no other public runner; ``SECTION`` names the
    params.yaml section its ``Params`` parses."""
    mod = importlib.import_module(f"attncert.stages.{stage}")
    sig = inspect.signature(mod.run)
    assert list(sig.parameters) == ["p", "ctx"], f"{stage}.run{sig}"
    hints = inspect.get_annotations(mod.run, eval_str=True)
    assert hints["p"] is mod.Params and hints["ctx"].__name__ == "Context"
    ret = hints["return"]  # one result type: no union of a unit's and a gathering's, no tuple
    assert typing.get_origin(ret) not in (typing.Union, types.UnionType, tuple) and ret is not tuple
    if stage in stages.UNIT_STAGES.values():
        assert typing.get_origin(ret) is SplitRun, f"{stage}.run returns {ret}, not a SplitRun"
    others = [n for n, f in vars(mod).items() if n.startswith("run") and n != "run"
              and inspect.isfunction(f) and f.__module__ == mod.__name__]
    assert not others, f"{stage} has other runners {others}"
    assert mod.SECTION == stage and dataclasses.is_dataclass(mod.Params)


@pytest.mark.parametrize("stage", MOVED)
def test_a_stage_module_owns_run_and_rows(stage):
    mod = importlib.import_module(f"attncert.stages.{stage}")
    assert callable(mod.run)
    if stage != "figures":  # the summary of every other stage's rows has no rows of its own
        assert callable(mod.headline_rows)
        assert report.READERS[stage] is mod.headline_rows, "the report reads the stage's own rows"
    owned = [n for n, e in registry.SECTIONS.items() if e is getattr(mod, "Params", None)]
    if hasattr(mod, "Params"):
        assert owned == [stage], f"registry.SECTIONS does not register {stage}.Params"
        assert dataclasses.is_dataclass(mod.Params)


@pytest.mark.parametrize("stage", MOVED)
def test_the_notebook_holds_no_plan(stage):
    """No def, class, loop over work or write in the stage's notebook: it calls ``run``."""
    cmd = STAGES[stage]["cmd"]
    notebook = next(w for w in cmd.split() if w.startswith("notebooks/"))
    tree = ast.parse((ROOT / notebook).read_text())
    defs = [n.name for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert not defs, f"{notebook} defines {defs}"
    calls = {n.func.attr for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert "run" in calls, f"{notebook} does not call its stage's run"
    assert not calls & {"write_json", "write_text", "save"}, f"{notebook} writes files itself"


#: table work a notebook leaves to the package: reshaping, grouping, joining, summarising
TABLE_WORK = {"pivot_table", "pivot", "groupby", "concat", "merge", "unstack",
              "describe", "agg", "mul", "div"}


@pytest.mark.parametrize("notebook", sorted(p.name for p in (ROOT / "notebooks").glob("*.py")))
def test_the_notebook_computes_no_table(notebook):
    """Notebooks load, call and show: a stage's tables and ratios come from the package."""
    tree = ast.parse((ROOT / "notebooks" / notebook).read_text())
    calls = {n.func.attr for n in ast.walk(tree)
             if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
    assert not calls & TABLE_WORK, f"{notebook} computes tables itself: {calls & TABLE_WORK}"
