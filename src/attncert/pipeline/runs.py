"""One ViT grid point: its name and its folder.

A grid point (a DVC matrix item of ``vit_grid``, :class:`GridPoint`) is a dataset, a depth, a
number of heads and gamma_vo; the ``train_vit`` stage (:mod:`attncert.stages.train_vit`) builds
its configs from its section. Its folder ``<results_dir>/<name>/`` holds ``ckpt/`` (the per-epoch
checkpoint, kept between ``dvc repro`` runs so that training resumes; cleared when the run's
:func:`attncert.training.checkpoint.fingerprint` changes,
:func:`attncert.training.train.train_resumable`), ``model.pt`` (the
final model) and ``train.json`` (per-epoch metrics).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attncert.pipeline.params import IMAGE_DATASETS, one_of, param, positive


@dataclass(frozen=True)
class GridPoint:
    """One point of ``vit_grid`` as a matrix stage gets it (nbrun ``--item``): one value of
    each list, parsed with ``params.parse_section("vit_grid", raw, GridPoint)``."""

    results_dir: str = param()
    dataset: str = param(one_of(*IMAGE_DATASETS))
    depth: int = param(positive)
    heads: int = param(positive)
    gamma_vo: float = param(positive)

    @property
    def name(self) -> str:
        """The point's folder name (:func:`run_name`)."""
        return run_name(self.dataset, self.depth, self.heads, self.gamma_vo)

    @property
    def run_dir(self) -> Path:
        """``<results_dir>/<name>``: the point's checkpoint, model and training metrics."""
        return Path(self.results_dir) / self.name


def run_name(dataset: str, depth: int, heads: int, gamma_vo: float) -> str:
    """The grid point's folder name; dvc.yaml spells the same template with ``${item.*}``."""
    return f"{dataset}-L{depth}-H{heads}-vo{gamma_vo}"
