"""Typed schema of params.yaml's sections, read with YAML 1.2 semantics (as DVC reads it).

params.yaml is the single source of truth: every key is required, there are no hidden
defaults here. Each top-level section maps to a frozen dataclass whose fields carry their
type and an optional check (a group, such as ``certvit.dr``, is a dataclass field);
:func:`parse_section` reads one and raises ``ParamsError`` with a one-line message naming the
offending key. The whole file is validated by :func:`attncert.stages.registry.load_params`.
A field of a named type (a ViT shape, :mod:`attncert.pipeline.shapes`) is written as the name of
an entry of its section (``crown.vit: lofast_small``); keys of an older layout are one-line
errors naming their new place (:mod:`attncert.pipeline.renamed`).

One spelling per concept across sections: ``cert_eps`` lists the radii at which a bound or
certificate is evaluated, ``attack_eps`` radii that are only attacked, ``attack_steps`` and
``attack_restarts`` the PGD of an attack that audits no certificate; every soundness audit is
one group of one shape, ``<section>.audit`` (:class:`attncert.pipeline.audit.Audit`);
``adv_*`` is PGD adversarial training.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ruamel.yaml import YAML

# the dataset names the checks accept (one table: attncert.pipeline.datasets), re-exported
from attncert.pipeline.datasets import DATASETS as DATASETS
from attncert.pipeline.datasets import IMAGE_DATASETS as IMAGE_DATASETS
from attncert.pipeline.datasets import TEXT_DATASETS as TEXT_DATASETS
from attncert.pipeline.renamed import RENAMED

PARAMS_FILE = "params.yaml"

#: Small real evaluation sets shipped with the offline mirror.
SAMPLE_SETS = ("cifar10_sample", "imagenet_sample", "imagenet_val")
#: Training precisions (``attncert.training.precision``); certificates are always float64.
PRECISIONS = ("auto", "bf16", "tf32", "fp32")


class ParamsError(ValueError):
    """A params.yaml problem, phrased as one line that names the key."""


# ---------------------------------------------------------------------------- checks
Check = Callable[[str, Any], None]


def fail(key: str, msg: str) -> typing.NoReturn:
    """Raise the one-line :class:`ParamsError` for ``key`` (a stage's own checks use it too)."""
    raise ParamsError(f"{key}: {msg}")


def image_datasets(key: str, v: list) -> None:
    """Every entry an image dataset (the ViTs take images; a text dataset has no patches)."""
    bad = [d for d in v if d not in IMAGE_DATASETS]
    if bad:
        fail(key, f"{bad[0]!r} is not an image dataset; choose from {', '.join(IMAGE_DATASETS)}")


def nonneg(key: str, v: Any) -> None:
    values = v if isinstance(v, list) else [v]
    if any(x < 0 for x in values):
        fail(key, f"must be >= 0, got {v!r}")


def unit_interval(key: str, v: float) -> None:
    if not 0 <= v < 1:
        fail(key, f"must be in [0, 1), got {v!r}")


def positive(key: str, v: Any) -> None:
    values = v if isinstance(v, list) else [v]
    if any(x <= 0 for x in values):
        fail(key, f"must be > 0, got {v!r}")


def one_of(*choices: str) -> Check:
    def check(key: str, v: Any) -> None:
        values = v if isinstance(v, list) else [v]
        bad = [x for x in values if x not in choices]
        if bad:
            fail(key, f"unknown value {bad[0]!r}; choose from {', '.join(choices)}")

    return check


def one_of_numbers(*choices: float) -> Check:
    def check(key: str, v: Any) -> None:
        if v not in choices:
            fail(key, f"must be one of {', '.join(map(str, choices))}, got {v!r}")

    return check


def unique(key: str, v: list) -> None:
    if len(set(v)) != len(v):
        fail(key, f"has duplicate entries: {v!r}")


def nonempty(key: str, v: list) -> None:
    if not v:
        fail(key, "needs at least one entry")


def device_spec(key: str, v: str) -> None:
    if v not in ("auto", "cpu", "cuda", "mps") and not (
        v.startswith("cuda:") and v[5:].isdigit()
    ):
        fail(key, f"unknown device {v!r}; use auto, cpu, cuda, cuda:N or mps")


def dataclass_from_mapping(cls: type, d: Mapping[str, Any]) -> Any:
    """``cls(**d)`` for a dataclass, naming unknown keys instead of a TypeError."""
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}; known: {sorted(names)}")
    return cls(**d)


