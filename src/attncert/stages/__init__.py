"""One module per pipeline stage: ``attncert.stages.<stage>``, named as in dvc.yaml.

A stage module owns everything about its stage that is not a reusable method:

- ``Params``: its params.yaml section, a frozen dataclass checked by :mod:`attncert.params`
  (registered there in ``SECTIONS`` as ``"attncert.stages.<stage>:Params"``);
- ``run(...)``: the stage's plan, from the validated section(s) to the metrics file and
  artefacts it writes; it returns what the notebook shows;
- ``headline_rows(metrics, item)``: the rows of its metrics file that the report and README
  show (:mod:`attncert.headline`).

The stage's notebook only takes its sections (passed whole by :mod:`attncert.nbrun`), calls
``run`` and shows tables and figures. dvc.yaml lists the modules each stage imports
(``tests/test_dvc_deps.py``).
"""

from __future__ import annotations

import importlib
from types import ModuleType

#: the pipeline's stages in order (dvc.yaml)
STAGES = ("data", "tightness", "train_vit", "certify_vit", "specformer", "text", "certvit",
          "crown", "figures")


def module(stage: str) -> ModuleType | None:
    """The stage's module, or None for a stage that has none yet (unknown names raise)."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}; choose from {', '.join(STAGES)}")
    try:
        return importlib.import_module(f"{__name__}.{stage}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{stage}":
            raise
        return None
