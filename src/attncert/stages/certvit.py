"""The CertViT stage: a pre-trained standard ViT adapted, constrained by Douglas-Rachford
splitting, fine-tuned and certified in every constraining mode side by side, beside a linear
classifier on pixels. Every training phase is a resumable checkpoint folder; a broken
certificate fails the unit. The methods (adaptation, the constraining modes and their budgets,
the certificate) live in :mod:`attncert.certvit`.

The stage is split into independent units (:func:`units`, one DVC stage each, so that several
GPUs share it): ``main`` (the section's own ViT, ``certvit_main``), ``table1-<dataset>`` (a
CertViT Table 1 ViT trained here, ``certvit_table1@<dataset>``) and ``imagenet`` (CertViT
Table 3's ImageNet-pretrained ViTs, ``certvit_imagenet``). :func:`run_unit` writes one record
per unit; :func:`run` gathers them into the stage's metrics file.
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

from attncert import soundness
from attncert.certvit import imagenet
from attncert.certvit import stage as cv
from attncert.certvit.adapt import NORMS, adapt, calibrate_radii
from attncert.certvit.baseline import PixelLinear, certify_linear
from attncert.certvit.certificate import certify, global_bound, lipschitz_table
from attncert.certvit.douglas_rachford import DRConfig
from attncert.certvit.spectral import Budgets
from attncert.certvit.steps import (
    BASELINE,
    Result,
    StepLog,
    baseline_metrics,
    samples_frame,
    stage_metrics,
)
from attncert.data import as_float, load_processed, sample_skipped
from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.params import (
    IMAGE_DATASETS,
    BaseParams,
    ParamsError,
    nonneg,
    one_of,
    param,
    positive,
    unique,
    unit_interval,
)
from attncert.pipeline.records import read_record, unit_key
from attncert.report.headline import eps_match, middle_eps, numbers, row
from attncert.report.paper import CERTVIT_TABLE3, certvit_pixel_eps, certvit_table1
from attncert.training.precision import resolve_precision
from attncert.training.train import TrainConfig, train_resumable

#: The fine-tune losses after constraining (``paper`` mode; ``spectral`` trains with the
#: certificate's own margin, :mod:`attncert.training.train`'s "radius").
MARGINS = ("none", "lmt")
#: ``imagenet_sources`` entry that skips CertViT Table 3's ImageNet route
NO_IMAGENET = "none"
#: CertViT's MNIST eps (Table 1: 1.58 on its normalised input) in our pixel space: the report
#: compares certified accuracy at it.
PAPER_EPS = certvit_pixel_eps("mnist")
#: hub checkpoints of CertViT Table 3's models (each loads as an HF ViT) -> its row name
CERTVIT_TABLE3_SOURCES = {"WinKawaks/vit-tiny-patch16-224": "ViT-T/16",
                          "facebook/deit-tiny-patch16-224": "DeiT-T",
                          "google/vit-base-patch16-224": "ViT-B/16"}


def table1_eps(dataset: str) -> float:
    """The pixel-space l2 radius CertViT's Table 1 claim covers on ``dataset``: its eps (1.58
    on MNIST, 0.141 on CIFAR) times the smallest std of its input normalisation
    (:func:`attncert.report.paper.certvit_pixel_eps`); MNIST's for a dataset it does not report."""
    return certvit_pixel_eps(dataset) or PAPER_EPS


