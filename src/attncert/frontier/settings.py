"""The frontier's settings: ``<kind>-<value>[_<axis><value>...]`` (or ``standard[_p<patch>]``),
parsed into a :class:`Setting` (:func:`parse_setting`); a params check (:func:`settings_ok`)
refuses a malformed one before any work.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attncert.pipeline.params import fail

#: setting kinds: ``<kind>-<value>`` (``standard`` takes no value)
KINDS = {"lmt": "LMT logit offset", "lofast": "LoFAST certified training at radius",
         "linear": "linear baseline, radius margin at offset",
         "standard": "standard (unconstrained) ViT of the same shape, plain cross-entropy"}
#: the certificate every ViT setting is measured with, and the global bound beside it
CERTIFICATE = ("lofast_M", "pairwise")
GLOBAL = ("global", "pairwise")
#: the axes a setting may add after its kind: ``_<axis><value>`` (e.g. ``lofast-0.5_p7_qk1``);
#: each overrides one field of the model (or of the training recipe) ``train_vit`` gives
def flag(text: str) -> bool:
    """An on-only axis value: "1"."""
    if text != "1":
        raise ValueError(text)
    return True


flag.__name__ = "1 (on)"

AXES = {"p": ("patch", int, "patch size (more tokens: a smaller patch)"),
        "tie": ("qk_tied", flag, "keys tied to queries, W^K = W^Q (tie1)"),
        "orth": ("attn_orthogonal", flag, "scaled orthogonal W^Q = W^K, W^V, W^O (orth1)"),
        "qk": ("gamma_qk", float, "spectral norm of W^Q, W^K"),
        "r": ("radius_attn", float, "LayerProject radius of the attention inputs"),
        "vo": ("gamma_vo", float, "spectral norm of W^V, W^O"),
        "mix": ("lofast_mix", float, "weight of the lofast margin's CE"),
        "ent": ("attn_entropy", float, "weight of the attention-entropy penalty"),
        "route": ("route", flag, "the routing task composed from the dataset "
                                 "(attncert.data.routing; route1)"),
        "d": ("depth", int, "number of blocks"),
        "ep": ("epochs", int, "training epochs"),
        "warm": ("lofast_start", float, "share of all steps trained with the plain CE before "
                                        "the lofast margin starts (the pattern learned first)")}
#: axes that change the training recipe
TRAIN_AXES = ("lofast_mix", "attn_entropy", "epochs", "lofast_start")
#: the axes the standard ViT takes (the task's shape and the budget)
STANDARD_AXES = ("patch", "route", "depth", "epochs")
#: axes that change the task (the others change the model)
DATA_AXES = ("route",)


@dataclass(frozen=True)
class Setting:
    """A parsed setting: its kind, its value (None for ``standard``) and the overrides of its
    axes ({ViTConfig or TrainConfig field: value})."""

    kind: str
    value: float | None
    axes: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def is_vit(self) -> bool:
        """A ViT that is certified (not the linear baseline, not the standard ViT)."""
        return self.kind in ("lmt", "lofast")

    @property
    def routed(self) -> bool:
        """Trained and evaluated on the routing task (:mod:`attncert.data.routing`)."""
        return bool(self.axes.get("route"))

    def model_axes(self) -> dict[str, Any]:
        return {k: v for k, v in self.axes.items() if k not in TRAIN_AXES + DATA_AXES}

    def train_axes(self) -> dict[str, Any]:
        return {k: v for k, v in self.axes.items() if k in TRAIN_AXES}


def _setting_error(setting: str, why: str) -> ValueError:
    return ValueError(f"{setting!r}: {why}. A setting is <kind>-<value>[_<axis><value>...], "
                      f"kind one of {', '.join(k for k in KINDS if k != 'standard')} and value "
                      f"> 0 (e.g. lofast-0.5), or standard[_<axis><value>...]; axes: "
                      + ", ".join(f"{a} ({f})" for a, (f, _, _) in AXES.items()))


def parse_setting(setting: str) -> Setting:
    """``"lofast-0.5_p7_qk1"`` -> Setting("lofast", 0.5, {"patch": 7, "gamma_qk": 1.0});
    ValueError naming the grammar for anything else."""
    head, *tokens = setting.split("_")
    if head == "standard":
        kind, v = "standard", None
    else:
        kind, _, value = head.partition("-")
        try:
            v = float(value)
        except ValueError:
            v = -1.0
        if kind not in KINDS or kind == "standard" or not v > 0:
            raise _setting_error(setting, "not <kind>-<value>")
    axes: dict[str, Any] = {}
    for tok in tokens:
        name = next((a for a in sorted(AXES, key=len, reverse=True) if tok.startswith(a)), None)
        if name is None:
            raise _setting_error(setting, f"unknown axis {tok!r}")
        field_, cast, _ = AXES[name]
        try:
            val = cast(tok[len(name):])
        except ValueError:
            raise _setting_error(setting, f"axis {tok!r}: {tok[len(name):]!r} is not a "
                                          f"{cast.__name__}") from None
        if not val > 0 or field_ in axes:
            raise _setting_error(setting, f"axis {tok!r}: a value > 0, once")
        axes[field_] = val
    if kind == "linear" and axes:
        raise _setting_error(setting, "the linear baseline takes no axes")
    if kind == "standard" and set(axes) - set(STANDARD_AXES):
        raise _setting_error(setting, "the standard ViT takes the p, route, d and ep axes only")
    if kind != "lofast" and "lofast_start" in axes:
        raise _setting_error(setting, "the warm axis delays the lofast margin: lofast-* only")
    if axes.get("lofast_start", 0) >= 1:
        raise _setting_error(setting, "the warm axis is a share of the steps, below 1")
    return Setting(kind, v, axes)


def settings_ok(key: str, v: list) -> None:
    for s in v:
        try:
            parse_setting(s)
        except ValueError as exc:
            fail(key, str(exc))
    if not any(parse_setting(s).is_vit for s in v):
        fail(key, "needs at least one ViT setting (lmt-* or lofast-*)")
