"""dvc.yaml's code deps are what each stage runs: its notebook and every attncert module the
notebook imports, followed statically through src/attncert.

A module counts as reached when a reached file imports it (at any depth, lazy imports in
functions included; ``if TYPE_CHECKING:`` blocks excluded); importing ``a.b.c`` also runs the
packages' ``a/__init__.py`` and ``a/b/__init__.py``; ``from a.b import c`` reaches the submodule
``a.b.c`` when there is one. Every reached file must be covered by a dep (the file itself or a
folder holding it), and every dep under ``src/`` or ``notebooks/`` must cover a reached file.
Deps follow the package layout: a stage depends on the subpackages it reaches (their folders),
the root modules it reaches and its own stage modules (``stages/`` is listed by file), so that
dvc.yaml reads in a few minutes; an edit anywhere in a reached subpackage reruns the stage.
Data and run paths are other stages' outputs, checked in test_pipeline.py.
"""

import ast
import shlex
from pathlib import Path

import pytest

from attncert.report import rows as report
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "attncert"
#: every stage's runner: it only passes the params sections that the stage's ``params`` track
RUNNER = "attncert.pipeline.nbrun"
CODE_DIRS = ("src/", "notebooks/")
STAGES = report.read_stages(ROOT / report.DVC_FILE)
PARAMS = load_params(ROOT / report.PARAMS_FILE)
#: one item per stage: a matrix stage's deps are one template, checked once
ITEMS = {}  # stage: (its first matrix item, DVC's key of it)
for _r in report.stage_runs(STAGES, PARAMS):
    ITEMS.setdefault(_r.stage, (_r.item, _r.key))


def module_file(name: str, src: Path) -> Path | None:
    """The file that defines module ``name`` under ``src`` (a package's __init__.py)."""
    base = src.joinpath(*name.split("."))
    for path in (base / "__init__.py", base.with_suffix(".py")):
        if path.is_file():
            return path
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING"
            or isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST, annotations: bool = False):
    """Every import statement of ``tree``; those under ``if TYPE_CHECKING:`` only with
    ``annotations``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if not annotations and isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imported_modules(path: Path, module: str | None, annotations: bool = False
                     ) -> tuple[set[str], set[str]]:
    """(modules the file surely imports, names that are modules only if such a file exists)
    of the ``attncert`` package; ``module`` is the file's dotted name (None: a notebook);
    ``annotations``: the imports under ``if TYPE_CHECKING:`` too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if module and path.name == "__init__.py" else (module or "").rpartition(".")[0]
    sure, maybe = set(), set()
    for node in _import_nodes(tree, annotations):
        if isinstance(node, ast.Import):
            sure |= {a.name for a in node.names}
            continue
        if node.level:
            if not package:
                raise AssertionError(f"{path}: relative import outside a package")
            parts = package.split(".")
            parts = parts[:len(parts) - node.level + 1] + ([node.module] if node.module else [])
            target = ".".join(parts)
        else:
            target = node.module
        sure.add(target)
        maybe |= {f"{target}.{a.name}" for a in node.names}
    keep = {m for m in sure | maybe if m == PACKAGE or m.startswith(PACKAGE + ".")}
    return sure & keep, maybe & keep


def reached_files(notebook: Path, modules: list[str], src: Path) -> dict[Path, Path | None]:
    """{file: the file that first imported it (None for an entry point)} of every file that
    running ``notebook`` and ``python -m`` each of ``modules`` reaches."""
    reached: dict[Path, Path | None] = {notebook: None}
    todo: list[tuple[Path, str | None]] = [(notebook, None)]
    for m in modules:
        f = module_file(m, src)
        assert f is not None, f"no module {m} under {src}"
        reached[f] = None
        todo.append((f, m))
    while todo:
        path, module = todo.pop()
        sure, maybe = imported_modules(path, module)
        for name in sorted(sure | maybe):
            parts = name.split(".")
            if name in sure and module_file(name, src) is None:
                raise AssertionError(f"{path}: imports {name}, which has no file under {src}")
            for i in range(1, len(parts) + 1):  # the packages first, then the module
                sub = ".".join(parts[:i])
                f = module_file(sub, src)
                if f is not None and f not in reached:
                    reached[f] = path
                    todo.append((f, sub))
    return reached


def entry_points(cmd: str) -> tuple[str, list[str]]:
    """(the notebook nbrun executes, the other attncert modules the command runs)."""
    argv = shlex.split(cmd)
    notebooks, modules = [], []
    for i, a in enumerate(argv[:-1]):
        if a == "-m" and argv[i + 1].startswith(PACKAGE):
            if argv[i + 1] == RUNNER:
                notebooks.append(argv[i + 2])
            else:
                modules.append(argv[i + 1])
    assert len(notebooks) == 1, f"{cmd}: expected one `python -m {RUNNER} <notebook>`"
    return notebooks[0], modules


def _covers(dep: str, rel: str) -> bool:
    dep = dep.rstrip("/")
    return rel == dep or rel.startswith(dep + "/")


