"""Named ViT shapes: params.yaml's ``vit`` section, which the stages reference by name.

A shape (:class:`VitShape`: patch size, width, depth, heads, MLP width) is declared once, with
its checks; a stage's field of this type is written as a name (``crown.vit: lofast_small``) and
parsed as that shape, so stages share one (LoFAST's 128-d ViT: the crown stage and SpecFormer's
certified pair) and a profile rescales it in one place.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from attncert.pipeline.params import (
    Check,
    ParamsError,
    fail,
    param,
    parse_section,
    positive,
    preset_type,
)


def optional(*checks: Check) -> Check:
    """``checks`` on a value that may be null (``None`` passes)."""
    def check(key: str, v: Any) -> None:
        if v is not None:
            for c in checks:
                c(key, v)

    return check


#: the section of named ViT shapes (:class:`VitShape`); a stage's ``vit`` key names one
VIT_SECTION = "vit"


@dataclass(frozen=True)
class VitShape:
    """One named ViT shape of params.yaml's ``vit`` section. ``depth`` / ``heads`` null: the
    stage's grid sets them (``vit_grid``, ``crown.depths``); a stage that does not sweep them
    requires them (:meth:`require`)."""

    PRESET_SECTION: typing.ClassVar[str] = VIT_SECTION

    patch: int = param(positive)
    dim: int = param(positive, doc="token width")
    depth: int | None = param(optional(positive), doc="blocks (null: the stage's grid's)")
    heads: int | None = param(optional(positive), doc="attention heads (null: the grid's)")
    mlp_hidden: int = param(positive, doc="MLP hidden width")

    def __post_init__(self) -> None:
        if self.heads is not None and self.dim % self.heads:
            raise ValueError(f"dim = {self.dim} is not divisible by heads = {self.heads}")

    def arch(self, **grid: int) -> dict[str, int]:
        """``patch, dim, depth, heads, mlp_hidden`` as keyword arguments, ``grid`` (``depth=``,
        ``heads=``) replacing the shape's; a one-line error when one is still unset."""
        out = {**dataclasses.asdict(self), **grid}
        unset = [k for k, v in out.items() if v is None]
        if unset:
            raise ParamsError(f"vit: {unset[0]} is null in this shape and the stage sets no "
                              f"{unset[0]} of its own")
        if out["dim"] % out["heads"]:
            raise ParamsError(f"vit: dim = {out['dim']} is not divisible by heads = "
                              f"{out['heads']}")
        return out

    def require(self, key: str, *names: str) -> VitShape:
        """This shape, with a one-line error naming ``key`` when one of ``names`` is null."""
        for n in names:
            if getattr(self, n) is None:
                fail(key, f"the shape it names has {n}: null; this stage needs a {n}")
        return self


def parse_presets(raw: Any) -> dict[str, VitShape]:
    """The ``vit`` section: name -> :class:`VitShape`, each checked like a section."""
    if not isinstance(raw, Mapping) or not raw:
        fail(VIT_SECTION, f"expected a mapping of named ViT shapes, got {raw!r}")
    return {str(name): parse_section(f"{VIT_SECTION}.{name}", v, VitShape)
            for name, v in raw.items()}


def uses_presets(cls: type) -> bool:
    """Whether the dataclass ``cls`` (or one of its groups) names a ViT shape."""
    hints = typing.get_type_hints(cls)
    return any(preset_type(hints[f.name]) is VitShape
               or dataclasses.is_dataclass(hints[f.name]) and uses_presets(hints[f.name])
               for f in dataclasses.fields(cls))
