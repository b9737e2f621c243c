"""One run of CertViT's steps (:func:`run_steps`) and the ImageNet route (:func:`imagenet_route`).

The certvit stage (:mod:`attncert.stages.certvit`) runs them per unit: the pre-trained (or
pipeline-trained) ViT, adapted per mode, constrained (Douglas-Rachford or spectral balls),
fine-tuned and certified beside the linear baseline, every phase resumable; the methods are
:mod:`attncert.certvit.methods`, the record of the steps :mod:`attncert.certvit.steps`. ``p``
is the section's typed params (:class:`attncert.certvit.params.Params`).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from attncert import diagnostics, soundness
from attncert.certvit import imagenet
from attncert.certvit import methods as cv
from attncert.certvit.adapt import adapt, calibrate_radii
from attncert.certvit.baseline import PixelLinear, certify_linear
from attncert.certvit.certificate import certify, global_bound, lipschitz_table
from attncert.certvit.douglas_rachford import DRConfig
from attncert.certvit.params import Params
from attncert.certvit.spectral import Budgets
from attncert.certvit.steps import (
    Result,
    StepLog,
    baseline_metrics,
    samples_frame,
    stage_metrics,
)
from attncert.data import as_float, load_processed, sample_skipped
from attncert.pipeline.device import resolve_precision
from attncert.pipeline.io import atomic_path
from attncert.pipeline.params import (
    BaseParams,
)
from attncert.training.train import TrainConfig, train_resumable

#: ``imagenet.sources`` entry that skips CertViT Table 3's ImageNet route
NO_IMAGENET = "none"

#: hub checkpoints of CertViT Table 3's models (each loads as an HF ViT) -> its row name
CERTVIT_TABLE3_SOURCES = {"WinKawaks/vit-tiny-patch16-224": "ViT-T/16",
                          "facebook/deit-tiny-patch16-224": "DeiT-T",
                          "google/vit-base-patch16-224": "ViT-B/16"}


@dataclass(frozen=True)
class Configs:
    """The stage's training and constraining settings, built once from :class:`Params`'s
    recipe groups. A phase with 0 epochs is skipped (its config keeps 1 epoch). The adaptation
    fine-tune: ``train``'s recipe for ``adapt_epochs`` (the spectral mode's at
    ``spectral.logit_scale``); the spectral mode's fine-tune: ``spectral``, the radius loss at
    offset L ``spectral.lmt_offset``, L the sets' bound (``linear``, the baseline's, at offset
    ``spectral.lmt_offset``)."""

    pretrain: TrainConfig
    adapt: Mapping[str, TrainConfig]  # per mode
    finetune: TrainConfig  # paper mode; spectral: ``linear`` with the offset L lmt_offset
    linear: TrainConfig
    dr: DRConfig
    budgets: Budgets

    @classmethod
    def build(cls, p: Params, seed: int) -> Configs:
        adapt = max(p.adapt_epochs, 1)
        return cls(
            pretrain=p.train.config(seed, epochs=max(p.train.epochs, 1)),
            adapt={"paper": p.train.config(seed, epochs=adapt),
                   "spectral": p.train.config(seed, epochs=adapt,
                                              logit_scale=p.spectral.logit_scale)},
            finetune=p.finetune.config(seed, epochs=max(p.finetune.epochs, 1)),
            linear=p.spectral.config(seed, epochs=max(p.spectral.epochs, 1)),
            dr=p.dr.config(seed), budgets=p.budget)



def _train(p: Params, base: BaseParams, r: Result, model, cfg: TrainConfig, folder: str,
           note: str = "") -> str:
    """One resumable training phase under ``results_dir/ckpt/folder``; its checkpoint status."""
    precision = resolve_precision(base.precision, r.device)
    fp = cv.phase_fingerprint(model, cfg, p.dataset, r.data["source"], note, precision)
    _, status = train_resumable(model, r.data["train"], r.test, cfg,
                                Path(p.results_dir) / "ckpt" / folder, r.device, fingerprint=fp,
                                precision=precision)
    return status



def run_steps(p: Params, base: BaseParams, device: torch.device, processed_dir: str
              ) -> Result:
    """One run of the steps on ``p``'s ViT (its data from ``processed_dir``): every step of
    every mode, the certificates and their audit (raises
    :class:`attncert.soundness.UnsoundCertificateError` on a broken one); writes
    ``results_dir``'s dr.csv, lipschitz.csv and samples.csv (the ``main`` unit, and each Table
    1 unit in ``Params.table1_run``'s folder). ``Result.metrics``: its record's numbers."""
    torch.manual_seed(base.seed)
    data = load_processed(p.dataset, processed_dir)
    model, origin = cv.source_model(p.source, data, p.vit.arch(), base.seed)
    model.to(device)
    modes = [m for m in cv.MODES if m in p.constrain]
    r = Result(device, data, origin, model, modes, {m: StepLog() for m in modes},
               {m: {} for m in modes})
    cfg = Configs.build(p, base.seed)
    work = Path(p.results_dir)

    # 1. the pre-trained standard ViT (a loaded one: fine-tuned on the dataset, or as loaded)
    t0 = time.perf_counter()
    status = _train(p, base, r, model, cfg.pretrain, "pretrain") if p.train.epochs else (
        "as loaded")
    pre_seconds = time.perf_counter() - t0
    for m in modes:
        r.logs[m].add("pretrained", model, r.test, pre_seconds, None, device, p.eval_batch_size,
                      f"checkpoint: {status}")
    # 2. adaptation, then its fine-tune
    adapted = {m: _adapt(p, base, r, cfg, m) for m in modes}
    # 3. constraining by Douglas-Rachford splitting
    constrained, masks, diagnostics = {}, {}, []
    for m in modes:
        t0 = time.perf_counter()
        constrained[m], result = cv.constrain_mode(m, adapted[m],
                                                   data["train"]["x"][:p.dr.images], cfg.dr,
                                                   cfg.budgets, progress=True)
        masks[m] = result.masks
        _log(p, r, m, "constrained", "constrained", constrained[m], t0,
             f"{p.dr.iterations} DR iterations")
        diagnostics.append(pd.DataFrame(result.diagnostics).assign(mode=m))
    r.diagnostics = pd.concat(diagnostics, ignore_index=True)
    with atomic_path(work / "dr.csv") as tmp:
        r.diagnostics.to_csv(tmp, index=False)
    # 4. the fine-tune after constraining
    final = {m: _finetune(p, base, r, cfg, m, constrained[m], masks[m]) for m in modes}
    labelled = {f"{m}/{k}": b for m in modes for k, b in r.bounds[m].items()}
    r.lipschitz = lipschitz_table(**labelled)
    with atomic_path(work / "lipschitz.csv") as tmp:
        r.lipschitz.to_csv(tmp, index=False)
    # 5. certificates, the linear baseline, the soundness audit
    seconds, linear_seconds = _certify(p, base, r, cfg, final)
    r.metrics = _metrics(p, base, r, seconds, pre_seconds, linear_seconds)
    return r



def _log(p: Params, r: Result, m: str, step: str, label: str, model, t0: float,
         note: str) -> None:
    """Record ``model``'s bound under ``label`` and its step in mode ``m``'s log."""
    r.bounds[m][label] = global_bound(model)
    r.logs[m].add(step, model, r.test, time.perf_counter() - t0, r.bounds[m][label], r.device,
                  p.eval_batch_size, note)



def _adapt(p: Params, base: BaseParams, r: Result, cfg: Configs, m: str):
    """Mode ``m``'s adapted model (module surgery, radii), fine-tuned for ``adapt_epochs``."""
    t0 = time.perf_counter()
    model = adapt(r.pretrained, cv.adaptation(m, p.norm))
    radii = {}
    if p.norm == "project":
        radii = calibrate_radii(model, r.pretrained, r.data["train"]["x"][:p.dr.images],
                                p.radius_quantile, slots=cv.calibration_slots(m, model))
    _log(p, r, m, "adapted", "adapted", model, t0,
         f"norm {p.norm}, radii {', '.join(f'{v:.3g}' for v in radii.values())}")
    t0 = time.perf_counter()
    status = _train(p, base, r, model, cfg.adapt[m], "adapt" if m == "paper" else f"{m}_adapt",
                    f"mode {m}") if p.adapt_epochs else "skipped"
    _log(p, r, m, "adapt_finetuned", "adapt_finetuned", model, t0, f"checkpoint: {status}")
    return model