def param(*checks: Check, doc: str = "") -> Any:
    """A required field with checks applied after type validation."""
    return field(metadata={"checks": checks, "doc": doc})


# ---------------------------------------------------------------------------- sections
@dataclass(frozen=True)
class BaseParams:
    scale: str = param(one_of("paper", "cpu", "smoke"), doc="label of the scale profile")
    seed: int = param(nonneg)
    device: str = param(device_spec)
    precision: str = param(one_of(*PRECISIONS),
                           doc="training forward/loss: auto (bf16 on CUDA, fp32 elsewhere) | "
                               "bf16 | tf32 | fp32; certificates are always float64")
    threads: int = param(nonneg, doc="CPU threads of the math libraries in every stage (0 = "
                                     "PyTorch's default: one per physical core)")
    deterministic: bool = param(doc="torch.use_deterministic_algorithms (warn only) and no "
                                    "cuDNN autotuning: a run repeats on one machine")
    compile: str = param(one_of("off", "compile", "graphs", "auto"),
                         doc="training forward passes: off (eager, the reference) | compile "
                             "(torch.compile) | graphs (and CUDA graphs on CUDA) | auto (graphs "
                             "on CUDA, off elsewhere); certificates and attacks run eager")
    batch_memory: float = param(unit_interval,
                                doc="share of a CUDA device's memory a certificate, audit or "
                                    "evaluation batch grows to (0: the sections' batch sizes "
                                    "as they are; never on a CPU)")


#: ``base`` keys that set how a stage runs, not what it computes: no stage's DVC param
#: (dvc.yaml lists the other ``base`` keys), so changing them reruns nothing
BASE_RUNTIME = ("threads", "compile", "batch_memory")


#: ViT settings shared by several sections (names of ``attncert.models``).
VIT_BLOCKS = ("stream", "prenorm")
VIT_POOLS = ("cls", "mean")
NORMALIZE = ("mean", "std", "none")
AUGMENTS = ("none", "crop", "crop_flip")


@dataclass(frozen=True)
class VitGridParams:
    """The ViT grid (a DVC matrix: every combination is one train_vit and one certify_vit
    stage). A stage gets ONE value of each list through ``nbrun --item`` and parses it as
    :class:`attncert.pipeline.runs.GridPoint`."""

    results_dir: str = param(doc="one folder per grid point: checkpoints, model, metrics")
    dataset: list[str] = param(one_of(*IMAGE_DATASETS), unique)
    depth: list[int] = param(positive, unique)
    heads: list[int] = param(positive, unique)
    gamma_vo: list[float] = param(positive, unique)


def probability(key: str, v: float) -> None:
    if not 0 <= v <= 1:
        fail(key, f"must be in [0, 1], got {v!r}")


