"""Headline rows: the numbers of a stage's metrics file that the report and README show.

Each stage module (``attncert.stages``) turns its metrics into rows with :func:`row`::

    {"key", "label", "ours", "paper", "source", "unit", "brief"}

``ours`` is the metrics file's number as written (accuracies stay fractions, or percentages
with unit "percent" where the stage writes them so), ``paper`` the paper's number in the same
unit where the paper gives one (``source`` names the table), ``unit`` one of :data:`UNITS`,
and ``brief`` marks the rows shown in README and index.html.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

UNITS = ("fraction", "percent", "ratio", "seconds", "count", "value", "flag")


def scale_caveat(m: Mapping[str, Any]) -> str:
    """"" for a metrics file written at the paper scale, else the caveat a paper number's
    source carries beside it: ours is a smaller model or budget (``m["scale"]``, the
    ``base.scale`` the stage ran at; a file without one is taken as the paper scale's)."""
    scale = m.get("scale", "paper")
    return "" if scale == "paper" else (f"; ours at the {scale} scale: a smaller model and "
                                        "budget, not like for like")


def row(key: str, label: str, ours: Any, unit: str, paper_value: float | None = None,
        source: str | None = None, brief: bool = False) -> dict[str, Any]:
    """One headline row; ``source`` is kept only beside a paper value."""
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}")
    return {"key": key, "label": label, "ours": ours, "paper": paper_value,
            "source": source if paper_value is not None else None, "unit": unit,
            "brief": brief}


def eps_match(eps: str | float, grid: Sequence[float]) -> int | None:
    """Index of ``eps`` (a metrics key like "0.1") in a paper's eps grid, else None."""
    e = float(eps)
    return next((i for i, g in enumerate(grid) if abs(g - e) < 1e-9), None)


#: the keys of a stage's DVC headline (:func:`attncert.pipeline.nbrun.write_headline`), the same in
#: every stage so that ``dvc metrics show`` prints one narrow table: clean accuracy; certified and
#: PGD accuracy at ``eps`` (the middle radius of the stage's grid); broken certificates; the
#: largest bound / PGD ratio (tightness); an average certified radius (text); the points of
#: clean accuracy lost when every attention matrix is replaced by uniform weights
#: (``attn_uniform_gap``, :mod:`attncert.diagnostics`) and LoFAST(M)'s median certified radius
#: over the global bound's (``local_global_radius``); and, added by nbrun, the stage's seconds,
#: peak resident memory (GB) and, on a GPU, peak GPU memory allocated (GB)
NUMBERS = ("clean", "cert", "pgd", "eps", "broken", "ratio", "radius", "attn_uniform_gap",
           "local_global_radius", "seconds", "peak_gb", "gpu_peak_gb")


def middle_eps(by_eps: Mapping[str, Any]) -> str | None:
    """The middle key (by value) of a mapping keyed by eps strings, None when empty."""
    keys = sorted(by_eps, key=float)
    return keys[len(keys) // 2] if keys else None


def numbers(**values: Any) -> dict[str, float]:
    """A headline of :data:`NUMBERS` (unknown keys refused), without the values that are None."""
    unknown = sorted(set(values) - set(NUMBERS))
    if unknown:
        raise ValueError(f"headline keys {unknown} are not in {NUMBERS}")
    return {k: v for k, v in values.items() if v is not None}
