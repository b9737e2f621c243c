"""Scale profiles: apply profiles/<name>.yaml on top of the committed (paper) params.yaml.

    python -m attncert.pipeline.profile apply smoke  # writes params.yaml, keeps its comments
    python -m attncert.pipeline.profile apply paper  # back to the committed paper scale
    python -m attncert.pipeline.profile apply cpu --keep-edits  # carry edits of scaled keys
    python -m attncert.pipeline.profile show cpu     # the overrides, as `dvc exp run -S` args

The base is params.yaml as committed at git HEAD (so profiles never stack); outside a git
checkout the current params.yaml is the base when its base.scale is 'paper'. A profile may
only change keys that exist, and the result is validated before params.yaml is written.

A profile never discards edits. An edit is a value of params.yaml that differs from what the
last ``apply`` wrote (recorded in .profile-applied.json, git-ignored; without the record: what
the profile in force, its base.scale, gives on top of HEAD); the new params.yaml is HEAD + the
new profile + the edits, so re-applying a scale keeps every edit and picks up a changed profile
or HEAD, and `dvc params diff` lists the profile's changes and the edits. When the scale
changes, an edit of a key that the old or the new profile sets (its value depends on the scale)
is refused, naming the keys, unless ``--keep-edits`` carries it over as it is. Edits are
values: comments follow HEAD.
"""

from __future__ import annotations

import argparse
import io
import json
import shlex
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.params import PARAMS_FILE, ParamsError, read_yaml
from attncert.stages.registry import validate

PROFILE_DIR = "profiles"
PAPER = "paper"
RECORD = ".profile-applied.json"  # the scale and the values the last apply wrote, before edits


def profile_names(root: Path = Path()) -> list[str]:
    return [PAPER] + sorted(p.stem for p in (root / PROFILE_DIR).glob("*.yaml"))


