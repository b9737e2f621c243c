"""Scale profiles: apply profiles/<name>.yaml on top of the committed (paper) params.yaml.

    python -m attncert.profile apply smoke     # writes params.yaml, keeps its comments
    python -m attncert.profile apply paper     # back to the committed paper scale
    python -m attncert.profile show cpu        # the overrides, as `dvc exp run -S` arguments

The base is params.yaml as committed at git HEAD (so profiles never stack); outside a git
checkout the current params.yaml is the base when its base.scale is 'paper'. A profile may
only change keys that exist, and the result is validated before params.yaml is written.
`dvc params diff` then lists exactly what the profile changed.
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

from attncert.io import atomic_path
from attncert.params import PARAMS_FILE, ParamsError, read_yaml, validate

PROFILE_DIR = "profiles"
PAPER = "paper"


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


def apply(name: str, root: Path = Path()) -> dict[str, tuple[Any, Any]]:
    """Write params.yaml = committed params + profile overrides; return {key: (old, new)}."""
    rt = YAML(typ="rt", pure=True)
    rt.preserve_quotes = True
    rt.width = 100
    doc = rt.load(_base_text(root))
    changes = {}
    for key, value in flatten(overrides(name, root)).items():
        node = doc
        *parents, leaf = key.split(".")
        for p in parents:
            if not isinstance(node, Mapping) or p not in node:
                raise ParamsError(f"{key}: profile {name!r} sets a key params.yaml does not have")
            node = node[p]
        if leaf not in node:
            raise ParamsError(f"{key}: profile {name!r} sets a key params.yaml does not have")
        if node[leaf] != value:
            changes[key] = (node[leaf], value)
            node[leaf] = value
    buf = io.StringIO()
    rt.dump(doc, buf)
    validate(YAML(typ="safe", pure=True).load(buf.getvalue()), f"{PARAMS_FILE} + {name}")
    with atomic_path(root / PARAMS_FILE) as tmp:
        tmp.write_text(buf.getvalue())
    return changes


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m attncert.profile",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("action", choices=["apply", "show"])
    ap.add_argument("name")
    args = ap.parse_args(argv)
    try:
        if args.action == "show":
            print(" ".join(shlex.quote(f"-S={k}={v if isinstance(v, str) else json.dumps(v)}")
                           for k, v in flatten(overrides(args.name)).items()))
            return 0
        changes = apply(args.name)
    except ParamsError as exc:
        print(f"profile: error: {exc}", file=sys.stderr)
        return 2
    print(f"params.yaml: {args.name} scale ({len(changes)} values differ from the committed file)")
    for key, (old, new) in changes.items():
        print(f"  {key}: {old} -> {new}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
