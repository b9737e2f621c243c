"""dvc.yaml resolved with params.yaml: every stage and grid point, its notebook, its metrics.

Where things are comes from dvc.yaml, never from globbing: a stage's metrics files (every number
it writes, what the report reads) are its outputs of ``type: details``, its DVC ``metrics`` the
small headline nbrun writes beside them (:func:`attncert.pipeline.nbrun.write_headline`: what
``dvc metrics show`` prints); ``${...}`` templates are filled from params, a matrix stage
expanded over its grid, each point named by :func:`attncert.pipeline.runs.run_name`; its report is
the notebook ``nbrun`` writes. A metrics file that is missing reads as None.
"""

from __future__ import annotations

import itertools
import json
import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attncert.pipeline.params import read_yaml

if TYPE_CHECKING:  # the whole params file, for annotations only
    from attncert.pipeline.params import StudyParams as Params

DVC_FILE = "dvc.yaml"
#: executed notebooks live under here (dvc.yaml's nbrun outputs)
NOTEBOOK_DIR = "reports/notebooks"

__all__ = ["DVC_FILE", "NOTEBOOK_DIR", "StageRun", "resolve", "read_stages", "stage_runs",
           "collect", "stage_metrics", "stage_items"]


@dataclass(frozen=True)
class StageRun:
    """One stage, or one grid point of a matrix stage, as dvc.yaml declares it."""

    stage: str
    run: str | None            # the grid point's name (matrix stages), else None
    item: Mapping[str, Any]    # the matrix item ({} for a plain stage)
    notebook: str | None       # nbrun's executed notebook
    metrics: tuple[str, ...]   # its metrics files: the outputs of ``type: details``
    key: str | None = None     # DVC's name of the matrix point (``stage@key``; ${key})
    headline: tuple[str, ...] = ()   # its DVC metrics: the headline nbrun writes


_TEMPLATE = re.compile(r"\$\{([^}]+)\}")


def _lookup(ref: str, params: Params, item: Mapping[str, Any], key: str | None) -> Any:
    if ref.strip() == "key" and key is not None:
        return key
    section, _, name = ref.strip().partition(".")
    if section == "item":
        return item[name]
    value = params[section]
    for part in name.split("."):  # a key of a group: section.group.key
        value = getattr(value, part)
    return value


def resolve(text: str, params: Params, item: Mapping[str, Any] | None = None,
            key: str | None = None) -> str:
    """Fill ``${section.key}``, ``${item.key}`` and a matrix point's ``${key}`` templates as
    DVC does."""
    return _TEMPLATE.sub(lambda m: str(_lookup(m.group(1), params, item or {}, key)), text)


def _matrix_items(matrix: Mapping[str, Any], params: Params
                  ) -> list[tuple[dict[str, Any], str]]:
    """(item, DVC's key) of every point: the key joins the values with '-', a value that is
    not a scalar named ``<matrix key><index>`` (``lambda3``), as DVC names it."""
    keys = list(matrix)
    values = []
    for k in keys:
        v = matrix[k]
        whole = _TEMPLATE.fullmatch(v.strip()) if isinstance(v, str) else None
        v = _lookup(whole.group(1), params, {}, None) if whole else v
        values.append([(x, str(x) if isinstance(x, str | int | float) else f"{k}{i}")
                       for i, x in enumerate(v)])
    return [({k: x for k, (x, _) in zip(keys, combo, strict=True)},
             "-".join(name for _, name in combo)) for combo in itertools.product(*values)]


def _point_name(item: Mapping[str, Any], key: str) -> str:
    if set(item) == {"dataset", "depth", "heads", "gamma_vo"}:
        from attncert.pipeline.runs import run_name

        return run_name(**item)
    return key


#: the ``type`` of an output that holds a stage's numbers (dvc.yaml)
DETAILS = "details"


def _paths(entries: Iterable[Any] | None, kind: str | None = None) -> list[str]:
    """The paths of dvc.yaml output entries (those of ``type: kind`` only, when given)."""
    out: list[str] = []
    for e in entries or []:
        if isinstance(e, Mapping):
            out.extend(path for path, props in e.items()
                       if kind is None or (props or {}).get("type") == kind)
        elif kind is None:
            out.append(e)
    return out


def _nbrun_output(cmd: str) -> str | None:
    argv = shlex.split(cmd)
    if "attncert.pipeline.nbrun" not in argv:
        return None
    i = argv.index("attncert.pipeline.nbrun")
    return argv[i + 2] if len(argv) > i + 2 else None


def read_stages(path: str | Path = DVC_FILE) -> dict[str, Any]:
    """dvc.yaml's ``stages`` mapping."""
    return read_yaml(path)["stages"]


def stage_runs(stages: Mapping[str, Any], params: Params) -> list[StageRun]:
    """Every stage and every grid point, in dvc.yaml's order, with paths resolved."""
    out = []
    for name, spec in stages.items():
        items = _matrix_items(spec["matrix"], params) if "matrix" in spec else [({}, None)]
        for item, key in items:
            nb = _nbrun_output(resolve(spec.get("cmd", ""), params, item, key))
            out.append(StageRun(
                stage=name, run=_point_name(item, key) if item else None, item=item,
                notebook=nb, metrics=tuple(resolve(p, params, item, key)
                                           for p in _paths(spec.get("outs"), DETAILS)),
                key=key, headline=tuple(resolve(p, params, item, key)
                                        for p in _paths(spec.get("metrics")))))
    return out


def collect(runs: Sequence[StageRun], root: str | Path = ".") -> list[tuple[StageRun, dict]]:
    """(run, {metrics path: parsed JSON or None when missing}) for every run."""
    root = Path(root)
    loaded = []
    for r in runs:
        files = {}
        for p in r.metrics:
            f = root / p
            files[p] = json.loads(f.read_text()) if f.is_file() else None
        loaded.append((r, files))
    return loaded


def stage_metrics(loaded: Sequence[tuple[StageRun, dict]], stage: str) -> dict[str, dict]:
    """{run name (or stage name): metrics} of one stage's runs whose first metrics file exists.

    For the figures: every grid point of a matrix stage, in grid order."""
    out = {}
    for r, files in loaded:
        if r.stage == stage and r.metrics and files[r.metrics[0]] is not None:
            out[r.run or r.stage] = files[r.metrics[0]]
    return out


def stage_items(runs: Sequence[StageRun], stage: str) -> dict[str, Mapping[str, Any]]:
    """{grid point name: matrix item} of a matrix stage."""
    return {r.run: r.item for r in runs if r.stage == stage and r.run}
