"""The specformer stage: SpecFormer (MSVP) and the Lipschitz-attention baselines, trained,
attacked, timed and compared (MATH.md sections 1, 3, 7, 8).

The plan: every method of :mod:`attncert.specformer` on every dataset and source, standard and
(for ``adv_methods``) PGD adversarial training, each model attacked with the same attacks on
the first ``n_eval`` test images; the largest singular value per layer of the standard-trained
models (SpecFormer Figure 2a); the cost of a training step relative to vanilla (its Table 3);
and what the penalty buys in certified terms: LayerNorm models are refused by the certifier,
so a Lipschitz ViT trained without and with MSVP is certified with LoFAST(M) and SpecFormer's
bound. Reusable methods (configs, attacks, timing) live in :mod:`attncert.specformer`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from attncert import certify, paper
from attncert import specformer as sf
from attncert.data import as_float, load_processed
from attncert.headline import row
from attncert.io import atomic_path, write_json
from attncert.loop import OPTIMIZERS
from attncert.models import ViTConfig
from attncert.params import (
    AUGMENTS,
    IMAGE_DATASETS,
    VIT_BLOCKS,
    BaseParams,
    fail,
    nonempty,
    nonneg,
    one_of,
    param,
    positive,
    probability,
    unique,
    unit_interval,
)
from attncert.train import TrainConfig


@dataclass(frozen=True)
class Params:
    """params.yaml ``specformer``: SpecFormer and the Lipschitz-attention baselines, attacked
    and compared. l_inf radii are in units of 1/255 (pixel space), l2 radii in pixels."""

    datasets: list[str] = param(one_of(*IMAGE_DATASETS), unique)
    sources: list[str] = param(nonempty, unique,
                               doc="'scratch' (a ViT of patch/dim/depth/heads trained here) or "
                                   "a pre-trained ViTForImageClassification: HF hub id or "
                                   "save_pretrained folder, fine-tuned with the finetune_* recipe")
    image_size: int = param(positive, doc="input size of the pre-trained sources; images are "
                                          "upsampled to it inside the model (integer factor)")
    methods: list[str] = param(one_of(*sf.METHODS), unique, doc="standard training")
    adv_methods: list[str] = param(one_of(*sf.METHODS), unique,
                                   doc="PGD adversarial training ([] = none)")
    patch: int = param(positive)
    dim: int = param(positive)
    depth: int = param(positive)
    heads: int = param(positive)
    mlp_hidden: int = param(positive)
    block: str = param(one_of(*VIT_BLOCKS))
    max_train: int = param(nonneg, doc="seeded subset of every training split (0 = all)")
    lipsformer_alpha: float = param(positive, doc="LipsFormer's residual scale x + alpha f(x)")
    msvp_lambda: list[float] = param(nonneg, doc="(lam_q, lam_k, lam_v) of the specformer method")
    msvp_lambda_ablation: list[list[float]] = param(doc="SpecFormer Table 5: more (lam_q, "
                                                    "lam_k, lam_v) of the specformer method, "
                                                    "first dataset and source, both trainings")
    epochs: int = param(positive)
    adv_epochs: int = param(positive)
    batch_size: int = param(positive)
    lr: float = param(positive)
    weight_decay: float = param(nonneg)
    warmup_steps: int = param(nonneg)
    augment: str = param(one_of(*AUGMENTS))
    adv_eps_255: float = param(positive, doc="adversarial training radius (l_inf, x 1/255)")
    adv_steps: int = param(positive)
    finetune_epochs: int = param(positive, doc="pre-trained sources: standard fine-tune")
    finetune_adv_epochs: int = param(positive, doc="pre-trained sources: PGD fine-tune")
    finetune_batch_size: int = param(positive)
    finetune_lr: float = param(positive)
    finetune_weight_decay: float = param(nonneg)
    finetune_warmup_steps: int = param(nonneg)
    finetune_grad_clip: float = param(nonneg, doc="max global gradient norm (0 = off)")
    finetune_optimizer: str = param(one_of(*OPTIMIZERS), doc="adamw | sgd (heavy-ball)")
    finetune_momentum: float = param(unit_interval, doc="sgd's momentum")
    finetune_mixup_alpha: float = param(nonneg, doc="Mixup's Beta(alpha, alpha) (0 = none)")
    finetune_cutmix_alpha: float = param(nonneg, doc="CutMix's Beta(alpha, alpha) (0 = none)")
    finetune_mix_prob: float = param(probability, doc="share of standard fine-tune batches "
                                                        "mixed (0 = off; attncert.mix)")
    finetune_mix_switch_prob: float = param(probability, doc="CutMix's share of the mixed "
                                                               "batches when both alphas > 0")
    n_eval: int = param(positive, doc="first n test images attacked")
    eval_batch_size: int = param(positive)
    std_eps_255: float = param(positive, doc="FGSM and PGD-2 radius (l_inf, x 1/255)")
    adv_eval_eps_255: float = param(positive, doc="CW and PGD radius (l_inf, x 1/255)")
    attack_steps: int = param(positive, doc="CW-n, PGD-n and L2 PGD steps")
    attack_eps: list[float] = param(positive, unique, doc="L2 PGD radii (pixels; attacked, "
                                                           "not certified)")
    timing_steps: int = param(positive)
    timing_rounds: int = param(positive)
    timing_warmup: int = param(nonneg)
    cert_patch: int = param(positive)
    cert_dim: int = param(positive)
    cert_depth: int = param(positive)
    cert_heads: int = param(positive)
    cert_gamma_qk: float = param(positive)
    cert_gamma_vo: float = param(positive)
    cert_radius_attn: float = param(positive)
    cert_epochs: int = param(positive)
    cert_lr: float = param(positive)
    cert_lmt_offset: float = param(nonneg)
    cert_logit_scale: float = param(positive)
    cert_msvp_lambda: list[float] = param(nonneg)
    cert_n_test: int = param(positive)
    cert_eps: list[float] = param(positive, unique)
    results_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        for key in ("msvp_lambda", "cert_msvp_lambda"):
            if len(getattr(self, key)) != 3:
                fail(f"specformer.{key}", f"needs 3 values, got {getattr(self, key)!r}")
        for lam in self.msvp_lambda_ablation:
            if len(lam) != 3 or any(v < 0 for v in lam):
                fail("specformer.msvp_lambda_ablation", f"each entry needs 3 values >= 0, got "
                                                        f"{lam!r}")
        for key, dim, heads in (("heads", self.dim, self.heads),
                                ("cert_heads", self.cert_dim, self.cert_heads)):
            if dim % heads:
                fail(f"specformer.{key}", f"{dim} is not divisible by {heads} heads")
        if "vanilla" not in self.methods:
            fail("specformer.methods", "needs vanilla (the reference of the step-time ratios)")
        pretrained = [s for s in self.sources if s != sf.SCRATCH]
        for key in ("methods", "adv_methods"):
            bad = [m for m in getattr(self, key) if m not in sf.PRETRAINED_METHODS]
            if pretrained and bad:
                fail(f"specformer.{key}", f"the pre-trained weights of {pretrained[0]!r} do not "
                      f"fit {', '.join(bad)} (the baselines change the ViT's attention or "
                      f"norms); with a pre-trained source use "
                      f"{', '.join(sf.PRETRAINED_METHODS)}, the baselines with "
                      f"sources: [{sf.SCRATCH}]")


@dataclass
class Result:
    """What the stage's notebook shows (every table is also in a file or the metrics)."""

    overview: str            # markdown: scale, device, data, sources, runs, attacks
    trained: pd.DataFrame    # one row per run: checkpoint status, epochs, seconds, test acc
    robustness: pd.DataFrame  # robust_accuracy rows with dataset, training, method
    comparison: pd.DataFrame  # SpecFormer's Table 1/2 layout, its numbers beside ours
    runs: list[str]          # run labels (dataset or dataset@model)
    sigma: pd.DataFrame      # largest singular value per layer, map, method and run
    ratios: pd.DataFrame     # step time per method and its ratio to vanilla
    msvp_ratio: float | None
    refusal: str             # the certifier's message for a LayerNorm model
    cert_sigma: pd.DataFrame  # the certified pair's singular values
    certified: pd.DataFrame  # the certified pair: certified accuracy per variant and eps
    metrics: dict[str, Any]