@dataclass(frozen=True)
class Params:
    """params.yaml ``certvit``: a pre-trained standard ViT, adapted (L2 attention, Lipschitz
    norms), constrained by Douglas-Rachford splitting, fine-tuned, certified."""

    source: str = param(doc="'pipeline' (train a standard ViT here), an HF hub id, an HF "
                            "folder or a save_vit checkpoint file")
    dataset: str = param(one_of(*IMAGE_DATASETS))
    processed_dir: str = param(doc="the data stage's processed_dir")
    patch: int = param(positive, doc="the pipeline's standard ViT (source 'pipeline' only)")
    dim: int = param(positive)
    depth: int = param(positive)
    heads: int = param(positive)
    mlp_hidden: int = param(positive)
    pretrain_epochs: int = param(nonneg, doc="pipeline: training from scratch; loaded: "
                                             "fine-tuning on the dataset (0 = as loaded)")
    batch_size: int = param(positive)
    lr: float = param(positive, doc="pre-training and adaptation fine-tune")
    weight_decay: float = param(nonneg)
    warmup_steps: int = param(nonneg)
    norm: str = param(one_of(*NORMS), doc="LayerNorm replacement")
    radius_quantile: float = param(unit_interval, doc="ProjectNorm radius: this quantile of "
                                                      "the pre-trained token norms")
    adapt_epochs: int = param(nonneg)
    dr_threshold: float = param(positive, doc="soft threshold / RMS of the layer's weights")
    dr_eta: float = param(positive, doc="output tolerance / RMS of the layer's outputs")
    dr_relaxation: float = param(positive)
    dr_iterations: int = param(positive)
    dr_projection_steps: int = param(positive)
    dr_batch_size: int = param(positive, doc="recorded pairs per constraint set")
    dr_max_pairs: int = param(positive, doc="recorded pairs per layer")
    dr_images: int = param(positive, doc="training images whose tokens are recorded")
    finetune_epochs: int = param(nonneg, doc="the fine-tune after constraining")
    finetune_scope: str = param(one_of(*cv.FINETUNE_SCOPES),
                                doc="masked: every weight, pruned ones kept at zero; "
                                    "bound_free: only what the bound does not depend on")
    finetune_lr: float = param(positive)
    finetune_margin: str = param(one_of(*MARGINS))
    lmt_offset: float = param(nonneg)
    constrain: list[str] = param(one_of(*cv.MODES), unique,
                                 doc="modes run side by side: paper (l1 Douglas-Rachford, "
                                     "the steps above) | spectral (spectral-norm balls)")
    budget_embed: float = param(positive, doc="spectral: ||E|| / min(std) of the patch "
                                              "embedding with the input normalisation")
    budget_q: float = param(positive, doc="spectral: ||W^Q|| of every head")
    budget_v: float = param(positive, doc="spectral: ||W^V|| of every head")
    budget_o: float = param(positive, doc="spectral: ||W^O||")
    budget_fc1: float = param(positive, doc="spectral: ||W_1|| of every MLP")
    budget_fc2: float = param(positive, doc="spectral: ||W_2|| of every MLP")
    budget_gain: float = param(positive, doc="spectral: max|gamma| of every norm")
    spectral_epochs: int = param(nonneg, doc="spectral: projected fine-tune after constraining")
    spectral_lr: float = param(positive)
    margin_eps: float = param(nonneg, doc="spectral: the radius loss's eps (offset L eps, "
                                          "L the sets' bound)")
    logit_scale: float = param(positive, doc="spectral: CE temperature (loss only)")
    n_test: int = param(nonneg, doc="the first n test images are certified (0 = the whole "
                                    "split)")
    n_attack: int = param(positive, doc="the first n certified images are attacked (PGD audit)")
    eval_batch_size: int = param(positive, doc="images per certificate and accuracy pass")
    attack_batch_size: int = param(positive, doc="images attacked at once by the PGD audit "
                                                 "(halved on a CUDA out-of-memory error)")
    cert_eps: list[float] = param(positive, unique)
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    table1_datasets: list[str] = param(one_of(*IMAGE_DATASETS), unique,
                                       doc="CertViT Table 1: per dataset a small standard ViT "
                                           "trained here (the table1_* shape and schedule), "
                                           "then every step above (empty: none)")
    table1_grid: dict[str, int] = param(doc="Table 1 ViTs, per dataset: patches per image side "
                                            "(patch = image size / grid)")
    table1_dim: dict[str, int] = param(doc="Table 1 ViTs, per dataset (as every table1_ "
                                           "mapping): width")
    table1_depth: dict[str, int] = param()
    table1_heads: dict[str, int] = param()
    table1_mlp_hidden: dict[str, int] = param()
    table1_pretrain_epochs: dict[str, int] = param(doc="Table 1 ViTs: training from scratch")
    table1_batch_size: int = param(positive)
    table1_lr: float = param(positive, doc="Table 1 ViTs: training and the adaptation "
                                           "fine-tune")
    imagenet_sources: list[str] = param(unique, doc="CertViT Table 3: ImageNet-pretrained ViTs "
                                        "(hub ids or HF folders) on the user's ImageNet "
                                        "validation images (the 20-image sample without them); "
                                        "'tiny': a tiny random HF ViT (the route, not a "
                                        "result); [none] or []: not run")
    imagenet_calibration: int = param(positive, doc="Table 3: the first n images set the norm "
                                                    "radii and Douglas-Rachford's pairs (at "
                                                    "most half); one image per class of the "
                                                    "rest is certified")
    work_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        if self.dim % self.heads:
            raise ParamsError(f"certvit.heads: dim = {self.dim} is not divisible by heads = "
                              f"{self.heads}")
        if not 0 < self.dr_relaxation < 2:
            raise ParamsError(f"certvit.dr_relaxation: must be in (0, 2), got "
                              f"{self.dr_relaxation!r}")
        if not self.constrain:
            raise ParamsError("certvit.constrain: needs at least one mode (paper, spectral)")
        if PAPER_EPS not in self.cert_eps:
            raise ParamsError(f"certvit.cert_eps: must include {PAPER_EPS} (CertViT's MNIST "
                              "eps, compared in the report)")
        shapes = ("grid", "dim", "depth", "heads", "mlp_hidden", "pretrain_epochs")
        for name in shapes:
            values = getattr(self, f"table1_{name}")
            lacking = [d for d in self.table1_datasets if d not in values]
            if lacking:
                raise ParamsError(f"certvit.table1_{name}: needs an entry for {lacking} (one "
                                  f"per dataset of table1_datasets), got {sorted(values)}")
            if any(v <= 0 for v in values.values()):
                raise ParamsError(f"certvit.table1_{name}: must be > 0, got {values}")
        for d in self.table1_datasets:
            if self.table1_dim[d] % self.table1_heads[d]:
                raise ParamsError(f"certvit.table1_heads: {d}: table1_dim {self.table1_dim[d]} "
                                  f"is not divisible by {self.table1_heads[d]} heads")
        for d in self.table1_datasets:
            if table1_eps(d) not in self.cert_eps:
                raise ParamsError(f"certvit.cert_eps: must include {table1_eps(d)} (CertViT's "
                                  f"eps for {d}) while table1_datasets lists {d!r}")

    def table1(self, dataset: str, image_size: int) -> Params:
        """The section for the Table 1 run on ``dataset`` (images of ``image_size`` pixels):
        a small ViT trained here, its own folder and metrics file, no further runs."""
        grid = self.table1_grid[dataset]
        if image_size % grid:
            raise ParamsError(f"certvit.table1_grid: {dataset}'s {image_size}-pixel images do "
                              f"not split into {grid} patches per side")
        work = Path(self.work_dir) / "table1" / dataset
        return dataclasses.replace(
            self, source=cv.PIPELINE, dataset=dataset, patch=image_size // grid,
            dim=self.table1_dim[dataset], depth=self.table1_depth[dataset],
            heads=self.table1_heads[dataset], mlp_hidden=self.table1_mlp_hidden[dataset],
            pretrain_epochs=self.table1_pretrain_epochs[dataset],
            batch_size=self.table1_batch_size, lr=self.table1_lr, table1_datasets=[],
            imagenet_sources=[], work_dir=str(work), metrics=str(work / "metrics.json"))


