"""The Hugging Face route end to end on a few images: what the CertViT stage runs on the
ImageNet sample to exercise the GPU-box path (a real checkpoint loaded the same way).

:func:`route` writes a tiny randomly initialised Hugging Face ViT with ``save_pretrained``,
loads it through :func:`attncert.certvit.load_model`, and in every constraining mode adapts
it, constrains it for one Douglas-Rachford iteration and certifies it, audited by L2 PGD (a
broken certificate raises). Its accuracy is that of a random network: it checks the route,
not a result.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from attncert import soundness
from attncert.certvit import stage as cv
from attncert.certvit.adapt import adapt, calibrate_radii
from attncert.certvit.certificate import certify, global_bound
from attncert.certvit.douglas_rachford import DRConfig
from attncert.certvit.load import load_model, tiny_hf_vit
from attncert.certvit.spectral import Budgets
from attncert.data import as_float


def route(sample: Mapping[str, Any], folder: str | Path, modes: Sequence[str], norm: str,
          radius_quantile: float, dr: DRConfig, budgets: Budgets, cert_eps: Sequence[float],
          attack_steps: int, attack_restarts: int, batch_size: int, seed: int,
          device: str | torch.device) -> tuple[dict[str, dict[str, Any]], str]:
    """Per mode: the images, clean accuracy, the pairwise bound adapted and constrained,
    certified and PGD accuracy by eps (str keys) and broken certificates; and a line naming
    the saved folder and the loaded model's config. ``sample``: a processed dataset (its test
    split); ``dr``'s iterations are replaced by 1."""
    folder = tiny_hf_vit(folder, seed=seed)
    hf = load_model(folder).to(device)
    images = sample["test"]["x"]
    x, y = as_float(images).to(device), sample["test"]["y"].to(device)
    out = {}
    for m in modes:
        model = adapt(hf, cv.adaptation(m, norm))
        if norm == "project":
            calibrate_radii(model, hf, images, radius_quantile,
                            slots=cv.calibration_slots(m, model))
        bound = global_bound(model)
        model, _ = cv.constrain_mode(m, model, images, dataclasses.replace(dr, iterations=1),
                                     budgets)
        rep = certify(model, x, y, cert_eps, attack_steps, attack_restarts, batch_size, seed)
        label = f"ImageNet smoke ({m})"
        soundness.require_sound({label: rep["audit"]},
                                {label: (rep["attacked_certified_acc"], rep["pgd_acc"])})
        out[m] = {"images": len(y), "clean_acc": rep["clean_acc"],
                  "lipschitz_adapted": bound.pairwise,
                  "lipschitz_constrained": rep["bound"].pairwise,
                  "certified_acc": {str(e): a for e, a in rep["certified_acc"].items()},
                  "pgd_acc": {str(e): a for e, a in rep["pgd_acc"].items()},
                  "broken": rep["broken"]}
    return out, f"`{folder}` -> `{hf.config}`"