def recipe(p: Params, seed: int, source: str) -> tuple[TrainConfig, TrainConfig]:
    """(standard, adversarial) training configs of ``source``'s runs, before
    :func:`attncert.specformer.method_train_config`: the from-scratch recipe for
    :data:`attncert.specformer.SCRATCH`, the ``finetune_*`` recipe for a pre-trained source."""
    common = {"augment": p.augment, "eval_batch_size": p.eval_batch_size,
              "adv_eps_255": p.adv_eps_255, "adv_steps": p.adv_steps, "seed": seed}
    if source == sf.SCRATCH:
        return sf.train_configs(epochs=p.epochs, adv_epochs=p.adv_epochs,
                                batch_size=p.batch_size, lr=p.lr, weight_decay=p.weight_decay,
                                warmup_steps=p.warmup_steps, **common)
    mix = {"mixup_alpha": p.finetune_mixup_alpha, "cutmix_alpha": p.finetune_cutmix_alpha,
           "mix_prob": p.finetune_mix_prob, "mix_switch_prob": p.finetune_mix_switch_prob}
    return sf.train_configs(epochs=p.finetune_epochs, adv_epochs=p.finetune_adv_epochs,
                            batch_size=p.finetune_batch_size, lr=p.finetune_lr,
                            weight_decay=p.finetune_weight_decay,
                            warmup_steps=p.finetune_warmup_steps,
                            grad_clip=p.finetune_grad_clip, optimizer=p.finetune_optimizer,
                            momentum=p.finetune_momentum, mix=mix, **common)