@dataclass(frozen=True)
class Configs:
    """The stage's training and constraining settings, built once from :class:`Params`. A
    phase with 0 epochs is skipped (its config keeps 1 epoch). The spectral mode's fine-tunes:
    CE at ``logit_scale``, then the radius loss at offset L ``margin_eps`` (``linear``, the
    baseline's, at offset ``margin_eps``), L the sets' bound."""

    pretrain: TrainConfig
    adapt: Mapping[str, TrainConfig]  # per mode
    finetune: TrainConfig  # paper mode; spectral: ``linear`` with the offset L margin_eps
    linear: TrainConfig
    dr: DRConfig
    budgets: Budgets

    @classmethod
    def build(cls, p: Params, seed: int) -> Configs:
        phase = dict(batch_size=p.batch_size, weight_decay=p.weight_decay,
                     eval_batch_size=p.eval_batch_size, seed=seed)
        adapt_cfg = TrainConfig(epochs=max(p.adapt_epochs, 1), lr=p.lr,
                                warmup_steps=p.warmup_steps, **phase)
        return cls(
            pretrain=TrainConfig(epochs=max(p.pretrain_epochs, 1), lr=p.lr,
                                 warmup_steps=p.warmup_steps, **phase),
            adapt={"paper": adapt_cfg,
                   "spectral": dataclasses.replace(adapt_cfg, logit_scale=p.logit_scale)},
            finetune=TrainConfig(epochs=max(p.finetune_epochs, 1), lr=p.finetune_lr,
                                 margin=p.finetune_margin, lmt_offset=p.lmt_offset, **phase),
            linear=TrainConfig(epochs=max(p.spectral_epochs, 1), lr=p.spectral_lr,
                               warmup_steps=p.warmup_steps, margin="radius",
                               lmt_offset=p.margin_eps, logit_scale=p.logit_scale, **phase),
            dr=DRConfig(threshold=p.dr_threshold, eta=p.dr_eta, relaxation=p.dr_relaxation,
                        iterations=p.dr_iterations, projection_steps=p.dr_projection_steps,
                        batch_size=p.dr_batch_size, max_pairs=p.dr_max_pairs, seed=seed),
            budgets=Budgets(embed=p.budget_embed, q=p.budget_q, v=p.budget_v, o=p.budget_o,
                            fc1=p.budget_fc1, fc2=p.budget_fc2, gain=p.budget_gain))


