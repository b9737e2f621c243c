"""The specformer stage's study (:mod:`attncert.stages.specformer`): the training recipes, one
unit's runs (trained, attacked, timed), SpecFormer's Table 5 lambda ablation and the certified
pair, on the methods of :mod:`attncert.specformer.methods`.

Functions that need the stage's params take its ``Params`` as an argument.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd
import torch

from attncert import certify, diagnostics, soundness
from attncert.data import as_float
from attncert.models import ViTConfig
from attncert.specformer import methods as sf
from attncert.specformer.params import CERT_VARIANTS, Params
from attncert.training.train import TrainConfig

if TYPE_CHECKING:
    from attncert.pipeline.params import BaseParams


def recipe(p: Params, seed: int, source: str) -> tuple[TrainConfig, TrainConfig]:
    """(standard, adversarial) training configs of ``source``'s runs, before
    :func:`attncert.specformer.methods.method_train_config`: the ``train`` recipe for
    :data:`attncert.specformer.methods.SCRATCH`, the ``finetune`` recipe for a pre-trained
    source."""
    return (p.train if source == sf.SCRATCH else p.finetune).configs(seed)


def certified_configs(p: Params, data: Mapping[str, Any], seed: int
                      ) -> tuple[ViTConfig, TrainConfig]:
    """(Lipschitz ViT config, its training config before MSVP) of the certified pair
    (:class:`CertifiedParams`): its whole recipe ``certified.train``."""
    c = p.certified
    model_cfg = sf.data_config(data, normalize="mean", **c.vit.arch(), kind="lipschitz",
                               block="stream", pool="mean", radius_attn=c.radius_attn,
                               gamma_qk=c.gamma_qk, gamma_vo=c.gamma_vo)
    return model_cfg, c.train.config(seed)


def _train(p: Params, src: str, method: str, train_cfg: TrainConfig, data: Mapping[str, Any],
           dataset: str, ckpt: Path, device: torch.device, precision: str):
    """One run: the from-scratch ViT of ``p`` or the fine-tuned pre-trained ``src``."""
    if src == sf.SCRATCH:
        vit = sf.base_model_config(data, **p.vit.arch(), block=p.block)
        return sf.train_run(sf.method_model_config(method, vit, p.lipsformer_alpha), train_cfg,
                            data, dataset, ckpt, device, precision)
    return sf.finetune_run(src, train_cfg, data, dataset, p.image_size, ckpt, device,
                           precision)


#: what a main run's attention record keeps of :func:`attncert.diagnostics.attention_diagnostics`
ATTENTION_KEYS = ("acc", "acc_uniform", "acc_identity", "uniform_gap", "identity_gap",
                  "entropy_mean", "n")


def main_runs(p: Params, data: Mapping[str, Any], dataset: str, specs: Sequence,
              ckpt: Path, device: torch.device, precision: str, seed: int,
              record: dict[str, Any]) -> None:
    """Every (source, training, method) on ``dataset``: trained, attacked (SpecFormer Tables
    1-2), its attention diagnosed on the attacked images (:data:`ATTENTION_KEYS`), the
    singular values of the standard-trained models (Figure 2a); on the first dataset also the
    step times (Table 3) and the certifier's answer for a LayerNorm model."""
    # every pre-trained source is loaded and fitted once before any training (a clear error first)
    for src in p.sources:
        if src != sf.SCRATCH:
            notes = sf.pretrained_model(src, data, p.image_size, seed)[1]
            record["notes"][sf.run_label(dataset, src)] = "; ".join(notes)
    models = {}
    for src in p.sources:
        label = sf.run_label(dataset, src)
        for training, method, cfg in sf.run_plan(p.methods, p.adv_methods,
                                                 *recipe(p, seed, src)):
            t0 = time.perf_counter()
            model, curves, status = _train(p, src, method,
                                           sf.method_train_config(method, cfg, p.msvp_lambda),
                                           data, dataset, ckpt / f"{label}-{training}-{method}",
                                           device, precision)
            models[label, training, method] = model
            record["trained"].append({
                "dataset": label, "source": src, "training": training, "method": method,
                "checkpoint": status, "epochs": len(curves),
                "train_seconds": sum(r["seconds"] for r in curves),
                "wall_seconds": time.perf_counter() - t0, "test_acc": curves[-1]["test_acc"]})
    x, y = sf.eval_split(data, p.n_test)
    for (label, training, method), model in models.items():
        record["robustness"] += [
            {"dataset": label, "training": training, "method": method, **r}
            for r in sf.robust_accuracy(model, x.to(device), y.to(device), specs,
                                        p.attack_batch_size, seed)]
    for (label, training, method), model in models.items():  # does its attention do anything
        a = diagnostics.attention_diagnostics(model, x.to(device), y.to(device),
                                              p.attack_batch_size)
        record["attention"].append({"dataset": label, "training": training, "method": method,
                                    **{k: a[k] for k in ATTENTION_KEYS}})
    for src in p.sources:
        label = sf.run_label(dataset, src)
        record["sigma"] += sf.max_sigma_frame(
            {m: models[label, "standard", m] for m in p.methods}
        ).assign(dataset=label).to_dict("records")
    if dataset != p.datasets[0]:
        return
    # the cost of a training step (Table 3): first source, side by side, in standard and in
    # adversarial training (each relative to vanilla in the same training)
    label = sf.run_label(dataset, p.sources[0])
    configs = recipe(p, seed, p.sources[0])
    xb = as_float(data["train"]["x"][:configs[0].batch_size]).to(device)
    yb = data["train"]["y"][:len(xb)].to(device)
    for training, cfg in zip(("standard", "adversarial"), configs, strict=True):
        methods = [m for m in (p.methods if training == "standard" else p.adv_methods)
                   if (label, training, m) in models]
        if "vanilla" not in methods:
            continue
        timed = {m: (models[label, training, m], sf.method_train_config(m, cfg, p.msvp_lambda))
                 for m in methods}
        times = sf.step_times(timed, xb, yb, p.timing_steps, p.timing_rounds, p.timing_warmup)
        record["times"] += times.assign(training=training).to_dict("records")
    # certified terms: a LayerNorm model is refused
    try:
        certify.precompute(models[label, "standard", "vanilla"], xb[:2])
        record["refusal"] = "(certified: unexpected for a LayerNorm model)"
    except ValueError as exc:
        record["refusal"] = str(exc)