def certified_configs(p: Params, data: Mapping[str, Any], seed: int
                      ) -> tuple[ViTConfig, TrainConfig]:
    """(Lipschitz ViT config, its training config before MSVP) of the certified pair: LoFAST
    section 5.2's ViT (LayerProject, constrained attention, SLL MLPs, x - mean inside),
    trained with the LMT margin on the from-scratch recipe."""
    model_cfg = sf.data_config(data, normalize="mean", patch=p.cert_patch, dim=p.cert_dim,
                               depth=p.cert_depth, heads=p.cert_heads,
                               mlp_hidden=2 * p.cert_dim, kind="lipschitz", block="stream",
                               pool="mean", radius_attn=p.cert_radius_attn,
                               gamma_qk=p.cert_gamma_qk, gamma_vo=p.cert_gamma_vo)
    train_cfg = dataclasses.replace(recipe(p, seed, sf.SCRATCH)[0], epochs=p.cert_epochs,
                                    lr=p.cert_lr, weight_decay=0.0, margin="lmt",
                                    lmt_offset=p.cert_lmt_offset, logit_scale=p.cert_logit_scale)
    return model_cfg, train_cfg


def _write_csv(frame: pd.DataFrame, path: Path) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)


def run(p: Params, base: BaseParams, processed_dir: str, device: torch.device) -> Result:
    """Train, attack, time and certify as the module says; write the CSVs under
    ``results_dir``, checkpoints under ``results_dir/ckpt`` (an interrupted stage resumes) and
    the metrics file; return what the notebook shows."""
    out, seed, precision = Path(p.results_dir), base.seed, base.precision
    data = {name: sf.subset_train(load_processed(name, processed_dir), p.max_train, seed)
            for name in p.datasets}
    specs = sf.attack_specs(p.std_eps_255, p.adv_eval_eps_255, p.attack_steps, p.attack_eps)
    plans = {src: sf.run_plan(p.methods, p.adv_methods, *recipe(p, seed, src))
             for src in p.sources}
    # every pre-trained source is loaded and fitted once before any training (a clear error first)
    fitted = {(name, src): "; ".join(sf.pretrained_model(src, d, p.image_size, seed)[1])
              for name, d in data.items() for src in p.sources if src != sf.SCRATCH}
    overview = (
        f"**Scale** {base.scale}, device {device}.  \n**Data** " + "; ".join(
            f"{k}: {len(d['train']['y'])} training / {len(d['test']['y'])} test images "
            f"({d['source']})" for k, d in data.items())
        + f"  \n**Sources** {p.sources}" + "".join(
            f"  \n{sf.run_label(k, src)}: {note}" for (k, src), note in fitted.items())
        + f"  \n**Runs** per dataset and source: "
        f"{[f'{t}/{m}' for t, m, _ in plans[p.sources[0]]]}"
        f"  \n**Attacks** on the first {p.n_eval} test images: {[s.label for s in specs]}")

    # training: every (dataset, source, training, method)
    models, train_rows, labels = {}, [], {}
    for name, d in data.items():
        vit = sf.base_model_config(d, p.patch, p.dim, p.depth, p.heads, p.mlp_hidden, p.block)
        for src in p.sources:
            label = sf.run_label(name, src)
            labels[label] = name
            for training, method, cfg in plans[src]:
                train_cfg = sf.method_train_config(method, cfg, p.msvp_lambda)
                ckpt = out / "ckpt" / f"{label}-{training}-{method}"
                t0 = time.perf_counter()
                if src == sf.SCRATCH:
                    model, curves, status = sf.train_run(
                        sf.method_model_config(method, vit, p.lipsformer_alpha), train_cfg, d,
                        name, ckpt, device, precision)
                else:
                    model, curves, status = sf.finetune_run(src, train_cfg, d, name,
                                                            p.image_size, ckpt, device,
                                                            precision)
                models[label, training, method] = model
                train_rows.append({"dataset": label, "source": src, "training": training,
                                   "method": method, "checkpoint": status,
                                   "epochs": len(curves),
                                   "train_seconds": sum(r["seconds"] for r in curves),
                                   "wall_seconds": time.perf_counter() - t0,
                                   "test_acc": curves[-1]["test_acc"]})

    # robustness (SpecFormer Tables 1 and 2): every model, every attack
    rows = []
    for (label, training, method), model in models.items():
        x, y = sf.eval_split(data[labels[label]], p.n_eval)
        for r in sf.robust_accuracy(model, x.to(device), y.to(device), specs,
                                    p.eval_batch_size, seed):
            rows.append({"dataset": label, "training": training, "method": method, **r})
    robustness = pd.DataFrame(rows)
    _write_csv(robustness, out / "robustness.csv")

    # the largest singular value per layer (Figure 2a) of every standard-trained method
    sigma = pd.concat([sf.max_sigma_frame({m: models[name, "standard", m] for m in p.methods}
                                           ).assign(dataset=name) for name in labels],
                      ignore_index=True)
    _write_csv(sigma, out / "sigma.csv")

    # SpecFormer Table 5: the specformer method at more lambdas (first dataset and source)
    first, first_run = p.datasets[0], sf.run_label(p.datasets[0], p.sources[0])
    ablation = _lambda_ablation(p, data[first], first, first_run, plans[p.sources[0]], specs,
                                models, out, device, precision, seed)
    _write_csv(pd.DataFrame(ablation), out / "msvp_ablation.csv")

    # the cost of a training step (Table 3): first dataset, first source, side by side, in
    # standard and in adversarial training (each relative to vanilla in the same training)
    xb = as_float(data[first]["train"]["x"][:recipe(p, seed, p.sources[0])[0].batch_size]
                  ).to(device)
    yb = data[first]["train"]["y"][:len(xb)].to(device)
    all_times, all_ratios = [], {}
    for training, cfg in zip(("standard", "adversarial"), recipe(p, seed, p.sources[0]),
                             strict=True):
        methods = [m for m in (p.methods if training == "standard" else p.adv_methods)
                   if (first_run, training, m) in models]
        if "vanilla" not in methods:
            continue
        timed = {m: (models[first_run, training, m],
                     sf.method_train_config(m, cfg, p.msvp_lambda)) for m in methods}
        times = sf.step_times(timed, xb, yb, p.timing_steps, p.timing_rounds, p.timing_warmup)
        all_times.append(times.assign(training=training))
        all_ratios[training] = sf.step_time_ratios(times)
    _write_csv(pd.concat(all_times, ignore_index=True), out / "step_time.csv")
    ratios = all_ratios["standard"]
    msvp_ratio = float(ratios.loc["specformer", "ratio"]) if "specformer" in p.methods else None

    # certified terms: a LayerNorm model is refused; the Lipschitz pair without / with MSVP
    try:
        certify.precompute(models[first_run, "standard", "vanilla"], xb[:2])
        refusal = "(certified: unexpected for a LayerNorm model)"
    except ValueError as exc:
        refusal = str(exc)
    cert_rows, cert_sigma = _certified_pair(p, data[first], first, seed, out, device, precision)
    certified = pd.DataFrame(cert_rows)
    _write_csv(certified, out / "certified.csv")

    metrics = {
        "scale": base.scale,
        "training": train_rows,
        "robustness": {f"{r['dataset']}/{r['training']}/{r['method']}/{r['attack']}":
                       r["accuracy"] for r in rows},
        "step_time_ratio": ratios["ratio"].to_dict(),
        "step_time_ratio_adversarial": (all_ratios["adversarial"]["ratio"].to_dict()
                                        if "adversarial" in all_ratios else {}),
        "msvp_ablation": {f"{r['lambda']}/{r['training']}/{r['attack']}": r["accuracy"]
                          for r in ablation},
        "table5_run": first_run,
        "msvp_step_ratio": msvp_ratio,
        "msvp_step_ratio_within_paper": None if msvp_ratio is None
        else msvp_ratio <= paper.SPECFORMER_STEP_RATIO,
        "max_sigma": {f"{r['dataset']}/{r['method']}/L{r['depth']}/{r['map']}": r["sigma"]
                      for r in sigma.to_dict("records")},
        "layernorm_certificate": refusal,
        "certified": cert_rows,
    }
    write_json(p.metrics, metrics)
    return Result(overview=overview, trained=pd.DataFrame(train_rows), robustness=robustness,
                  comparison=sf.comparison_table(rows, paper.SPECFORMER_TABLE1,
                                                 sf.run_label("cifar10", p.sources[0])),
                  runs=list(labels), sigma=sigma, ratios=ratios, msvp_ratio=msvp_ratio,
                  refusal=refusal, cert_sigma=pd.concat(cert_sigma), certified=certified,
                  metrics=metrics)