def _train(p: Params, base: BaseParams, r: Result, model, cfg: TrainConfig, folder: str,
           note: str = "") -> str:
    """One resumable training phase under ``work_dir/ckpt/folder``; its checkpoint status."""
    precision = resolve_precision(base.precision, r.device)
    fp = cv.phase_fingerprint(model, cfg, p.dataset, r.data["source"], note, precision)
    _, status = train_resumable(model, r.data["train"], r.test, cfg,
                                Path(p.work_dir) / "ckpt" / folder, r.device, fingerprint=fp,
                                precision=precision)
    return status


def run_main(p: Params, base: BaseParams, device: torch.device) -> Result:
    """One run of the steps on ``p``'s ViT: every step of every mode, the certificates and
    their audit (raises :class:`attncert.soundness.UnsoundCertificateError` on a broken one);
    writes ``work_dir``'s dr.csv, lipschitz.csv and samples.csv (the ``main`` unit, and each
    Table 1 unit in ``Params.table1``'s folder). ``Result.metrics``: its record's numbers."""
    torch.manual_seed(base.seed)
    data = load_processed(p.dataset, p.processed_dir)
    architecture = dict(patch=p.patch, dim=p.dim, depth=p.depth, heads=p.heads,
                        mlp_hidden=p.mlp_hidden)
    model, origin = cv.source_model(p.source, data, architecture, base.seed)
    model.to(device)
    modes = [m for m in cv.MODES if m in p.constrain]
    r = Result(device, data, origin, model, modes, {m: StepLog() for m in modes},
               {m: {} for m in modes})
    cfg = Configs.build(p, base.seed)
    work = Path(p.work_dir)

    # 1. the pre-trained standard ViT (a loaded one: fine-tuned on the dataset, or as loaded)
    t0 = time.perf_counter()
    status = _train(p, base, r, model, cfg.pretrain, "pretrain") if p.pretrain_epochs else (
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
                                                   data["train"]["x"][:p.dr_images], cfg.dr,
                                                   cfg.budgets, progress=True)
        masks[m] = result.masks
        _log(p, r, m, "constrained", "constrained", constrained[m], t0,
             f"{p.dr_iterations} DR iterations")
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
        radii = calibrate_radii(model, r.pretrained, r.data["train"]["x"][:p.dr_images],
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
        train_cfg, epochs, note = cfg.finetune, p.finetune_epochs, f"scope {p.finetune_scope}"
    else:
        offset = cv.margin_offset(model, cfg.budgets, p.margin_eps)
        train_cfg = dataclasses.replace(cfg.linear, lmt_offset=offset)
        epochs, note = p.spectral_epochs, f"projected, margin offset {offset:.3g}"
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
    images (0: all) and audit them on the first ``n_attack``; write samples.csv; fail on a
    broken certificate. Returns the seconds per mode and the baseline's training seconds."""
    n = len(r.test["y"]) if p.n_test == 0 else min(p.n_test, len(r.test["y"]))
    x, y = as_float(r.test["x"][:n]).to(r.device), r.test["y"][:n].to(r.device)
    t0 = time.perf_counter()
    linear = PixelLinear(x[0].numel(), final[r.headline].config.num_classes,
                         base.seed).to(r.device)
    r.baseline_status = _train(p, base, r, linear, cfg.linear, "linear", "linear baseline")
    linear_seconds = time.perf_counter() - t0
    audit = dict(eps_grid=p.cert_eps, attack_steps=p.attack_steps,
                 attack_restarts=p.attack_restarts, batch_size=p.eval_batch_size,
                 seed=base.seed, n_attack=p.n_attack, attack_batch_size=p.attack_batch_size)
    r.baseline = certify_linear(linear, x, y, **audit)
    r.reports, seconds = {}, {}
    for m in r.modes:
        t0 = time.perf_counter()
        r.reports[m] = certify(final[m], x, y, **audit)
        seconds[m] = {"certify_and_audit": time.perf_counter() - t0}
    samples_csv = Path(p.work_dir) / "samples.csv"
    every = r.with_baseline()
    with atomic_path(samples_csv) as tmp:  # the baseline's rows: figures compares like for like
        samples_frame(every, y).to_csv(tmp, index=False)
    soundness.require_sound({m: rep["audit"] for m, rep in every.items()},
                            {m: (rep["attacked_certified_acc"], rep["pgd_acc"])
                             for m, rep in every.items()}, see=str(samples_csv))
    return seconds, linear_seconds


def imagenet_route(p: Params, base: BaseParams, device: torch.device) -> dict[str, Any]:
    """CertViT Table 3's route (:func:`attncert.certvit.imagenet.table3`), every model of
    ``imagenet_sources`` on the user's ImageNet validation images, else the 20-image sample,
    or why it is skipped (ImageNet images have no public download route): the ``imagenet``
    unit's record ({"imagenet": the numbers or "skipped: ...", "imagenet_model", "seconds"})."""
    (Path(p.work_dir) / "imagenet").mkdir(parents=True, exist_ok=True)  # a DVC output, even empty
    sources = [s for s in p.imagenet_sources if s != NO_IMAGENET]
    if not sources:
        return {"imagenet": "skipped: imagenet_sources: none", "imagenet_model": "",
                "seconds": 0.0}
    reasons = {}
    for images in ("imagenet_val", "imagenet_sample"):
        reasons[images] = sample_skipped(images, p.processed_dir)
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
    data = load_processed(images, p.processed_dir)
    models, lines = {}, []
    for source in sources:
        folder = Path(p.work_dir) / "imagenet" / imagenet.folder_name(source) / "hf"
        modes_out, line = imagenet.table3(
            data, source, folder, modes, p.norm, p.radius_quantile, cfg.dr, cfg.budgets,
            p.imagenet_calibration, p.cert_eps, p.attack_steps, p.attack_restarts,
            p.eval_batch_size, base.seed, device, p.n_attack, p.attack_batch_size)
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
    per_mode = {m: stage_metrics(r.logs[m], r.bounds[m], r.reports[m], seconds[m])
                for m in r.modes}
    out = {"source": p.source, "dataset": p.dataset, "scale": base.scale,
           "headline_mode": r.headline, **per_mode[r.headline], "modes": per_mode,
           "linear_baseline": baseline_metrics(r.baseline, linear_seconds)}
    # the pre-training is shared by the modes: counted once
    out["total_seconds"] = sum(v["total_seconds"] for v in per_mode.values()) - (
        (len(r.modes) - 1) * pre_seconds) + linear_seconds
    return out


# ------------------------------------------------------------------ units and the gather
MAIN, IMAGENET, TABLE1 = "main", "imagenet", "table1-"


def units(p: Params) -> list[str]:
    """The stage's independent units, one DVC stage each: ``main`` (``certvit_main``), one per
    Table 1 dataset (``table1-<dataset>``: ``certvit_table1@<dataset>``) and ``imagenet``
    (``certvit_imagenet``). :func:`run` gathers them."""
    return [MAIN, *(TABLE1 + d for d in p.table1_datasets), IMAGENET]


def unit_file(p: Params, unit: str) -> Path:
    """Where :func:`run_unit` writes the unit's record (JSON)."""
    return Path(p.work_dir) / "units" / f"{unit}.json"


def dvc_stage(unit: str) -> str:
    """The DVC stage that runs ``unit`` (dvc.yaml)."""
    if unit.startswith(TABLE1):
        return f"certvit_table1@{unit.removeprefix(TABLE1)}"
    return f"certvit_{unit}"


def table1_params(p: Params, dataset: str) -> Params:
    """The section of the Table 1 run on ``dataset`` (its images' size from the data)."""
    size = int(load_processed(dataset, p.processed_dir)["train"]["x"].shape[-1])
    return p.table1(dataset, size)


def unit_params(p: Params, unit: str) -> Params:
    """The params a unit's run uses: the section (``main``, ``imagenet``) or its Table 1
    run's (:meth:`Params.table1`)."""
    if unit.startswith(TABLE1):
        return table1_params(p, unit.removeprefix(TABLE1))
    return p


def run_unit(p: Params, base: BaseParams, device: torch.device, unit: str
             ) -> tuple[dict[str, Any], Result | None]:
    """Run one unit of :func:`units`; write its record to :func:`unit_file` and return it
    with the run's :class:`Result` (``None`` for ``imagenet``). A broken certificate raises
    before the record is written."""
    if unit not in units(p):
        raise ValueError(f"certvit unit {unit!r}: not one of {units(p)}")
    r = None
    if unit == IMAGENET:
        body = imagenet_route(p, base, device)
    elif unit == MAIN:
        r = run_main(p, base, device)
        body = r.metrics
    else:
        r = run_main(unit_params(p, unit), base, device)
        body = table1_entry(r.metrics)
    record = {"unit": unit, "key": unit_key("certvit", p, base), "device": str(device), **body}
    write_json(unit_file(p, unit), record)
    return record, r


def read_unit(p: Params, base: BaseParams, unit: str) -> dict[str, Any]:
    """The record :func:`run_unit` wrote for ``unit``; ValueError when it is missing or was
    computed from other params (run the unit's DVC stage first)."""
    return read_record(unit_file(p, unit), unit_key("certvit", p, base),
                       f"the certvit unit {unit!r}", dvc_stage(unit))


def _broken(entry: Mapping[str, Any]) -> int:
    """Broken certificates in a run's record: every mode's and the linear baseline's."""
    return sum(int(mm.get("broken", 0)) for mm in entry["modes"].values()) + int(
        entry["linear_baseline"].get("broken", 0))


def run(p: Params, base: BaseParams) -> dict[str, Any]:
    """Gather every unit's record into the stage's metrics file: the ``main`` run's numbers
    at the top level, ``imagenet`` (CertViT Table 3's route) and ``table1`` (per dataset).
    Reads records only (no device); a broken certificate in any record fails the stage."""
    t0 = time.perf_counter()
    main = read_unit(p, base, MAIN)
    table1 = {d: read_unit(p, base, TABLE1 + d) for d in p.table1_datasets}
    net = read_unit(p, base, IMAGENET)
    broken = {u: _broken(e) for u, e in [(MAIN, main), *((TABLE1 + d, e)
                                                          for d, e in table1.items())]}
    if isinstance(net["imagenet"], dict):  # Table 3's route: every model's modes
        broken[IMAGENET] = sum(int(mm.get("broken", 0)) for e in net["imagenet"]["models"]
                               .values() for mm in e["modes"].values())
    if any(broken.values()):
        raise soundness.UnsoundCertificateError(
            f"broken certificates in the certvit units {broken} (see {unit_file(p, MAIN).parent})")
    drop = ("unit", "key", "device")
    out = {k: v for k, v in main.items() if k not in drop}
    out["imagenet"] = net["imagenet"]  # the models' lines: the unit's record and report
    out["table1"] = {d: {k: v for k, v in e.items() if k not in drop}
                     for d, e in table1.items()}
    out["total_seconds"] = (main["total_seconds"] + net["seconds"]
                            + sum(e["total_seconds"] for e in table1.values())
                            + time.perf_counter() - t0)
    write_json(p.metrics, out)
    return out


def table1_entry(m: Mapping[str, Any]) -> dict[str, Any]:
    """A Table 1 run's part of the stage's metrics: its setting, and per mode (and the linear
    baseline) clean, certified and PGD accuracy by eps and the certificate's constant."""
    keep = ("test_clean_acc", "certified_acc", "pgd_acc", "attacked_certified_acc",
            "n_attacked", "broken", "total_seconds")
    return {"source": m["source"], "dataset": m["dataset"], "n_test": m["n_test"],
            "modes": {mode: {k: mm[k] for k in keep if k in mm}
                      | {"lipschitz_pairwise": mm["lipschitz_pairwise"]["final"]}
                      for mode, mm in m["modes"].items()},
            "linear_baseline": m["linear_baseline"], "total_seconds": m["total_seconds"]}


def table1_frame(table1: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """One row per Table 1 dataset and mode (and the linear baseline) of ``table1``
    ({dataset: :func:`table1_entry`}): clean, PGD and certified accuracy (%) at the dataset's
    CertViT eps (:func:`table1_eps`), the certificate's constant, and CertViT's Table 1
    numbers beside where it reports the dataset."""
    rows = []
    for d, entry in table1.items():
        ref, name = certvit_table1(d) or ({}, None)
        e = str(table1_eps(d))
        every = {**entry["modes"], BASELINE: entry["linear_baseline"]}
        for label, rep in every.items():
            rows.append({"dataset": d, "model": label, "eps": float(e),
                         "clean (%)": 100 * rep.get("test_clean_acc", rep.get("clean_acc")),
                         "PGD (%)": 100 * rep["pgd_acc"][e],
                         "certified (%)": 100 * rep["certified_acc"][e],
                         "constant": rep.get("lipschitz_pairwise", 1.0), "paper": name,
                         "paper clean (%)": ref.get("clean"), "paper PGD (%)": ref.get("pgd"),
                         "paper certified (%)": ref.get("certified"),
                         "paper constant": ref.get("lipschitz")})
    return pd.DataFrame(rows)


def _at_paper_eps(dataset: str | None, eps: str) -> bool:
    """Whether ``eps`` (pixel space) is the radius CertViT's Table 1 claim covers on
    ``dataset`` (its normalised eps converted: :func:`table1_eps`)."""
    pixel = certvit_pixel_eps(dataset or "")
    return pixel is not None and eps_match(eps, [pixel]) is not None


def imagenet_frame(net: Mapping) -> pd.DataFrame:
    """CertViT Table 3's route as a table: one row per model and mode (accuracies, bound,
    certified accuracy per eps, images and classes), CertViT's row beside in the paper mode."""
    rows = []
    for source, entry in net["models"].items():
        ref = CERTVIT_TABLE3.get(entry.get("paper_model") or "", {})
        for mode, mm in entry["modes"].items():
            rows.append({"model": source, "mode": mode,
                         **{k: v for k, v in mm.items() if not isinstance(v, dict)},
                         **{f"certified {e}": a for e, a in mm["certified_acc"].items()},
                         "paper clean (%)": ref.get("clean") if mode == "paper" else None,
                         "paper bound": ref.get("lipschitz") if mode == "paper" else None})
    return pd.DataFrame(rows)


def _imagenet_rows(net: Mapping) -> list[dict]:
    """CertViT Table 3's route, per model and mode: the loaded, adapted and constrained clean
    accuracy and the certified accuracy per eps; CertViT's clean accuracy and bound beside the
    constrained model of the paper's own checkpoint (its ImageNet eps was lost in the text's
    extraction, so no certified or PGD number is compared). The tiny random ViT checks the
    route: kept out of the brief summary."""
    rows = []
    for source, entry in net["models"].items():
        ref = CERTVIT_TABLE3.get(entry.get("paper_model") or "", {})
        src = f"CertViT Table 3 ({entry['paper_model']})" if ref else None
        for mode, mm in entry["modes"].items():
            ref = ref if mode == "paper" else {}  # CertViT's own constraining only
            src = src if ref else None
            where = f"Table 3 ImageNet ({net['images']}, {source}), {mode} mode"
            base = f"imagenet/{source}/modes/{mode}"
            for key, label in (("pretrained_clean_acc", "loaded model's clean accuracy"),
                               ("adapted_clean_acc", "adapted, clean accuracy"),
                               ("clean_acc", "constrained, clean accuracy")):
                paper = ref["clean"] / 100 if ref and key == "clean_acc" else None
                rows.append(row(f"{base}/{key}", f"{where}: {label}", mm[key], "fraction",
                                paper, src if paper is not None else None,
                                brief=source != imagenet.TINY))
            rows.append(row(f"{base}/lipschitz_constrained", f"{where}: Lipschitz bound",
                            mm["lipschitz_constrained"], "value",
                            ref.get("lipschitz") if ref else None, src))
            for eps, acc in mm["certified_acc"].items():
                rows.append(row(f"{base}/certified_acc/{eps}",
                                f"{where}: certified accuracy at eps {eps}", acc, "fraction"))
    return rows


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """The headline mode's accuracies and bound, the other modes' and the linear baseline's,
    then the Table 1 runs beside CertViT's Table 1 (at the pixel radius its eps covers). The
    section's own run (a pre-trained ViT-B/16, or the cpu scale's 1-layer ViT) is not Table
    1's setting: no paper number stands beside it."""
    dataset = m.get("dataset")
    ref, src = {}, None

    def paper_value(key: str, scale: float = 1.0) -> float | None:
        return ref[key] / scale if key in ref else None

    rows = [row("test_clean_acc", "clean accuracy (certified model)", m.get("test_clean_acc"),
                "fraction", paper_value("clean", 100), src, brief=True)]
    attacked = (f" (first {m['n_attacked']} test images)"
                if m.get("n_attacked", m.get("n_test")) != m.get("n_test") else "")
    for what, label, key in (("pgd_acc", f"L2 PGD accuracy{attacked}", "pgd"),
                             ("certified_acc", "certified accuracy", "certified")):
        for eps, acc in m.get(what, {}).items():
            at_paper_eps = _at_paper_eps(dataset, eps)
            rows.append(row(f"{what}/{eps}", f"{label} at eps {eps}", acc, "fraction",
                            paper_value(key, 100) if at_paper_eps else None, src,
                            brief=at_paper_eps))
    # the certificate's constant (features x pairwise head rows) when recorded, else pixels ->
    # logits (metrics written before the pairwise constant existed)
    key = "lipschitz_pairwise" if "lipschitz_pairwise" in m else "lipschitz"
    final = m.get(key, {}).get("final")
    if final is not None:
        rows.append(row(f"{key}/final", "Lipschitz bound of the final model", final, "value",
                        paper_value("lipschitz"), src, brief=True))
    for mode, mm in m.get("modes", {}).items():
        if mode == m.get("headline_mode"):
            continue
        rows.append(row(f"modes/{mode}/test_clean_acc", f"{mode} mode: clean accuracy",
                        mm.get("test_clean_acc"), "fraction", brief=True))
        for eps, acc in mm.get("certified_acc", {}).items():
            rows.append(row(f"modes/{mode}/certified_acc/{eps}",
                            f"{mode} mode: certified accuracy at eps {eps}", acc, "fraction",
                            brief=_at_paper_eps(dataset, eps)))
        bound = mm.get("lipschitz_pairwise", {}).get("final")
        if bound is not None:
            rows.append(row(f"modes/{mode}/lipschitz_pairwise/final",
                            f"{mode} mode: Lipschitz bound of the final model", bound, "value",
                            brief=True))
    base = m.get("linear_baseline")
    if base:  # the trivial baseline beside the ViTs: a linear classifier on pixels
        rows.append(row("linear_baseline/clean_acc", "linear baseline (pixels): clean accuracy",
                        base.get("clean_acc"), "fraction", brief=True))
        for eps, acc in base.get("certified_acc", {}).items():
            rows.append(row(f"linear_baseline/certified_acc/{eps}",
                            f"linear baseline (pixels): certified accuracy at eps {eps}", acc,
                            "fraction", brief=_at_paper_eps(dataset, eps)))
        rows.append(row("linear_baseline/broken", "linear baseline (pixels): broken "
                        "certificates", base.get("broken"), "count"))
    for d, t in m.get("table1", {}).items():  # CertViT Table 1: a small ViT trained here
        ref, name = certvit_table1(d) or ({}, None)
        e = str(table1_eps(d))
        for mode, mm in t["modes"].items():
            where = f"Table 1 {d}, {mode} mode"
            rows.append(row(f"table1/{d}/modes/{mode}/test_clean_acc", f"{where}: clean accuracy",
                            mm.get("test_clean_acc"), "fraction",
                            ref["clean"] / 100 if ref else None, name, brief=True))
            for what, label, key in (("certified_acc", "certified accuracy", "certified"),
                                     ("pgd_acc", "L2 PGD accuracy", "pgd")):
                if e in mm.get(what, {}):
                    rows.append(row(f"table1/{d}/modes/{mode}/{what}/{e}",
                                    f"{where}: {label} at eps {e}", mm[what][e], "fraction",
                                    ref[key] / 100 if ref else None, name, brief=True))
            rows.append(row(f"table1/{d}/modes/{mode}/lipschitz_pairwise",
                            f"{where}: Lipschitz bound of the final model",
                            mm["lipschitz_pairwise"], "value",
                            ref.get("lipschitz") if ref else None, name, brief=True))
    net = m.get("imagenet")
    if isinstance(net, dict):
        rows += _imagenet_rows(net)
    units = {"broken": "count", "n_test": "count", "n_attacked": "count",
             "median_radius": "value",
             "total_seconds": "seconds"}
    for key, unit in units.items():
        if isinstance(m.get(key), int | float):
            rows.append(row(key, key.replace("_", " "), m[key], unit))
    return rows


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: the headline mode's final clean accuracy, its certified and PGD
    accuracy at the middle eps, broken certificates."""
    pgd = m.get("pgd_acc", {})
    eps = middle_eps(pgd)
    clean = m.get("test_clean_acc")
    return numbers(clean=clean if isinstance(clean, int | float) else None,
                   cert=m.get("certified_acc", {}).get(eps), pgd=pgd.get(eps),
                   eps=None if eps is None else float(eps), broken=m.get("broken"))