def _lambda_name(lam: Sequence[float]) -> str:
    return ",".join(f"{v:g}" for v in lam)


def lambda_ablation(p: Params, data: Mapping[str, Any], dataset: str, index: int,
                    specs: Sequence, ckpt: Path, device: torch.device, precision: str,
                    seed: int) -> list[dict[str, Any]] | None:
    """SpecFormer Table 5: the specformer method trained (standard and adversarial, as the
    first source's plan lists it) at the ``index``-th ``msvp_lambda_ablation`` triple on
    ``dataset`` from the first source, each attacked like the main runs: rows (lambda,
    training, attack, accuracy). None for the main runs' own ``msvp_lambda`` (their models
    answer it: :func:`table5_rows`)."""
    lam = p.msvp_lambda_ablation[index]
    if [float(v) for v in lam] == [float(v) for v in p.msvp_lambda]:
        return None
    src, name = p.sources[0], _lambda_name(lam)
    label = sf.run_label(dataset, src)
    x, y = sf.eval_split(data, p.n_test)
    rows = []
    for training, method, cfg in sf.run_plan(p.methods, p.adv_methods, *recipe(p, seed, src)):
        if method != "specformer":
            continue
        model = _train(p, src, method, sf.method_train_config(method, cfg, lam), data, dataset,
                       ckpt / f"{label}-{training}-specformer-lambda{name}", device,
                       precision)[0]
        rows += [{"lambda": name, "training": training, **r}
                 for r in sf.robust_accuracy(model, x.to(device), y.to(device), specs,
                                             p.attack_batch_size, seed)]
    return rows


def certified_pair(p: Params, data: Mapping[str, Any], dataset: str, seed: int, ckpt: Path,
                   device: torch.device, precision: str) -> dict[str, Any]:
    """The Lipschitz ViT trained without and with MSVP (``certified.msvp_lambda``), certified
    in float64 with :data:`CERT_VARIANTS` (pairwise test) on the first ``certified.n_test``
    test images and every one of them attacked with L2 PGD at each ``certified.cert_eps``
    (:func:`attncert.certify.audit`): {"certified": one row per model and variant (clean,
    certified and PGD accuracy per eps, broken certificates, and the model's attention
    diagnostics on the same images: points lost with uniform and identity attention, entropy /
    log n), "sigma": singular values per model, "audit": {model: audit rows}}
    (:func:`check_certified` checks it)."""
    c = p.certified
    model_cfg, train_cfg = certified_configs(p, data, seed)
    n_cert = min(c.n_test, len(data["test"]["y"]))
    xc = as_float(data["test"]["x"][:n_cert]).double().to(device)
    yc = data["test"]["y"][:n_cert].to(device)
    rows, sigmas, audits = [], [], {}
    for label, lam in (("lipschitz", [0.0, 0.0, 0.0]), ("lipschitz + MSVP", c.msvp_lambda)):
        cfg = dataclasses.replace(train_cfg, msvp_lambda=tuple(lam))
        model, _, _ = sf.train_run(model_cfg, cfg, data, dataset,
                                   ckpt / f"{dataset}-msvp{cfg.msvp_enabled:d}",
                                   device, precision)
        sigmas += sf.max_sigma_frame({label: model}).to_dict("records")
        model = model.double()
        attention = diagnostics.attention_diagnostics(model, xc, yc, p.attack_batch_size)
        table = certify.certify_table(model, xc, yc, CERT_VARIANTS, ["pairwise"])
        correct = torch.tensor(table["correct"].to_numpy())
        radii = {v: torch.tensor(table[f"radius_{v}_pairwise"].to_numpy())
                 for v in CERT_VARIANTS}
        torch.manual_seed(seed)
        m = c.audit.count(len(yc))
        audits[label] = certify.audit(model, xc[:m], yc[:m], {v: r[:m] for v, r in radii.items()},
                                      c.cert_eps, c.audit.steps, c.audit.restarts, seed,
                                      c.audit.batch(p.attack_batch_size), progress=True)[0]
        for variant, radius in radii.items():
            acc = certify.certified_accuracy(correct, radius, c.cert_eps)
            rows.append({"model": label, "variant": variant,
                         "clean_acc": float(correct.double().mean()),
                         "median_radius": float(radius[correct].median()) if correct.any()
                         else 0.0, **{f"certified@{e}": a for e, a in acc.items()},
                         **{f"pgd@{r['eps']}": r["robust_acc"] for r in audits[label]},
                         "broken": sum(r[f"broken_{variant}"] for r in audits[label]),
                         "uniform_gap": attention["uniform_gap"],
                         "identity_gap": attention["identity_gap"],
                         "attn_entropy": attention["entropy_mean"]})
    return {"certified": rows, "sigma": sigmas, "audit": audits}


