"""Figure functions: each draws one report figure from saved results and returns it."""

from __future__ import annotations

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
