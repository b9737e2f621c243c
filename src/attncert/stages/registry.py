"""Every section of params.yaml and its dataclass: the study's whole params file, validated.

The stage modules own their sections (``attncert.stages.<stage>.Params``); this module lists
them in file order (:data:`SECTIONS`, static imports; the ``vit`` section of named ViT shapes,
:func:`attncert.pipeline.params.parse_presets`, follows ``base``) and reads the file once
(:func:`load_params`: every key required, one-line errors naming the key). The reading of
one section (types, checks, did-you-mean) is :mod:`attncert.pipeline.params`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from attncert.pipeline.jobs import Job
from attncert.pipeline.params import (
    PARAMS_FILE,
    BaseParams,
    ParamsError,
    StudyParams,
    VitGridParams,
    _closest,
    parse_section,
    read_yaml,
)
from attncert.pipeline.shapes import VIT_SECTION, parse_presets
from attncert.stages import (
    STAGES,
    certify_vit,
    certvit,
    crown,
    data,
    figures,
    frontier,
    specformer,
    text,
    tightness,
    train_vit,
)

#: Every stage's module (:data:`attncert.stages.STAGES`, dvc.yaml's order): the one list the
#: runner's sections, the report's readers, the unit stages and the cost model derive from
MODULES: dict[str, ModuleType] = {m.SECTION: m for m in (
    data, tightness, train_vit, certify_vit, frontier, specformer, text, certvit, crown, figures)}

#: Every section of params.yaml, in file order, and its dataclass.
SECTIONS: dict[str, type] = {
    "base": BaseParams,
    "data": data.Params,
    "tightness": tightness.Params,
    "vit_grid": VitGridParams,
    "train_vit": train_vit.Params,
    "certify_vit": certify_vit.Params,
    "frontier": frontier.Params,
    "specformer": specformer.Params,
    "certvit": certvit.Params,
    "crown": crown.Params,
    "text": text.Params,
    "figures": figures.Params,
}



def validate(raw: Any, source: str = PARAMS_FILE) -> StudyParams:
    """Every section of ``raw`` by its class; the ``vit`` section (named ViT shapes, after
    ``base``) first, since a section's ``vit`` key names one of them."""
    if not isinstance(raw, Mapping):
        raise ParamsError(f"{source}: expected a mapping of sections")
    names = [*SECTIONS][:1] + [VIT_SECTION] + [*SECTIONS][1:]
    unknown = sorted(set(raw) - set(names))
    if unknown:
        close = _closest(unknown[0], names)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ParamsError(f"{unknown[0]}: unknown section{hint}")
    missing = [s for s in names if s not in raw]
    if missing:
        raise ParamsError(f"{missing[0]}: section missing from {source}")
    presets = parse_presets(raw[VIT_SECTION])
    study = StudyParams({name: presets if name == VIT_SECTION
                         else parse_section(name, raw[name], section_class(name), presets)
                         for name in names})
    shape = study["train_vit"].vit  # the grid's heads (and the frontier's) split its width
    for key, heads in [("vit_grid.heads", h) for h in study["vit_grid"].heads] + [
            ("frontier.heads", study["frontier"].heads)]:
        if shape.dim % heads:
            raise ParamsError(f"{key}: {heads} heads do not split train_vit's shape's dim = "
                              f"{shape.dim}")
    return study


def load_params(path: str | Path = PARAMS_FILE) -> StudyParams:
    """Read and validate params.yaml (YAML 1.2: ``1e-3`` is a float, ``yes`` a string)."""
    return validate(read_yaml(path), str(path))



def section_class(name: str) -> type:
    """The dataclass of section ``name``."""
    if name not in SECTIONS:
        raise ParamsError(f"{name}: unknown section; known: {', '.join(SECTIONS)}")
    return SECTIONS[name]


def stage_jobs(params: StudyParams, stages: Iterable[str] = STAGES) -> list[Job]:
    """Every job of ``stages`` (each stage module's ``jobs``), in pipeline order."""
    unknown = [s for s in stages if s not in MODULES]
    if unknown:
        raise ValueError(f"unknown stage(s) {', '.join(unknown)}; known: {', '.join(MODULES)}")
    return [j for s in MODULES if s in stages for j in MODULES[s].jobs(params)]
