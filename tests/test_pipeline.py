"""dvc.yaml, the runner's sections and each notebook's parameters cell agree, for every stage
(every grid point of a matrix stage)."""

import ast
import itertools
import re
import shlex
from pathlib import Path

import pytest

from attncert import runs
from attncert.nbrun import declared_parameters, parse_items, read_notebook
from attncert.params import load_params, read_yaml

ROOT = Path(__file__).resolve().parents[1]
DVC = read_yaml(ROOT / "dvc.yaml")
PARAMS = load_params(ROOT / "params.yaml")
STAGES = DVC["stages"]


def _lookup(ref: str, item: dict):
    section, key = ref.split(".")
    if section == "item":
        return item[key]
    return getattr(PARAMS[section], key)


def _resolve(text: str, item: dict | None = None) -> str:
    """Substitute ${section.key} and ${item.key} templates, as DVC does."""
    return re.sub(r"\$\{([^}]+)\}", lambda m: str(_lookup(m.group(1), item or {})), text)


def _expanded():
    """(stage name, spec, item) for every stage and every matrix item (as DVC expands them)."""
    out = []
    for name, spec in STAGES.items():
        if "matrix" not in spec:
            out.append((name, spec, {}))
            continue
        keys = list(spec["matrix"])
        values = [_lookup(spec["matrix"][k].strip("${}"), {}) for k in keys]
        out += [(f"{name}@{'-'.join(map(str, combo))}", spec, dict(zip(keys, combo, strict=True)))
                for combo in itertools.product(*values)]
    return out


EXPANDED = _expanded()
IDS = [e[0] for e in EXPANDED]


def _names(entries, item) -> list[str]:
    out = []
    for e in entries or []:
        out.extend(e.keys() if isinstance(e, dict) else [e])
    return [_resolve(x, item) for x in out]


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
    values = PARAMS.flat(sections, parse_items(items))  # the item is a valid grid point
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
    assert sorted(declared_parameters(nb)) == sorted(values), (
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


def test_grid_paths_follow_run_name():
    """dvc.yaml's ${item.*} path template is the one attncert.runs.run_name builds."""
    for _, spec, item in EXPANDED:
        if item:
            name = runs.run_name(**item)
            outs = _names(spec["outs"], item)
            assert any(f"/{name}/" in p or p.endswith(f"/{name}.ipynb") for p in outs)
            assert all(name in p for p in outs)


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
