"""A stage's plan as data: the jobs it runs, each a model and the phases it goes through.

Every stage module names its plan ``jobs(params) -> list[Job]`` (a study's built by its
``plan`` module from the params groups alone; a job is what the stage will do, not how long
it takes). The cost model (:mod:`attncert.cost.pricing`) prices each phase from its counts,
and the tests hold a split stage's job units equal to dvc.yaml's resolved unit stages (and a
grid point's to its stages) at every scale, so a unit renamed or a phase added is one
place.

A phase says how much work, in the stage's own terms (examples, epochs, batches, restarts);
the model it runs on is its job's :class:`Model`. Phases with no model of their own (a
Douglas-Rachford projection, a frozen encoder's forward, CROWN's bounds, one attention layer)
carry their sizes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

#: a model's families: which counts price it (:mod:`attncert.cost.pricing`)
MODEL_KINDS = ("vit", "linear", "text", "frozen_head", "none")


@dataclass(frozen=True)
class Model:
    """What a job trains, certifies or attacks.

    ``kind``: ``vit`` (``config`` a :class:`attncert.models.config.ViTConfig`), ``linear`` (a
    linear map on pixels: ``config`` = (channels, image size, classes)), ``text`` (``build()``
    -> the module, on token ids of ``max_len``), ``frozen_head`` (``build()`` -> the head over
    a frozen encoder of width ``width``, on its cached states) or ``none``. ``msvp``: the MSVP
    penalty's lambdas when it trains with one; ``margin``: the training margin (``lofast``
    changes a step's work; a text model's ``olsa``: OLSA's certificate regulariser, gamma >
    0); ``family``: the step kind the CUDA-graph speed-up is measured for (``lipschitz``,
    ``standard``, ``msvp``, a SpecFormer method, a text model's class; "" eager).
    """

    kind: str
    config: Any = None
    msvp: tuple[float, ...] | None = None
    margin: str = "none"
    family: str = ""
    build: Callable[[], Any] | None = None
    max_len: int = 0
    width: int = 0

    def __post_init__(self) -> None:
        if self.kind not in MODEL_KINDS:
            raise ValueError(f"model kind {self.kind!r}: one of {MODEL_KINDS}")


NO_MODEL = Model("none")


@dataclass(frozen=True)
class Train:
    """``epochs`` over ``n_train`` examples at ``batch`` (PGD examples of ``adv_steps`` per step
    when adversarial), and an evaluation of ``n_eval`` at ``eval_batch`` after every epoch."""

    what: str
    n_train: int
    n_eval: int
    epochs: int
    batch: int
    eval_batch: int
    adv_steps: int = 0


@dataclass(frozen=True)
class Certify:
    """A ViT's certificates in float64: per batch of ``batch``, one forward pass and each of
    ``variants``' per-layer terms over ``n`` points (``tests``: how many tests read them)."""

    what: str
    n: int
    variants: tuple[str, ...]
    tests: int
    batch: int


@dataclass(frozen=True)
class LayerCertify:
    """A text model's LoFAST certificates on ``n`` points: per batch of ``batch``, ``variants``
    x ``depth`` layer terms of a layer of ``tokens`` x ``dim`` with ``heads``."""

    what: str
    n: int
    variants: int
    batch: int
    tokens: int
    dim: int
    heads: int
    depth: int


@dataclass(frozen=True)
class Audit:
    """L2 PGD on ``n`` points at ``eps`` radii, ``steps`` x ``restarts``, ``batch`` at a time;
    ``copy``: on the float32 attack copy of the model, compiled in ``base.compile``'s mode
    (:func:`attncert.attacks.attack_copy`), else on the model itself, eager (SpecFormer's
    tables)."""

    what: str
    n: int
    eps: int
    steps: int
    restarts: int
    batch: int
    copy: bool = True


@dataclass(frozen=True)
class Diagnostics:
    """The attention diagnostics (:func:`attncert.diagnostics.attention_diagnostics`: three
    forward passes, trained, uniform and identity attention, the first with each layer's
    attention matrix recomputed by a hook) over ``n`` points at ``batch``, in float64
    (``fp64``) or float32; priced at its counted call."""

    n: int
    batch: int
    fp64: bool = True


@dataclass(frozen=True)
class Forwards:
    """``passes`` forward passes over ``n`` points at ``batch``, in float32 (``fp64``: the
    float64 forward a global certificate is)."""

    what: str
    n: int
    batch: int
    passes: int = 1
    fp64: bool = False


@dataclass(frozen=True)
class DouglasRachford:
    """CertViT's projection of ``maps`` linear maps: at most ``passes`` Haugazeau steps each,
    a step one batched pass (the map and its transpose) over ``pairs`` input/output pairs of
    the largest map (``entries`` weights)."""

    what: str
    maps: int
    passes: int
    pairs: int
    entries: int


@dataclass(frozen=True)
class EncoderForward:
    """A frozen encoder's (``source``) forward, once per sentence of ``n`` at ``batch``."""

    what: str
    source: str
    n: int
    batch: int
    max_len: int


@dataclass(frozen=True)
class CrownBounds:
    """CROWN's bounds on a crown ViT of ``depth``: ``n`` points x ``eps`` radii per method, each
    bound at most ``time_limit`` s, each method's unit at most ``time_budget`` s (0: none),
    ``batch`` points bounded together."""

    what: str
    depth: int
    methods: tuple[str, ...]
    n: int
    eps: int
    time_limit: float
    time_budget: float
    batch: int = 1


@dataclass(frozen=True)
class LayerStudy:
    """One attention layer (``tokens`` x ``dim``, ``heads``) in float64: per (calls, inputs)
    of ``calls`` a PGD ascent of ``steps`` x ``restarts`` and its LoFAST certificate."""

    what: str
    tokens: int
    dim: int
    heads: int
    calls: tuple[tuple[int, int], ...]
    steps: int
    restarts: int


@dataclass(frozen=True)
class Note:
    """Work the GPU does not do (downloads, figures) or a unit with nothing to run."""

    what: str


Phase = (Train | Certify | LayerCertify | Audit | Diagnostics | Forwards | DouglasRachford
         | EncoderForward | CrownBounds | LayerStudy | Note)


@dataclass(frozen=True)
class Job:
    """One model's work in one stage: ``stage`` (dvc.yaml's), ``unit`` (what one GPU runs of
    it: a unit stage, ``<stage>@<key>``; ``grid <point>`` for a grid point's two stages; ""
    for a stage run whole), ``name`` (the label its phases' labels start from), the model and
    its phases in order."""

    stage: str
    unit: str
    name: str
    model: Model
    phases: tuple[Phase, ...]


def units(jobs: Iterable[Job]) -> list[str]:
    """The distinct units of ``jobs`` in order (a stage run whole has none)."""
    return list(dict.fromkeys(j.unit for j in jobs if j.unit))


def capped(max_n: int, full: int) -> int:
    """``full`` examples cut to a params cap ``max_n`` (0 = no cap)."""
    return min(max_n, full) if max_n else full


def split_sizes(data: Any, dataset: str) -> dict[str, int]:
    """Labelled examples per split of ``dataset`` that the data stage keeps: the public
    release's (:data:`attncert.pipeline.datasets.TABLE`) cut to ``data.max_train`` (the
    training split) and ``data.max_test`` (every other split) (``data``: the ``data``
    section)."""
    from attncert.pipeline.datasets import TABLE

    return {split: capped(data.max_train if split == "train" else data.max_test, n)
            for split, n in TABLE[dataset].splits.items()}


def image_sizes(data: Any, dataset: str) -> tuple[int, int]:
    """(training, test) images of ``dataset`` the data stage keeps (:func:`split_sizes`)."""
    sizes = split_sizes(data, dataset)
    return sizes["train"], sizes["test"]