def _lambda_ablation(p: Params, data: Mapping[str, Any], dataset: str, label: str,
                     plan: Sequence, specs: Sequence, models: Mapping, out: Path,
                     device: torch.device, precision: str, seed: int) -> list[dict[str, Any]]:
    """SpecFormer Table 5: the specformer method trained (standard and adversarial, as the
    plan lists it) at every ``msvp_lambda_ablation`` triple on ``dataset`` from the first
    source, each attacked like the main runs (the main runs' own ``msvp_lambda`` reuses their
    models); rows (lambda, training, attack, accuracy)."""
    src = p.sources[0]
    vit = sf.base_model_config(data, p.patch, p.dim, p.depth, p.heads, p.mlp_hidden, p.block)
    rows = []
    for lam in p.msvp_lambda_ablation:
        name = ",".join(f"{v:g}" for v in lam)
        for training, method, cfg in plan:
            if method != "specformer":
                continue
            train_cfg = sf.method_train_config(method, cfg, lam)
            ckpt = out / "ckpt" / f"{label}-{training}-specformer-lambda{name}"
            if [float(v) for v in lam] == [float(v) for v in p.msvp_lambda]:
                model = models[label, training, method]
            elif src == sf.SCRATCH:
                model = sf.train_run(sf.method_model_config(method, vit, p.lipsformer_alpha),
                                     train_cfg, data, dataset, ckpt, device, precision)[0]
            else:
                model = sf.finetune_run(src, train_cfg, data, dataset, p.image_size, ckpt,
                                        device, precision)[0]
            x, y = sf.eval_split(data, p.n_eval)
            rows += [{"lambda": name, "training": training, **r}
                     for r in sf.robust_accuracy(model, x.to(device), y.to(device), specs,
                                                 p.eval_batch_size, seed)]
    return rows