def _finetune(p: Params, base: BaseParams, r: Result, cfg: Configs, m: str, constrained,
              masks):
    """A copy of mode ``m``'s constrained model, fine-tuned: ``paper`` in ``finetune_scope``,
    ``spectral`` projected back into its sets after every step, with the radius loss."""
    model = copy.deepcopy(constrained)
    t0 = time.perf_counter()
    status = "skipped"
    if m == "paper":
        train_cfg, epochs, note = cfg.finetune, p.finetune.epochs, f"scope {p.finetune_scope}"
    else:
        offset = cv.margin_offset(model, cfg.budgets, p.spectral.lmt_offset)
        train_cfg = dataclasses.replace(cfg.linear, lmt_offset=offset)
        epochs, note = p.spectral.epochs, f"projected, margin offset {offset:.3g}"
    if epochs:
        with cv.finetune_context(m, model, p.finetune_scope, masks, cfg.budgets):
            status = _train(p, base, r, model, train_cfg,
                            "finetune" if m == "paper" else f"{m}_finetune", note)
    model.eval()
    _log(p, r, m, "finetuned", "final", model, t0, f"{note}, checkpoint: {status}")
    return model



def _certify(p: Params, base: BaseParams, r: Result, cfg: Configs, final: Mapping[str, Any]
             ) -> tuple[dict[str, dict[str, float]], float]:
    """Certify every mode's final model and the linear baseline on the first ``n_test`` test
    images (0: all) and audit them on the first ``audit.n``; write samples.csv; fail on a
    broken certificate. Returns the seconds per mode and the baseline's training seconds."""
    n = len(r.test["y"]) if p.n_test == 0 else min(p.n_test, len(r.test["y"]))
    x, y = as_float(r.test["x"][:n]).to(r.device), r.test["y"][:n].to(r.device)
    t0 = time.perf_counter()
    linear = PixelLinear(x[0].numel(), final[r.headline].config.num_classes,
                         base.seed).to(r.device)
    r.baseline_status = _train(p, base, r, linear, cfg.linear, "linear", "linear baseline")
    linear_seconds = time.perf_counter() - t0
    audit = dict(eps_grid=p.cert_eps, attack_steps=p.audit.steps,
                 attack_restarts=p.audit.restarts, batch_size=p.eval_batch_size,
                 seed=base.seed, n_attack=p.audit.n or None,
                 attack_batch_size=p.audit.batch(p.eval_batch_size))
    r.baseline = certify_linear(linear, x, y, **audit)
    r.reports, seconds = {}, {}
    for m in r.modes:
        t0 = time.perf_counter()
        r.reports[m] = certify(final[m], x, y, **audit)
        seconds[m] = {"certify_and_audit": time.perf_counter() - t0}
        # does the certified model's attention do anything (on the same images)
        r.reports[m]["attention"] = diagnostics.attention_diagnostics(final[m], x, y,
                                                                      p.eval_batch_size)
    samples_csv = Path(p.results_dir) / "samples.csv"
    every = r.with_baseline()
    with atomic_path(samples_csv) as tmp:  # the baseline's rows: figures compares like for like
        samples_frame(every, y).to_csv(tmp, index=False)
    soundness.require_sound({m: rep["audit"] for m, rep in every.items()},
                            {m: (rep["attacked_certified_acc"], rep["pgd_acc"])
                             for m, rep in every.items()}, see=str(samples_csv))
    return seconds, linear_seconds



