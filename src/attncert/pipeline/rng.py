"""Seeded random generators: one convention for every random draw in the project.

A generator lives on the device of the tensors it draws for, and every draw names that
device (``torch.randn(shape, generator=g, device=g.device)``) or fills a tensor already
there (``t.normal_(generator=g)``): nothing is drawn on the host and copied over, and a CUDA
run never meets "Expected a 'cuda' device type for generator". One seed gives one stream per
device type: the numbers on a GPU differ from the CPU numbers, each run is reproducible.
Host-side draws (subset indices, batch orders of data that lives on the host) take a
generator on ``"cpu"`` explicitly.
"""

from __future__ import annotations

import torch


def generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded with ``seed``."""
    return torch.Generator(device=torch.device(device)).manual_seed(int(seed))


def check(gen: torch.Generator | None, device: str | torch.device, what: str = "draws") -> None:
    """Raise a one-line error unless ``gen`` (None: the default generator) is on ``device``."""
    if gen is not None and gen.device.type != torch.device(device).type:
        raise ValueError(f"{what}: the generator is on {gen.device} but the tensors it draws "
                         f"for are on {torch.device(device)}; make it with "
                         f"attncert.pipeline.rng.generator(seed, device)")