def dep_problems(stage: str, spec: dict, item: dict, root: Path = ROOT,
                 key: str | None = None) -> list[str]:
    """Every reached file no dep covers, and every code dep that covers no reached file."""
    notebook, modules = entry_points(report.resolve(spec["cmd"], PARAMS, item, key))
    reached = reached_files(root / notebook, modules, root / "src")
    rel = {f.relative_to(root).as_posix(): by for f, by in reached.items()}
    deps = [report.resolve(d, PARAMS, item, key) for d in spec.get("deps", [])]
    code = [d for d in deps if d.startswith(CODE_DIRS)]
    problems = []
    for f, by in sorted(rel.items()):
        if not any(_covers(d, f) for d in code):
            why = f"imported by {by.relative_to(root).as_posix()}" if by else "run by its cmd"
            problems.append(f"{stage}: {f} ({why}) is not covered by a dep in dvc.yaml")
    for d in code:
        if not any(_covers(d, f) for f in rel):
            problems.append(f"{stage}: dep {d} is not imported by the stage (stale dep)")
    problems += [f"{stage}: {g}" for d in code if (g := _granularity(d))]
    return problems


#: the one package whose modules are listed by file: a stage module is one stage's own
BY_FILE = "stages"


def _granularity(dep: str) -> str | None:
    """Why a code dep is not at the package layout's granularity (a subpackage folder, a
    module at the package's root, a stage module), or None."""
    parts = dep.rstrip("/").split("/")
    if parts[0] != "src":
        return None
    if len(parts) <= 2:
        return f"dep {dep} is the whole package: list its subpackages and root modules"
    if len(parts) > 3 and parts[2] != BY_FILE:
        return f"dep {dep} is inside {'/'.join(parts[:3])}: list the subpackage's folder"
    return None


@pytest.mark.parametrize("stage", list(STAGES))
def test_code_deps_match_imports(stage):
    problems = dep_problems(stage, STAGES[stage], *ITEMS[stage][:1], key=ITEMS[stage][1])
    assert not problems, "\n".join(problems)


def test_every_stage_is_checked():
    assert ITEMS.keys() == STAGES.keys() and len(STAGES) >= 9


# ------------------------------------------------------------------ the import walk itself
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_walk_follows_packages_submodules_relative_and_lazy_imports(tmp_path):
    _write(tmp_path, {
        "notebooks/01_x.py": "import os\nfrom attncert import a\nfrom attncert.pkg.b import f\n",
        "src/attncert/__init__.py": "",
        "src/attncert/a.py": "def g():\n    from attncert.lazy import h\n",
        "src/attncert/lazy.py": "",
        "src/attncert/pkg/__init__.py": "from .c import k\n",
        "src/attncert/pkg/b.py": "from . import d\nf = 1\n",
        "src/attncert/pkg/c.py": "from typing import TYPE_CHECKING\n"
                                 "if TYPE_CHECKING:\n    from attncert import typed\nk = 1\n",
        "src/attncert/pkg/d.py": "",
        "src/attncert/typed.py": "",
        "src/attncert/unused.py": "",
    })
    got = reached_files(tmp_path / "notebooks/01_x.py", [], tmp_path / "src")
    rel = {f.relative_to(tmp_path).as_posix() for f in got}
    assert rel == {"notebooks/01_x.py", "src/attncert/__init__.py", "src/attncert/a.py",
                   "src/attncert/lazy.py", "src/attncert/pkg/__init__.py",
                   "src/attncert/pkg/b.py", "src/attncert/pkg/c.py", "src/attncert/pkg/d.py"}


def test_missing_and_stale_deps_are_named(tmp_path):
    _write(tmp_path, {
        "notebooks/01_x.py": "from attncert import a\n",
        "src/attncert/__init__.py": "",
        "src/attncert/a.py": "from attncert.sub import b\n",
        "src/attncert/sub/__init__.py": "",
        "src/attncert/sub/b.py": "",
        "src/attncert/old.py": "",
    })
    spec = {"cmd": "python -m attncert.pipeline.nbrun notebooks/01_x.py out.ipynb",
            "deps": ["notebooks/01_x.py", "src/attncert/__init__.py", "src/attncert/a.py",
                     "src/attncert/sub/__init__.py", "src/attncert/old.py", "data/x.pt"]}
    assert dep_problems("x", spec, {}, tmp_path) == [
        "x: src/attncert/sub/b.py (imported by src/attncert/a.py) is not covered by a dep "
        "in dvc.yaml",
        "x: dep src/attncert/old.py is not imported by the stage (stale dep)",
        "x: dep src/attncert/sub/__init__.py is inside src/attncert/sub: list the subpackage's "
        "folder"]
    spec["deps"] = ["notebooks/01_x.py", "src/attncert/__init__.py", "src/attncert/a.py",
                    "src/attncert/sub", "data/x.pt"]
    assert dep_problems("x", spec, {}, tmp_path) == []
    spec["deps"] = ["notebooks/01_x.py", "src/attncert", "data/x.pt"]
    assert dep_problems("x", spec, {}, tmp_path) == [
        "x: dep src/attncert is the whole package: list its subpackages and root modules"]


def test_the_data_stage_reaches_no_model_or_training_code():
    """Preparing the datasets imports no model, bound or training code: editing those reruns
    the stages that use them, never the data stage."""
    reached = reached_files(ROOT / "notebooks/01_data.py", [], ROOT / "src")
    pkgs = {f.relative_to(ROOT / "src" / "attncert").parts[0] for f in reached
            if f.is_relative_to(ROOT / "src" / "attncert")}
    assert not pkgs & {"training", "models", "layers", "bounds", "certify.py", "attacks.py"}, pkgs
