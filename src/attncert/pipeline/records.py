"""Records of a split stage's units (``attncert.stages.UNIT_STAGES``), and what a split
stage's ``run`` returns (:class:`SplitRun`).

Each unit stage writes one JSON record, keyed by what it was computed from; the gathering
stage reads every record back and refuses one that is missing or stale.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Generic, TypeVar

T = TypeVar("T")


def unit_key(section: str, p: Any, base: Any) -> dict[str, Any]:
    """What a unit's record is computed from: the stage's whole params section ``p`` (named
    ``section``) and ``base``'s seed, precision and scale, as they read back from JSON."""
    return json.loads(json.dumps({section: dataclasses.asdict(p), "seed": base.seed,
                                  "precision": base.precision, "scale": base.scale}))


def read_record(path: str | Path, key: dict[str, Any], what: str, stage: str) -> dict[str, Any]:
    """The record at ``path`` (``what``: e.g. "the crown unit 'mnist-L3'"); ValueError when
    it is missing or was computed from another ``key`` (run the DVC ``stage`` first)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: {what} has not run (dvc repro {stage} runs it)")
    record = json.loads(path.read_text())
    if record.get("key") != key:
        raise ValueError(f"{path}: {what} ran with other params; rerun it (dvc repro {stage})")
    return record


@dataclasses.dataclass(frozen=True)
class SplitRun(Generic[T]):
    """What a split stage's ``run`` returns, for a unit and for the gathering stage alike:
    ``unit`` (None: the gathering stage), ``record`` (the unit's record as written, or the
    stage's metrics file as written) and ``result`` (what the notebook shows beyond the
    record: the gathering stage's tables and figures, a unit's in-memory run where it keeps
    one; else None)."""

    unit: str | None
    record: dict[str, Any]
    result: T | None = None


def gathered(metrics: str | Path, result: T) -> SplitRun[T]:
    """The gathering stage's :class:`SplitRun`: its ``metrics`` file as written and ``result``."""
    return SplitRun(None, json.loads(Path(metrics).read_text()), result)
