"""CertViT Table 3's route: ImageNet-pretrained ViTs constrained and certified on ImageNet
validation images (the user's, or the 20-image sample offline).

:func:`table3` loads one ViT through :func:`attncert.certvit.load_model` (a hub id such as
``google/vit-base-patch16-224`` or a ``save_pretrained`` folder; :data:`TINY` writes a tiny
randomly initialised one first, which checks the route on offline machines, not a result),
and in every constraining mode adapts it, calibrates the norm radii and constrains it by
Douglas-Rachford on the first images, then certifies one image per class of the rest (CertViT
sec. 4.2: 1000 validation images, one per class, drawn at random; :func:`one_per_class`),
audited by L2 PGD (a broken certificate raises). There is no fine-tune: no ImageNet training
images are used here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from attncert import diagnostics, soundness
from attncert.certvit import methods as cv
from attncert.certvit.adapt import adapt, calibrate_radii
from attncert.certvit.certificate import certify, global_bound
from attncert.certvit.douglas_rachford import DRConfig
from attncert.certvit.load import hub_revision, load_model, tiny_hf_vit
from attncert.certvit.spectral import Budgets
from attncert.data import as_float
from attncert.pipeline import rng

#: ``imagenet.sources`` entry of a tiny random HF ViT (224 pixels, patch 16, 1000 classes)
TINY = "tiny"


def one_per_class(labels: torch.Tensor, start: int, seed: int) -> torch.Tensor:
    """Indices (sorted) of one image per class among ``labels[start:]``, each drawn at random
    with ``seed`` (CertViT sec. 4.2's evaluation set: its 1000 classes, one image each)."""
    g = rng.generator(seed, "cpu")  # host indices into host data
    rest = torch.arange(start, len(labels))
    order = rest[torch.randperm(len(rest), generator=g)]
    seen: dict[int, int] = {}
    for i in order.tolist():
        seen.setdefault(int(labels[i]), i)
    return torch.tensor(sorted(seen.values()), dtype=torch.long)


def folder_name(source: str) -> str:
    """A folder name for ``source`` (hub id or path) under the route's work folder."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in source.strip("/"))[-80:]


def _accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> float:
    model.eval()
    with torch.no_grad():
        right = sum(int((model(x[i:i + batch_size]).argmax(1) == y[i:i + batch_size]).sum())
                    for i in range(0, len(y), batch_size))
    return right / max(len(y), 1)


def _attention(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int
               ) -> dict[str, float]:
    """Does the model's attention do anything on the certified images: the points of clean
    accuracy lost with uniform and with identity attention, the rows' entropy / log n."""
    with torch.no_grad():
        a = diagnostics.attention_diagnostics(model, x, y, batch_size)
    return {k: a[k] for k in ("uniform_gap", "identity_gap", "entropy_mean")}


def table3(data: Mapping[str, Any], source: str, folder: str | Path, modes: Sequence[str],
           norm: str, radius_quantile: float, dr: DRConfig, budgets: Budgets,
           calibration: int, cert_eps: Sequence[float], attack_steps: int,
           attack_restarts: int, batch_size: int, seed: int, device: str | torch.device,
           n_attack: int | None = None, attack_batch_size: int | None = None
           ) -> tuple[dict[str, dict[str, Any]], str]:
    """Per mode: the images certified and used for calibration, the loaded model's clean
    accuracy, the adapted and final ones, the pairwise bound adapted and constrained,
    certified and PGD accuracy by eps (str keys; PGD on the first ``n_attack``), broken
    certificates, the loaded and the constrained model's attention diagnostics
    (``pretrained_attention``, ``attention``: :func:`_attention`); and a line naming the
    loaded model. ``data``: a processed image set (its
    test split); its first ``calibration`` images (at most half) set the norm radii and
    Douglas-Rachford's recorded pairs; one image per class of the rest (:func:`one_per_class`)
    is certified. With ``source`` :data:`TINY` Douglas-Rachford runs one iteration."""
    if source == TINY:
        source = str(tiny_hf_vit(folder, seed=seed))
        dr = dataclasses.replace(dr, iterations=1)
    hf = load_model(source).to(device)
    images, labels = data["test"]["x"], data["test"]["y"]
    if len(labels) < 2:
        raise ValueError(f"Table 3 needs at least 2 images (calibration and certification), "
                         f"got {len(labels)}")
    k = max(1, min(calibration, len(labels) // 2))
    cal = images[:k]
    chosen = one_per_class(labels, k, seed)
    x, y = as_float(images[chosen]).to(device), labels[chosen].to(device)
    pretrained_acc = _accuracy(hf, x, y, batch_size)
    loaded_attention = _attention(hf, x, y, batch_size)
    out = {}
    for m in modes:
        model = adapt(hf, cv.adaptation(m, norm))
        if norm == "project":
            calibrate_radii(model, hf, cal, radius_quantile,
                            slots=cv.calibration_slots(m, model))
        bound = global_bound(model)
        adapted_acc = _accuracy(model, x, y, batch_size)
        model, _ = cv.constrain_mode(m, model, cal, dr, budgets)
        rep = certify(model, x, y, cert_eps, attack_steps, attack_restarts, batch_size, seed,
                      n_attack=n_attack, attack_batch_size=attack_batch_size)
        label = f"ImageNet ({m})"
        soundness.require_sound({label: rep["audit"]},
                                {label: (rep["attacked_certified_acc"], rep["pgd_acc"])})
        out[m] = {"images": len(y), "classes": int(y.unique().numel()), "calibration_images": k,
                  "pretrained_clean_acc": pretrained_acc, "adapted_clean_acc": adapted_acc,
                  "clean_acc": rep["clean_acc"], "lipschitz_adapted": bound.pairwise,
                  "lipschitz_constrained": rep["bound"].pairwise,
                  "certified_acc": {str(e): a for e, a in rep["certified_acc"].items()},
                  "n_attacked": rep["n_attacked"],
                  "pgd_acc": {str(e): a for e, a in rep["pgd_acc"].items()},
                  "broken": rep["broken"], "pretrained_attention": loaded_attention,
                  "attention": _attention(model, x, y, batch_size)}
    revision = hub_revision(hf)
    return out, f"`{source}`" + (f" (hub revision {revision})" if revision else "") + \
        f" -> `{hf.config}`"
