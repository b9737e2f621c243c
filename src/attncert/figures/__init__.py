"""Figure functions: each draws one report figure from saved results and returns it."""

from __future__ import annotations


def show(fig, path=None) -> None:
    """Display a figure once in a notebook (optionally saving a PNG), then release it."""
    import matplotlib.pyplot as plt
    from IPython.display import display

    if path is not None:
        from attncert.pipeline.io import atomic_path

        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
    display(fig)
    plt.close(fig)