def imagenet_route(p: Params, base: BaseParams, device: torch.device, processed_dir: str
                   ) -> dict[str, Any]:
    """CertViT Table 3's route (:func:`attncert.certvit.imagenet.table3`), every model of
    ``imagenet.sources`` on the user's ImageNet validation images, else the 20-image sample,
    or why it is skipped (ImageNet images have no public download route): the ``imagenet``
    unit's record ({"imagenet": the numbers or "skipped: ...", "imagenet_model", "seconds"})."""
    (Path(p.results_dir) / "imagenet").mkdir(parents=True, exist_ok=True)  # a DVC output
    sources = [s for s in p.imagenet.sources if s != NO_IMAGENET]
    if not sources:
        return {"imagenet": "skipped: imagenet.sources: none", "imagenet_model": "",
                "seconds": 0.0}
    reasons = {}
    for images in ("imagenet_val", "imagenet_sample"):
        reasons[images] = sample_skipped(images, processed_dir)
        if reasons[images] is None:
            break
    else:
        return {"imagenet": "skipped: " + "; ".join(
            why if why.startswith(name) else f"{name}: {why}" for name, why in reasons.items()),
            "imagenet_model": "", "seconds": 0.0}
    t0 = time.perf_counter()
    torch.manual_seed(base.seed)
    cfg = Configs.build(p, base.seed)
    modes = [m for m in cv.MODES if m in p.constrain]
    data = load_processed(images, processed_dir)
    models, lines = {}, []
    for source in sources:
        folder = Path(p.results_dir) / "imagenet" / imagenet.folder_name(source) / "hf"
        modes_out, line = imagenet.table3(
            data, source, folder, modes, p.norm, p.radius_quantile, cfg.dr, cfg.budgets,
            p.imagenet.calibration, p.cert_eps, p.audit.steps, p.audit.restarts,
            p.eval_batch_size, base.seed, device, p.audit.n or None,
            p.audit.batch(p.eval_batch_size))
        models[source] = {"paper_model": CERTVIT_TABLE3_SOURCES.get(source), "modes": modes_out}
        lines.append(line)
    return {"imagenet": {"images": images,
                         "skipped_images": {k: v for k, v in reasons.items() if v},
                         "models": models},
            "imagenet_model": "; ".join(lines), "seconds": time.perf_counter() - t0}



def _metrics(p: Params, base: BaseParams, r: Result, seconds: Mapping[str, Mapping],
             pre_seconds: float, linear_seconds: float) -> dict[str, Any]:
    """One run's numbers: the headline mode's at the top level, every mode's under ``modes``,
    the linear baseline's."""
    per_mode = {m: {**stage_metrics(r.logs[m], r.bounds[m], r.reports[m], seconds[m]),
                    "attention": r.reports[m]["attention"]} for m in r.modes}
    out = {"source": p.source, "dataset": p.dataset, "scale": base.scale,
           "headline_mode": r.headline, **per_mode[r.headline], "modes": per_mode,
           "linear_baseline": baseline_metrics(r.baseline, linear_seconds)}
    # the pre-training is shared by the modes: counted once
    out["total_seconds"] = sum(v["total_seconds"] for v in per_mode.values()) - (
        (len(r.modes) - 1) * pre_seconds) + linear_seconds
    return out
