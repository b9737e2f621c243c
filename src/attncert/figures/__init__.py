"""Figure functions: each draws one report figure from saved results and returns it."""

from __future__ import annotations

from typing import Any


class _Seaborn:
    """seaborn, imported at its first attribute access: it imports scipy, about a second of
    every process that imports a stage (the runner validating the params, a unit's kernel)
    whether or not it draws. A stand-in, not an entry of ``sys.modules``: importlib's
    ``LazyLoader`` would be loaded at once by anything that scans ``sys.modules`` (torch's
    custom-op registration does, through ``inspect.getmodule``)."""

    def __getattr__(self, attr: str) -> Any:
        import seaborn

        return getattr(seaborn, attr)

    def __repr__(self) -> str:
        return "<seaborn, imported at first use>"


#: seaborn for every figure module (:class:`_Seaborn`)
sns = _Seaborn()

#: the resolution of every saved figure (the index page shows the key figures at this size)
EXPORT_DPI = 120


def save_png(fig, path) -> None:
    """Write ``fig`` as a PNG at :data:`EXPORT_DPI`, atomically."""
    from attncert.pipeline.io import atomic_path

    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=EXPORT_DPI, bbox_inches="tight")


def show(fig, path=None) -> None:
    """Display a figure once in a notebook (optionally saving a PNG), then release it."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    if path is not None:
        save_png(fig, path)
    display(fig)
    plt.close(fig)