def _certified_pair(p: Params, data: Mapping[str, Any], dataset: str, seed: int, out: Path,
                    device: torch.device, precision: str
                    ) -> tuple[list[dict[str, Any]], list[pd.DataFrame]]:
    """The Lipschitz ViT trained without and with MSVP (``cert_msvp_lambda``), certified in
    float64 with LoFAST(M) and SpecFormer's bound (pairwise test) on the first
    ``cert_n_test`` test images: (one row per model and variant, singular values per model)."""
    model_cfg, train_cfg = certified_configs(p, data, seed)
    n_cert = min(p.cert_n_test, len(data["test"]["y"]))
    xc = as_float(data["test"]["x"][:n_cert]).double().to(device)
    yc = data["test"]["y"][:n_cert].to(device)
    rows, sigmas = [], []
    for label, lam in (("lipschitz", [0.0, 0.0, 0.0]), ("lipschitz + MSVP", p.cert_msvp_lambda)):
        cfg = dataclasses.replace(train_cfg, msvp_lambda=tuple(lam))
        model, _, _ = sf.train_run(model_cfg, cfg, data, dataset,
                                   out / "ckpt" / f"{dataset}-certified-msvp{cfg.msvp_enabled:d}",
                                   device, precision)
        sigmas.append(sf.max_sigma_frame({label: model}))
        model = model.double()
        table = certify.certify_table(model, xc, yc, ["lofast_M", "specformer"], ["pairwise"],
                                      progress=False)
        correct = torch.tensor(table["correct"].to_numpy())
        for variant in ("lofast_M", "specformer"):
            radius = torch.tensor(table[f"radius_{variant}_pairwise"].to_numpy())
            acc = certify.certified_accuracy(correct, radius, p.cert_eps)
            rows.append({"model": label, "variant": variant,
                         "clean_acc": float(correct.double().mean()),
                         "median_radius": float(radius[correct].median()) if correct.any()
                         else 0.0, **{f"certified@{e}": a for e, a in acc.items()}})
    return rows, sigmas