def check_certified(audits: Mapping[str, Sequence[Mapping[str, Any]]], where: str) -> None:
    """The certified pair's soundness (:func:`attncert.soundness.require_sound`): no
    certificate broken by the audit's PGD, no certified accuracy above the PGD accuracy on the
    same points, for every model and variant."""
    soundness.require_sound(audits, {
        f"{model} / {v}": ({r["eps"]: r[f"certified_{v}"] for r in rows},
                           {r["eps"]: r["robust_acc"] for r in rows})
        for model, rows in audits.items() for v in CERT_VARIANTS}, see=where)


def overview(p: Params, base: BaseParams, records: Mapping[str, Mapping[str, Any]]) -> str:
    """The stage's overview (markdown) from its units' records: scale, each unit's device, the
    data, the sources (with the pre-trained ones' notes), the runs of a dataset and source and
    the attacks."""
    main = [records[d] for d in p.datasets]
    specs = sf.attack_specs(p.std_eps_255, p.adv_eval_eps_255, p.attack_steps, p.attack_eps)
    plan = sf.run_plan(p.methods, p.adv_methods, *recipe(p, base.seed, p.sources[0]))
    devices = ", ".join(f"{u} on {rec['device']}" for u, rec in records.items())
    return (
        f"**Scale** {base.scale}; units {devices}.  \n**Data** "
        + "; ".join(rec["data"] for rec in main) + f"  \n**Sources** {p.sources}"
        + "".join(f"  \n{label}: {note}" for rec in main for label, note in rec["notes"].items())
        + f"  \n**Runs** per dataset and source: {[f'{t}/{m}' for t, m, _ in plan]}"
        f"  \n**Attacks** on the first {p.n_test} test images: {[s.label for s in specs]}")


def table5_rows(p: Params, records: Mapping[str, Mapping[str, Any]],
                rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """SpecFormer Table 5 (lambda, training, attack, accuracy...) from the ``lambda<i>`` units'
    records (:func:`lambda_ablation`); the triple equal to ``msvp_lambda`` is the main runs'
    specformer models of the first dataset and source (``rows``: the main runs' robustness
    rows)."""
    first_run = sf.run_label(p.datasets[0], p.sources[0])
    ablation = []
    for i, lam in enumerate(p.msvp_lambda_ablation):
        got = records[f"lambda{i}"]["ablation"]
        if got is None:
            name = _lambda_name(lam)
            got = [{"lambda": name, "training": r["training"],
                    **{k: v for k, v in r.items() if k not in ("dataset", "training", "method")}}
                   for r in rows if r["dataset"] == first_run and r["method"] == "specformer"]
        ablation += got
    return ablation


def attack_table(rows: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """A unit's accuracy-under-attack rows: run (dataset, lambda, training, method) x attack."""
    frame = pd.DataFrame(rows)
    keys = [k for k in ("dataset", "lambda", "training", "method") if k in frame]
    return frame.pivot_table(index=keys, columns="attack", values="accuracy",
                             sort=False).round(4)


def step_times(times: Sequence[Mapping[str, Any]]) -> pd.DataFrame:
    """A unit's timed training steps: the median seconds per step per training and method."""
    return pd.DataFrame(times).groupby(["training", "method"], sort=False)[
        "seconds_per_step"].median().to_frame()
