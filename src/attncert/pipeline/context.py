"""The one stage contract: ``run(p, ctx)``.

Every stage module (:mod:`attncert.stages`) has ``run(p: Params, ctx: Context)``: ``p`` its
own params.yaml section, typed; ``ctx`` everything else the stage may use, resolved once:

- ``base`` (:class:`~attncert.pipeline.params.BaseParams`; ``None`` for the data stage, which
  reads no other section), and from it ``device`` (``base.device`` as a torch.device, with a
  one-line error when the machine has no such device) and ``precision`` (``base.precision``
  resolved for that device: ``auto`` -> ``bf16`` on CUDA, ``fp32`` elsewhere);
- ``item``: the unit of a split stage (``None``: the stage that gathers the units' records)
  and ``point``: a grid point (:class:`~attncert.pipeline.runs.GridPoint`) of a matrix stage;
- ``processed_dir`` (the data stage's output) and ``sections``: the other typed sections a
  stage reads (the frontier reads ``train_vit``), by section name;
- ``dvc_file`` and ``study``: the report stage's dvc.yaml and the whole params file, validated
  (:func:`attncert.stages.registry.load_params`).

A notebook gets the params file and its unit or grid point from
``python -m attncert.pipeline.nbrun``, calls :func:`setup` once (it
reads the file, applies ``base.threads``/``base.deterministic``, resolves the device and
builds this context) and calls ``run``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from attncert.pipeline.device import resolve_device, resolve_precision
from attncert.pipeline.dvcfile import DVC_FILE
from attncert.pipeline.params import (
    PARAMS_FILE,
    BaseParams,
    ParamsError,
    StudyParams,
    VitGridParams,
    parse_section,
    read_yaml,
)
from attncert.pipeline.runs import GridPoint
from attncert.pipeline.runtime import configure
from attncert.pipeline.shapes import VIT_SECTION, parse_presets, uses_presets


@dataclass(frozen=True)
class Context:
    """What a stage's ``run`` gets besides its own section (see the module docstring)."""

    base: BaseParams | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    precision: str = "fp32"
    item: str | None = None
    point: GridPoint | None = None
    processed_dir: str | None = None
    sections: Mapping[str, Any] = field(default_factory=dict)
    dvc_file: str = DVC_FILE
    study: Any = None

    @property
    def seed(self) -> int:
        return self.require_base().seed

    def require_base(self) -> BaseParams:
        if self.base is None:
            raise ValueError("this stage needs params.yaml's base section (nbrun --section base)")
        return self.base

    def section(self, name: str) -> Any:
        """Another typed section the stage reads (a one-line error when it was not passed)."""
        if name not in self.sections:
            raise ValueError(f"this stage needs params.yaml's {name} section "
                             f"(nbrun --section {name})")
        return self.sections[name]


def make_context(base: BaseParams | None = None, *, device: bool = True, **kw: Any) -> Context:
    """A :class:`Context` from typed values: ``device`` and ``precision`` resolved from
    ``base`` (``device=False``: a stage that only reads records, so no device is resolved)."""
    if base is None or not device:
        return Context(base=base, **kw)
    dev = resolve_device(base.device)
    return Context(base=base, device=dev, precision=resolve_precision(base.precision, dev), **kw)


def setup(module: ModuleType, params_file: str | Path = PARAMS_FILE, *, unit: str | None = None,
          point: Mapping[str, str] | None = None, base: bool = True, device: bool = True,
          **extra: Any) -> tuple[Any, Context]:
    """A notebook's one call: (``module.Params``, the stage's own section of ``params_file``,
    typed; the :class:`Context`).

    It reads the sections the module needs, each validated by its class (``nbrun`` has
    validated the whole file before the kernel started; this module imports no other stage,
    so a stage's code deps stay its own): ``base`` (``base=False``: the data stage, which reads
    no other section) with ``base.threads`` / ``base.deterministic`` applied, the device and
    precision (``device=False``: a stage that only gathers records), ``unit`` as ``item``,
    ``point`` ({key: value text} of one value per ``vit_grid`` list, nbrun's ``--item``) as a
    :class:`~attncert.pipeline.runs.GridPoint`, ``data.processed_dir``, the sections of the
    module's ``SECTIONS`` (name -> class), parsed with the ``vit`` section's shapes when one
    names a shape (:class:`~attncert.pipeline.shapes.VitShape`); ``extra``: other
    :class:`Context` fields (``study``)."""
    raw = read_yaml(params_file)
    if not isinstance(raw, Mapping):
        raise ParamsError(f"{params_file}: expected a mapping of sections")

    def section(name: str) -> Mapping[str, Any]:
        if name not in raw:
            raise ParamsError(f"{name}: section missing from {params_file}")
        return raw[name]

    b = parse_section("base", section("base"), BaseParams) if base else None
    if b is not None:
        configure(b)  # threads, deterministic algorithms
    owners = getattr(module, "SECTIONS", {})
    presets = (parse_presets(section(VIT_SECTION))
               if any(map(uses_presets, [module.Params, *owners.values()])) else None)
    p = parse_section(module.SECTION, section(module.SECTION), module.Params, presets)
    sections = {name: parse_section(name, section(name), cls, presets)
                for name, cls in owners.items()}
    grid = None
    if point is not None:
        if not point:
            raise ParamsError("vit_grid: this notebook needs its grid point, one value of each "
                              "vit_grid list (point = {key: value}; nbrun --item key=value)")
        grid_params = StudyParams({"vit_grid": parse_section("vit_grid", section("vit_grid"),
                                                             VitGridParams)})
        grid = parse_section("vit_grid", grid_params.grid_point(["vit_grid"], point), GridPoint)
    processed = section("data").get("processed_dir")
    if not isinstance(processed, str):
        raise ParamsError(f"data.processed_dir: expected a path, got {processed!r}")
    return p, make_context(b, device=device, item=unit, point=grid, processed_dir=processed,
                           sections=sections, **extra)
