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
  (:func:`attncert.stages.registry.load_params`; the report stage's notebook loads it).

A notebook takes the sections ``python -m attncert.pipeline.nbrun`` passes, calls
:func:`setup` once (it parses them, applies ``base.threads``/``base.deterministic`` and
resolves the device) and calls ``run``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

from attncert.pipeline.dvcfile import DVC_FILE
from attncert.pipeline.params import BaseParams, parse_section
from attncert.pipeline.runs import GridPoint
from attncert.pipeline.runtime import configure
from attncert.training.precision import resolve_precision
from attncert.training.train import resolve_device


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


def setup(module: ModuleType, section: Mapping[str, Any], base: Mapping[str, Any] | None = None,
          *, item: str | None = None, point: Mapping[str, Any] | None = None,
          processed_dir: str | None = None, sections: Mapping[str, Mapping[str, Any]] | None = None,
          device: bool = True, **extra: Any) -> tuple[Any, Context]:
    """A notebook's one call: (``module.Params`` parsed from ``section``, the
    :class:`Context`). ``sections``: other raw sections, parsed by the owning stage's
    ``SECTIONS`` (name -> Params class); ``point``: a matrix item (``vit_grid``);
    ``device=False`` for the stages that only gather records; ``extra``: other
    :class:`Context` fields (``study``)."""
    b = None if base is None else parse_section("base", base, BaseParams)
    if b is not None:
        configure(b)  # threads, deterministic algorithms
    p = parse_section(module.SECTION, section, module.Params)
    sections = sections or {}
    owners = getattr(module, "SECTIONS", {})
    unknown = sorted(set(sections) - set(owners))
    if unknown:
        raise ValueError(f"{module.__name__} reads no section {unknown[0]!r}")
    typed = {name: parse_section(name, raw, owners[name]) for name, raw in sections.items()}
    grid = None if point is None else parse_section("vit_grid", point, GridPoint)
    return p, make_context(b, device=device, item=item, point=grid,
                           processed_dir=processed_dir, sections=typed, **extra)
