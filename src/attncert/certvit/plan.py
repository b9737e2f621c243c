"""CertViT's plan: its own run (``certvit_main``), one run per Table 1 dataset
(``certvit_table1@<dataset>``: a small ViT trained here) and Table 3's ImageNet route
(``certvit_imagenet``: each hub source, constrained and certified on the user's validation
images). A run pre-trains (or fine-tunes the loaded ViT), then per mode adapts, projects by
Douglas-Rachford, fine-tunes, certifies (the global bound: a float64 forward), audits and
diagnoses the attention; the linear baseline on pixels trains and is audited beside."""

from __future__ import annotations

import dataclasses

from attncert.certvit import methods as cvm
from attncert.certvit.imagenet import TINY
from attncert.certvit.params import Params
from attncert.certvit.study import NO_IMAGENET
from attncert.models.config import hub_vit_config, hub_vit_shape
from attncert.pipeline.datasets import TABLE, stand_in
from attncert.pipeline.jobs import (
    Audit,
    Diagnostics,
    DouglasRachford,
    Forwards,
    Job,
    Model,
    Note,
    Train,
    image_sizes,
)
from attncert.pipeline.params import StudyParams

#: ImageNet's classes and validation images (the split Table 3 certifies)
IMAGENET_CLASSES, IMAGENET_VAL = 1000, 50000


def _projection(cv: Params, cfg, what: str) -> DouglasRachford:
    """Douglas-Rachford on every linear map of ``cfg`` (six per block, the embedding and the
    head): at most ``dr.iterations`` x ``dr.projection_steps`` Haugazeau steps each, a step one
    batched pass over all its recorded pairs (:func:`attncert.certvit.splitting.
    project_outputs`)."""
    return DouglasRachford(what, cfg.depth * 6 + 2, cv.dr.iterations * cv.dr.projection_steps,
                           cv.dr.max_pairs, cfg.dim * max(cfg.mlp_hidden, cfg.dim))


def adapted(cfg):
    """The shape the adapted model runs (:func:`attncert.certvit.adapt.adapt`): ``cfg`` with
    L2 attention, the form its adaptation, fine-tunes, certificate and audits compute."""
    return dataclasses.replace(cfg, attention="l2", qk_tied=False)


def run_jobs(cv: Params, data, unit: str, label: str = "") -> list[Job]:
    """One run of the certvit steps on ``cv.dataset`` (``data``: the ``data`` section)."""
    if cv.source == cvm.PIPELINE:
        cfg = cvm.pretrain_config(stand_in(cv.dataset), **cv.vit.arch())
    elif (shape := hub_vit_shape(cv.source)) is not None:
        d = TABLE[cv.dataset]
        cfg = hub_vit_config(**shape, channels=d.channels, num_classes=d.classes)
    else:
        raise ValueError(f"certvit.source {cv.source!r}: its shape is unknown (neither in "
                         "attncert.models.config.HF_VITS nor a folder with a config.json)")
    model = Model("vit", cfg, family="standard")
    n_tr, n_te = image_sizes(data, cv.dataset)
    n = n_te if cv.n_test == 0 else min(cv.n_test, n_te)

    def train(what: str, epochs: int, t) -> Train:
        return Train(what, n_tr, n_te, epochs, t.batch_size, t.eval_batch_size)
    out = [Job("certvit", unit, f"{label}pre-train / fine-tune", model, (
        train(f"{label}pre-train / fine-tune", cv.train.epochs, cv.train),))]
    for mode in cv.constrain:
        final = cv.finetune if mode == "paper" else cv.spectral
        out.append(Job("certvit", unit, f"{label}{mode}", dataclasses.replace(
                model, config=adapted(cfg)), (
            train(f"{label}{mode}: adaptation fine-tune", cv.adapt_epochs, cv.train),
            _projection(cv, cfg, f"{label}{mode}: Douglas-Rachford (from its matrix sizes)"),
            train(f"{label}{mode}: final fine-tune", final.epochs, final),
            Forwards(f"{label}{mode}: global certificate (float64 forwards)", n,
                     cv.eval_batch_size, fp64=True),
            Audit(f"{label}{mode}: PGD audit", cv.audit.count(n), len(cv.cert_eps),
                  cv.audit.steps, cv.audit.restarts, cv.audit.batch(cv.eval_batch_size)),
            Diagnostics(n, cv.eval_batch_size))))
    # the linear baseline on pixels: trained at the spectral recipe, its radius exact, audited
    d, what = TABLE[cv.dataset], f"{label}linear baseline"
    out.append(Job("certvit", unit, what, Model("linear", (d.channels, d.size, d.classes)), (
        train(what, max(cv.spectral.epochs, 1), cv.spectral),
        Audit(f"{what}: PGD audit", cv.audit.count(n), len(cv.cert_eps), cv.audit.steps,
              cv.audit.restarts, cv.audit.batch(cv.eval_batch_size)))))
    return out


def jobs(p: StudyParams) -> list[Job]:
    """The main run, Table 1's runs, then Table 3's ImageNet route."""
    cv, data = p["certvit"], p["data"]
    out = run_jobs(cv, data, "certvit_main")
    for d in cv.table1.datasets:
        out += run_jobs(cv.table1_run(d, TABLE[d].size), data, f"certvit_table1@{d}",
                        f"Table 1 {d}: ")
    imagenet = []
    for source in cv.imagenet.sources:  # Table 3: the user's validation images
        if source in (TINY, NO_IMAGENET):  # the offline route's tiny ViT, or none: no GPU work
            continue
        if (shape := hub_vit_shape(source)) is None:
            raise ValueError(f"certvit.imagenet.sources: the shape of {source!r} is unknown "
                             "(neither in attncert.models.config.HF_VITS nor a folder with a "
                             "config.json)")
        cfg = hub_vit_config(**shape, channels=3, num_classes=IMAGENET_CLASSES)
        n_val = data.imagenet_val_images or IMAGENET_VAL
        # one image per class of those left after calibration
        n = min(IMAGENET_CLASSES, n_val - min(cv.imagenet.calibration, n_val // 2))
        what, b = f"Table 3 ImageNet {source}", cv.eval_batch_size
        hub = Model("vit", cfg, family="standard")  # its audits' attack step: a standard ViT's
        imagenet.append(Job("certvit", "certvit_imagenet", what, hub, (
            Forwards(f"{what}: loaded accuracy", n, b),  # the hub model, float32
            Diagnostics(n, b, fp64=False))))
        for mode in cv.constrain:  # adapted accuracy, DR, certificate, audit, diagnostics
            what = f"Table 3 ImageNet {source} {mode}"
            imagenet.append(Job("certvit", "certvit_imagenet", what, dataclasses.replace(
                    hub, config=adapted(cfg)), (
                Forwards(f"{what}: adapted accuracy", n, b),
                _projection(cv, cfg, f"{what}: Douglas-Rachford"),
                Forwards(f"{what}: global certificate", n, b, fp64=True),
                Audit(f"{what}: PGD audit", cv.audit.count(n), len(cv.cert_eps), cv.audit.steps,
                      cv.audit.restarts, cv.audit.batch(b)),
                Diagnostics(n, b))))
    return out + (imagenet or [Job("certvit", "certvit_imagenet", "Table 3 ImageNet",
                                   Model("none"), (Note("Table 3 ImageNet: no hub source"),))])