def overrides(name: str, root: Path = Path()) -> dict[str, Any]:
    if name == PAPER:
        return {}
    path = root / PROFILE_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ParamsError(f"{name}: unknown profile; known: {', '.join(profile_names(root))}")
    return read_yaml(path) or {}


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in tree.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def _base_text(root: Path) -> str:
    """params.yaml at git HEAD, else the working copy if it is the paper scale."""
    try:
        return subprocess.run(
            ["git", "show", f"HEAD:{PARAMS_FILE}"], cwd=root, capture_output=True, text=True,
            check=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        text = (root / PARAMS_FILE).read_text()
        scale = (YAML(typ="safe", pure=True).load(text) or {}).get("base", {}).get("scale")
        if scale != PAPER:
            raise ParamsError(f"{PARAMS_FILE}: not in git and base.scale is {scale!r}; restore "
                              "the paper-scale params.yaml before applying a profile") from None
        return text


def _set(doc: Any, key: str, value: Any, what: str) -> Any:
    """Set ``key`` (dotted) in a round-trip document; returns the value it replaced."""
    node = doc
    *parents, leaf = key.split(".")
    for p in parents:
        if not isinstance(node, Mapping) or p not in node:
            raise ParamsError(f"{key}: {what} sets a key params.yaml does not have")
        node = node[p]
    if not isinstance(node, Mapping) or leaf not in node:
        raise ParamsError(f"{key}: {what} sets a key params.yaml does not have")
    old = node[leaf]
    node[leaf] = value
    return old


def _with_profile(base: Mapping, name: str, root: Path) -> dict[str, Any]:
    """Flat values of ``base`` (a plain tree) with profile ``name`` applied."""
    flat = flatten(base)
    for key, value in flatten(overrides(name, root)).items():
        if key not in flat:
            raise ParamsError(f"{key}: profile {name!r} sets a key params.yaml does not have")
        flat[key] = value
    return flat


def edits(root: Path = Path(), base_text: str | None = None) -> tuple[str, dict[str, Any]]:
    """(the scale in force, {key: value}): the values of params.yaml that differ from what the
    last apply wrote (else from what its profile gives on top of the base, HEAD). Added or
    removed keys are an error."""
    path = root / PARAMS_FILE
    if not path.is_file():
        return PAPER, {}
    current = read_yaml(path) or {}
    scale = current.get("base", {}).get("scale") if isinstance(current, Mapping) else None
    if scale not in profile_names(root):
        raise ParamsError(f"{PARAMS_FILE}: base.scale is {scale!r}, not a known profile "
                          f"({', '.join(profile_names(root))}); cannot tell its edits apart")
    base_text = _base_text(root) if base_text is None else base_text
    expected = _with_profile(YAML(typ="safe", pure=True).load(base_text) or {}, scale, root)
    record = _record(root)
    if record.get("scale") == scale:  # a profile or HEAD changed since is not an edit
        expected.update((k, v) for k, v in record["values"].items() if k in expected)
    flat = flatten(current)
    added, removed = sorted(set(flat) - set(expected)), sorted(set(expected) - set(flat))
    if added or removed:
        raise ParamsError(
            f"{PARAMS_FILE}: keys differ from the committed file (added: {added or 'none'}; "
            f"removed: {removed or 'none'}); commit params.yaml before applying a profile")
    return scale, {k: v for k, v in flat.items() if k != "base.scale" and v != expected[k]}


def apply(name: str, root: Path = Path(), keep_edits: bool = False
          ) -> dict[str, tuple[Any, Any]]:
    """Write params.yaml = committed params + profile overrides + the edits of params.yaml
    (see the module docstring); return {key: (committed value, new value)}."""
    rt = YAML(typ="rt", pure=True)
    rt.preserve_quotes = True
    rt.width = 100
    base_text = _base_text(root)
    doc = rt.load(base_text)
    committed = flatten(YAML(typ="safe", pure=True).load(base_text) or {})
    old_scale, edited = edits(root, base_text)
    target = _with_profile(YAML(typ="safe", pure=True).load(base_text) or {}, name, root)
    gone = [k for k in edited if k not in target]
    if gone:
        raise ParamsError(f"{PARAMS_FILE}: edited {', '.join(gone)}, which the committed "
                          f"{PARAMS_FILE} no longer has; undo the edit(s)")
    if old_scale != name and not keep_edits:
        scaled = set(flatten(overrides(old_scale, root))) | set(flatten(overrides(name, root)))
        clash = {k: v for k, v in edited.items() if k in scaled and v != target[k]}
        if clash:
            raise ParamsError(
                f"{PARAMS_FILE}: edited {', '.join(f'{k}={v}' for k, v in clash.items())}, "
                f"set differently by the {old_scale} and {name} scales; undo the edit(s), or "
                f"keep them with `python -m attncert.pipeline.profile apply {name} --keep-edits` "
                f"(make pipeline SCALE={name} KEEP_EDITS=1)")
    if edited:  # the edits' own nodes: a list keeps its flow style
        current = rt.load((root / PARAMS_FILE).read_text())
    for key, value in flatten(overrides(name, root)).items():
        _set(doc, key, value, f"profile {name!r}")
    for key in edited:
        node = current
        for part in key.split("."):
            node = node[part]
        _set(doc, key, node, "an edit")
    buf = io.StringIO()
    rt.dump(doc, buf)
    new = YAML(typ="safe", pure=True).load(buf.getvalue())
    validate(new, f"{PARAMS_FILE} + {name}")
    with atomic_path(root / PARAMS_FILE) as tmp:
        tmp.write_text(buf.getvalue())
    write_json(root / RECORD, {"scale": name, "values": target})
    return {k: (committed[k], v) for k, v in flatten(new).items() if v != committed[k]}


def _record(root: Path) -> dict[str, Any]:
    """What the last apply wrote (scale, flat values before edits); {} if unknown."""
    try:
        record = json.loads((root / RECORD).read_text())
    except (OSError, ValueError):
        return {}
    ok = isinstance(record, dict) and isinstance(record.get("values"), dict)
    return record if ok else {}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.pipeline.profile",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["apply", "show"])
    ap.add_argument("name")
    ap.add_argument("--verbose", action="store_true", help="apply: list every changed value")
    ap.add_argument("--keep-edits", action="store_true",
                    help="carry edits of keys that the old or the new profile sets")
    args = ap.parse_args(argv)
    try:
        if args.action == "show":
            print(" ".join(shlex.quote(f"-S={k}={v if isinstance(v, str) else json.dumps(v)}")
                           for k, v in flatten(overrides(args.name)).items()))
            return 0
        _, edited = edits()
        changes = apply(args.name, keep_edits=args.keep_edits)
    except ParamsError as exc:
        print(f"profile: error: {exc}", file=sys.stderr)
        return 2
    print(f"params.yaml: {args.name} scale ({len(changes)} values differ from the committed file,"
          f" listed by `dvc params diff` or --verbose; {len(edited)} edit(s) kept"
          f"{': ' if edited else ''}{', '.join(edited)})")
    for key, (old, new) in changes.items() if args.verbose else ():
        print(f"  {key}: {old} -> {new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