#: the run SpecFormer's Table 1 / Table 5 CIFAR-10 numbers are of: its ViT-S fine-tuned on
#: CIFAR-10 (ours: the hub's ViT-S/16, 12 x 384 where its is 8 x 768: fidelity.yaml)
TABLE1_RUN = sf.run_label("cifar10", "WinKawaks/vit-small-patch16-224")
TABLE1_SOURCE = "SpecFormer Table 1 (ViT-S, CIFAR-10; its ViT-S is 8 blocks x 768)"
#: Table 5's column names as our attack labels (standard: 2/255; adversarial: 8/255)
TABLE5_ATTACKS = {"standard": {"clean": "clean", "FGSM 2/255": "fgsm", "PGD-2 2/255": "pgd2"},
                  "adversarial": {"clean": "at_clean", "CW-20 8/255": "cw20",
                                  "PGD-20 8/255": "pgd20"}}


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Robust accuracy per run and attack (SpecFormer Table 1 beside the ViT-S CIFAR-10
    standard runs), the lambda ablation (Table 5 beside where its triple and run match), the
    step-time ratios of both trainings (Table 3) and the certified pair's certified
    accuracy."""
    rows = []
    for key, acc in m.get("robustness", {}).items():
        dataset, training, method, attack = key.split("/", 3)
        ref = None
        if dataset == TABLE1_RUN and training == "standard":
            ref = paper.SPECFORMER_TABLE1.get(method, {}).get(attack)
        rows.append(row(f"robustness/{key}", f"{dataset} {training} {method}: {attack}", acc,
                        "fraction", None if ref is None else ref / 100, TABLE1_SOURCE,
                        brief=training == "standard" and method in ("vanilla", "specformer")))
    table5 = m.get("table5_run") == TABLE1_RUN
    for key, acc in m.get("msvp_ablation", {}).items():
        lam, training, attack = key.split("/", 2)
        column = TABLE5_ATTACKS.get(training, {}).get(attack)
        ref = (paper.SPECFORMER_TABLE5.get(lam, {}).get(column) if table5 and column
               else None)
        rows.append(row(f"msvp_ablation/{key}", f"MSVP lambda ({lam}), {training}: {attack}",
                        acc, "fraction", None if ref is None else ref / 100,
                        "SpecFormer Table 5 (CIFAR-10)"))
    for training, key, ref in (("standard", "step_time_ratio", paper.SPECFORMER_TABLE3),
                               ("adversarial", "step_time_ratio_adversarial",
                                paper.SPECFORMER_TABLE3)):
        for method, ratio in (m.get(key) or {}).items():
            if method == "vanilla":
                continue
            rows.append(row(f"{key}/{method}", f"{method} step time / vanilla ({training})",
                            ratio, "ratio", ref[training].get(method),
                            f"SpecFormer Table 3 ({training} training)",
                            brief=method == "specformer"))
    for r in m.get("certified", []):
        for k, v in r.items():
            if k.startswith("certified@"):
                rows.append(row(f"certified/{r['model']}/{r['variant']}/{k[10:]}",
                                f"{r['model']} certified {r['variant']} at eps {k[10:]}", v,
                                "fraction"))
    return rows
