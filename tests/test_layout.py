"""The package's layout: modules and test files of readable size, no import cycle, nothing
imported by name.

Imports are read statically, as tests/test_dvc_deps.py follows them (lazy imports inside
functions included), and for the cycles ``if TYPE_CHECKING:`` blocks too: an import made for
an annotation still ties the two modules' layers together.
"""

import ast
from pathlib import Path

from test_dvc_deps import PACKAGE, imported_modules, module_file

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
#: the longest module a reader should meet, in lines
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PACKAGE).rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports, annotation imports included (each named
    module's file, not its parents)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        sure, maybe = imported_modules(path, name, annotations=True)
        deps = {m for m in sure if m in mods} | {m for m in maybe if m in mods}
        graph[name] = deps - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle():
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_an_annotation_import_counts_for_the_cycles(tmp_path):
    path = tmp_path / "a.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                    "    from attncert.b import B\n")
    assert imported_modules(path, "attncert.a", annotations=True)[0] == {"attncert.b"}
    assert imported_modules(path, "attncert.a")[0] == set()  # not run: no dvc dep


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_is_longer_than_a_reader_s_sitting():
    """The package's modules and the test files alike (a test file split by concern)."""
    files = [*_modules().values(), *sorted((ROOT / "tests").glob("*.py"))]
    long = {str(p.relative_to(ROOT)): n for p in files
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines: {long}"


def test_nothing_imports_a_module_by_name():
    """No ``importlib.import_module`` or ``__import__`` of the package's own modules (or of a
    computed name): every dependency is a static import that readers, tests/test_dvc_deps.py
    and this file can follow."""
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                called = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
                arg = node.args[0] if node.args else None
                literal = isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                if called in ("import_module", "__import__") and (
                        not literal or arg.value.split(".")[0] == PACKAGE):
                    found.append(f"{name}:{node.lineno}")
    assert not found, f"imports by name: {found}"


def test_every_module_file_is_found_by_name():
    for name, path in _modules().items():
        assert module_file(name, SRC) == path


def test_a_vit_config_is_built_in_one_module():
    """Every ViTConfig comes from attncert.models.config (a dataset's, a hub checkpoint's, a
    text model's blocks) or is a replace() of one: no module spells the fields itself (called
    by its name or as an attribute, ``models.ViTConfig(...)``; transformers' own ViTConfig, a
    hub checkpoint's, is another class)."""
    found = []
    for name, path in _modules().items():
        if name == f"{PACKAGE}.models.config":
            continue
        tree = ast.parse(path.read_text())
        ours = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                and (node.module or "").startswith(PACKAGE)
                for a in node.names if a.name == "ViTConfig"}
        found += [f"{name}:{node.lineno}" for node in ast.walk(tree)
                  if isinstance(node, ast.Call) and (getattr(node.func, "id", None) in ours or (
                      isinstance(node.func, ast.Attribute) and node.func.attr == "ViTConfig"))]
    assert not found, f"ViTConfig built outside attncert.models.config: {found}"