# ---------------------------------------------------------------------------- typing
def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _check_type(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` (ints widened to float where a float is declared) or raise."""
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        (item_tp,) = typing.get_args(tp)[:1]
        if not isinstance(value, list):
            fail(key, f"expected a list of {_type_name(item_tp)}, got {value!r}")
        return [_check_type(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, item_tp = typing.get_args(tp)
        if not isinstance(value, Mapping):
            fail(key, f"expected a mapping of {_type_name(key_tp)} to {_type_name(item_tp)}, "
                      f"got {value!r}")
        return {_check_type(f"{key} key", k, key_tp): _check_type(f"{key}.{k}", v, item_tp)
                for k, v in value.items()}
    if origin in (typing.Union, types.UnionType):
        for alt in typing.get_args(tp):
            try:
                return _check_type(key, value, alt)
            except ParamsError:
                continue
        fail(key, f"expected {_type_name(tp)}, got {value!r}")
    if tp is type(None):
        if value is not None:
            fail(key, f"expected null, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            fail(key, f"expected true/false, got {type(value).__name__} {value!r}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            fail(key, f"expected int, got {type(value).__name__} {value!r}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            fail(key, f"expected float, got {type(value).__name__} {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            fail(key, f"expected string, got {type(value).__name__} {value!r}")
        return value
    raise TypeError(f"unsupported schema type {tp!r} for {key}")  # a bug in this module


def parse_section(name: str, raw: Any, cls: type,
                  presets: Mapping[str, Any] | None = None) -> Any:
    """Validate one section's mapping against its dataclass; return the instance. A field whose
    type is a dataclass is a group (``certvit.dr``): its mapping is parsed the same way, and
    the class's own ``__post_init__`` checks become one-line errors. A field of a named type
    (a class with ``PRESET_SECTION``, such as :class:`attncert.pipeline.shapes.VitShape`), or a
    mapping to one, is written as names of ``presets`` (that section, parsed). A key of an
    older layout (:data:`RENAMED`) is an error that names its new place."""
    if not isinstance(raw, Mapping):
        fail(name, f"expected a mapping of parameters, got {raw!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        moved = RENAMED.get(f"{name}.{unknown[0]}")
        if moved:
            fail(f"{name}.{unknown[0]}", f"renamed: the key is now {moved} (params.yaml spells "
                                         "a concept one way and groups a config under one key)")
        close = _closest(unknown[0], fields)
        hint = f" (did you mean {close!r}?)" if close else ""
        fail(f"{name}.{unknown[0]}", f"unknown parameter{hint}")
    missing = [k for k in fields if k not in raw]
    if missing:
        fail(f"{name}.{missing[0]}", "missing (params.yaml must set every parameter)")
    values = {}
    for key, f in fields.items():
        full = f"{name}.{key}"
        named = preset_type(hints[key])
        if named:  # a name (or {entry: name}) of a preset section
            section = named.PRESET_SECTION
            if typing.get_origin(hints[key]) is not dict:
                values[key] = _preset(full, raw[key], presets, section)
                continue
            if not isinstance(raw[key], Mapping):
                fail(full, f"expected a mapping to names of the {section} section, got "
                           f"{raw[key]!r}")
            values[key] = {str(k): _preset(f"{full}.{k}", v, presets, section)
                           for k, v in raw[key].items()}
            continue
        if dataclasses.is_dataclass(hints[key]):  # a group: one config object, taken whole
            values[key] = parse_section(full, raw[key], hints[key], presets)
            continue
        v = _check_type(full, raw[key], hints[key])
        for check in f.metadata.get("checks", ()):
            check(full, v)
        values[key] = v
    try:
        return cls(**values)
    except ParamsError:
        raise
    except ValueError as exc:  # a config class's own check (its message names the field)
        fail(name, str(exc))


def preset_type(tp: Any) -> type | None:
    """The named type of a field typed ``T`` or ``dict[str, T]`` where ``T`` has
    ``PRESET_SECTION`` (None otherwise)."""
    if typing.get_origin(tp) is dict:
        tp = typing.get_args(tp)[1]
    return tp if hasattr(tp, "PRESET_SECTION") else None


def _preset(key: str, value: Any, presets: Mapping[str, Any] | None, section: str) -> Any:
    if presets is None:  # a bug in the caller: it did not read the section
        raise TypeError(f"{key}: parse_section needs the {section} section's presets")
    if not isinstance(value, str):
        fail(key, f"expected the name of a shape of the {section} section "
                  f"({', '.join(presets)}), got {value!r}")
    if value not in presets:
        close = _closest(value, presets)
        hint = f" (did you mean {close!r}?)" if close else ""
        fail(key, f"{value!r} is not a shape of the {section} section{hint}; known: "
                  f"{', '.join(presets)}")
    return presets[value]


def _closest(word: str, options) -> str | None:
    import difflib

    hit = difflib.get_close_matches(word, list(options), n=1, cutoff=0.6)
    return hit[0] if hit else None


# ---------------------------------------------------------------------------- loading
def yaml_12(typ: str = "safe") -> YAML:
    y = YAML(typ=typ, pure=True)
    y.version = (1, 2)
    return y


def read_yaml(path: str | Path) -> Any:
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: file not found")
    try:
        return yaml_12().load(path.read_text())
    except Exception as exc:  # ruamel's errors are multi-line; keep the first line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ParamsError(f"{path}: invalid YAML: {first}") from exc


@dataclass(frozen=True)
class StudyParams:
    """All sections of params.yaml, validated."""

    sections: dict[str, Any]

    def __getitem__(self, name: str) -> Any:
        return self.sections[name]

    def fields(self, entry: str) -> dict[str, Any]:
        """The fields of section ``entry`` (``section.key``: that one field, as DVC lists
        granular params); a one-line error for an unknown section or key."""
        name, _, only = entry.partition(".")
        if name not in self.sections:
            raise ParamsError(f"{name}: unknown section; known: {', '.join(self.sections)}")
        section = self.sections[name]
        fields = ({k: dataclasses.asdict(v) for k, v in section.items()}
                  if isinstance(section, Mapping) else dataclasses.asdict(section))
        if only and only not in fields:
            raise ParamsError(f"{entry}: unknown parameter")
        return {only: fields[only]} if only else fields

    def grid_point(self, names: list[str], items: Mapping[str, str]) -> dict[str, Any]:
        """One grid point (a DVC matrix item) of the sections ``names``: ``{key: text}``
        replaces the list field ``key`` by the single value ``text`` (parsed as YAML 1.2),
        which must be one of the list's values; returns the grid section's fields with them
        ({} without items). Every list field of that section needs an item; every entry of
        ``names`` must exist (:meth:`fields`), items or not."""
        lists = {(name, k): v for name in names for k, v in self.fields(name).items()
                 if isinstance(v, list) and "." not in name}
        if not items:
            return {}
        out: dict[str, Any] = {}
        owners = set()
        for key, value_text in items.items():
            owner = [name for name, k in lists if k == key]
            if len(owner) != 1:
                keys = sorted({k for _, k in lists})
                raise ParamsError(f"--item {key}: not a list parameter of one of the sections "
                                  f"{', '.join(names)} (lists: {', '.join(keys)})")
            name = owner[0]
            owners.add(name)
            full = f"{name}.{key}"
            hints = typing.get_type_hints(type(self.sections[name]))
            (item_tp,) = typing.get_args(hints[key])
            value = _check_type(f"--item {key}", _parse_scalar(full, value_text), item_tp)
            if value not in lists[name, key]:
                raise ParamsError(f"--item {key}={value_text}: not in {full} = "
                                  f"{lists[name, key]}")
            out[key] = value
        if len(owners) > 1:
            raise ParamsError(f"--item: the keys belong to several sections {sorted(owners)}")
        (name,) = owners
        for key, value in self.fields(name).items():
            if isinstance(value, list) and key not in out:
                raise ParamsError(f"{name}.{key}: a grid point needs --item {key}=VALUE")
        return {**self.fields(name), **out}


def _parse_scalar(key: str, text: str) -> Any:
    try:
        return yaml_12().load(text)
    except Exception as exc:
        raise ParamsError(f"--item {key}: cannot parse {text!r}") from exc
