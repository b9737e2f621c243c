"""Every section of params.yaml and its dataclass: the study's whole params file, validated.

The stage modules own their sections (``attncert.stages.<stage>.Params``); this module lists
them in file order (:data:`SECTIONS`, static imports) and reads the file once
(:func:`load_params`: every key required, one-line errors naming the key). The reading of
one section (types, checks, did-you-mean) is :mod:`attncert.pipeline.params`.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attncert.pipeline.params import (
    PARAMS_FILE,
    BaseParams,
    ParamsError,
    VitGridParams,
    _check_type,
    _closest,
    parse_section,
    read_yaml,
    yaml_12,
)
from attncert.stages import (
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



@dataclass(frozen=True)
class Params:
    """All sections of params.yaml, validated."""

    sections: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.sections[name]

    def notebook_parameters(self, names: list[str], declared: Sequence[str],
                            items: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The values passed to a stage's notebook for the ``--section`` entries ``names``.

        A whole section whose name the notebook declares is passed as one dict (the stage
        module parses it back into its dataclass); any other entry passes its fields one by
        one, as :meth:`flat`. ``items`` picks the grid point as in :meth:`flat`.
        """
        flat = self.flat(names, items)
        whole = [n for n in names if "." not in n and n in declared]
        out = {k: v for k, v in flat.items()
               if not any(k in self.field_names(n) for n in whole)}
        for name in whole:
            out[name] = {k: flat[k] for k in self.field_names(name)}
        return out

    def field_names(self, name: str) -> list[str]:
        return [f.name for f in dataclasses.fields(self.sections[name])]

    def flat(self, names: list[str], items: Mapping[str, str] | None = None) -> dict[str, Any]:
        """The fields of the given sections as one flat dict (notebook parameters).

        A name ``section.key`` passes that one parameter (as DVC lists granular params).

        ``items`` picks one grid point (a DVC matrix item): ``{key: text}`` replaces the list
        field ``key`` of a given section by the single value ``text`` (parsed as YAML 1.2),
        which must be one of the list's values. A section with any item needs one for each of
        its list fields.
        """
        items = dict(items or {})
        out: dict[str, Any] = {}
        owner: dict[str, str] = {}
        for entry in names:
            name, _, only = entry.partition(".")
            if name not in self.sections:
                raise ParamsError(f"{name}: unknown section; known: {', '.join(self.sections)}")
            fields = dataclasses.asdict(self.sections[name])
            if only and only not in fields:
                raise ParamsError(f"{entry}: unknown parameter")
            for key, value in fields.items():
                if only and key != only:
                    continue
                if key in out:
                    raise ParamsError(f"{name}.{key}: name also used by another section")
                out[key], owner[key] = value, name
        for key, value_text in items.items():
            if key not in out or not isinstance(out[key], list):
                lists = sorted(k for k, v in out.items() if isinstance(v, list))
                raise ParamsError(f"--item {key}: not a list parameter of the sections "
                                  f"{', '.join(names)} (lists: {', '.join(lists)})")
            full = f"{owner[key]}.{key}"
            hints = typing.get_type_hints(type(self.sections[owner[key]]))
            (item_tp,) = typing.get_args(hints[key])
            value = _check_type(f"--item {key}", _parse_scalar(full, value_text), item_tp)
            if value not in out[key]:
                raise ParamsError(f"--item {key}={value_text}: not in {full} = {out[key]}")
            out[key] = value
        for name in {owner[k] for k in items}:
            for key, value in dataclasses.asdict(self.sections[name]).items():
                if isinstance(value, list) and key not in items:
                    raise ParamsError(f"{name}.{key}: a grid point needs --item {key}=VALUE")
        return out



def validate(raw: Any, source: str = PARAMS_FILE) -> Params:
    if not isinstance(raw, Mapping):
        raise ParamsError(f"{source}: expected a mapping of sections")
    unknown = sorted(set(raw) - set(SECTIONS))
    if unknown:
        close = _closest(unknown[0], SECTIONS)
        hint = f" (did you mean {close!r}?)" if close else ""
        raise ParamsError(f"{unknown[0]}: unknown section{hint}")
    missing = [s for s in SECTIONS if s not in raw]
    if missing:
        raise ParamsError(f"{missing[0]}: section missing from {source}")
    return Params({name: parse_section(name, raw[name], section_class(name))
                   for name in SECTIONS})



def _parse_scalar(key: str, text: str) -> Any:
    try:
        return yaml_12().load(text)
    except Exception as exc:
        raise ParamsError(f"--item {key}: cannot parse {text!r}") from exc



def load_params(path: str | Path = PARAMS_FILE) -> Params:
    """Read and validate params.yaml (YAML 1.2: ``1e-3`` is a float, ``yes`` a string)."""
    return validate(read_yaml(path), str(path))



def section_class(name: str) -> type:
    """The dataclass of section ``name``."""
    if name not in SECTIONS:
        raise ParamsError(f"{name}: unknown section; known: {', '.join(SECTIONS)}")
    return SECTIONS[name]
