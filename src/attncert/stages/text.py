"""The text stage: sentiment transformers on SST-2, every one certified in the same space of
word embeddings of norm 2 (the frozen-encoder head in its encoder's output space).

One job per model: OLSA at depth 0 (no attention) and at every depth (``olsa_depths``, OLSA
Table 1; ``olsa_deep_depths`` on SST-2 only, its Table 9), the gamma ablation of the shallowest
OLSA (its Table 2), the attention sweep of the deepest (and OLSA's averaged residual when the
main runs use the gated one), Kim et al.'s L2 attention, a standard transformer of the same
size, LoFAST's small-BERT grid and an OLSA head over a frozen encoder. The jobs run in
independent units (:data:`UNITS`, each one DVC stage: several GPUs share the stage), each job
resumably in ``results_dir/ckpt/<unit>/<name>``; :func:`run` runs one or gathers them. Every job gets the
same read-out
(:func:`attncert.text.evaluate.evaluate_model`); the PGD audit's rows are checked by
:func:`attncert.soundness.require_sound` in each unit and again when they are gathered.
"""

from __future__ import annotations

import re
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import pandas as pd
import torch

from attncert import soundness
from attncert.data import dataset_skipped, load_processed
from attncert.pipeline.context import Context
from attncert.pipeline.io import atomic_path, write_json
from attncert.pipeline.params import (
    BaseParams,
    ParamsError,
    nonneg,
    one_of,
    param,
    positive,
    unique,
)
from attncert.pipeline.records import read_record, unit_key
from attncert.report import paper
from attncert.report.headline import numbers, row, scale_caveat
from attncert.text.evaluate import attention_table, evaluate_model, frozen_states
from attncert.text.models import (
    FrozenEncoderOLSA,
    LipschitzTextTransformer,
    OLSAClassifier,
    TextTransformerConfig,
)
from attncert.text.olsa import RESIDUALS as OLSA_RESIDUALS
from attncert.text.standard import StandardTextTransformer
from attncert.text.tokenize import load_tokenizer
from attncert.text.train_text import TextTrainConfig, encode_split, select_splits, train_model

#: Bound variants of attncert.certify usable on LoFAST's text transformer (pairwise test).
LOFAST_VARIANTS = ("lofast_M", "lofast_xi", "naive", "global")
#: The stage's datasets: SST-2 carries the whole study; on the others OLSA trains from scratch
#: at every ``olsa_depths`` where listed in ``datasets`` (OLSA section 5.1: Yelp), and the
#: frozen-encoder head where listed in ``frozen_datasets`` (QQP as sentence pairs).
TEXT_DATASETS = ("sst2", "yelp_polarity", "qqp")
STUDY = "sst2"


#: this module's params.yaml section
SECTION = "text"


@dataclass(frozen=True)
class Params:
    """params.yaml ``text``: OLSA by depth and gamma, Kim et al.'s L2 attention, a standard
    transformer of the same size, LoFAST's small-BERT grid and OLSA over a frozen pre-trained
    encoder; eps is l2 in each model's embedding space."""

    datasets: list[str] = param(one_of(*TEXT_DATASETS), unique,
                                doc="sst2 (the whole study; required), then every dataset "
                                    "OLSA also trains on from scratch at each olsa_depths "
                                    "(one the data stage skipped is reported unavailable)")
    frozen_datasets: list[str] = param(one_of(*TEXT_DATASETS), unique,
                                       doc="the datasets of the OLSA head over the frozen "
                                           "encoder (need not be trained from scratch)")
    tokenizer: str = param(doc="'minilm-package' (offline), a hub id or a save_pretrained folder")
    max_len: int = param(positive)
    max_train: int = param(nonneg, doc="seeded subset of the training split (0 = all)")
    max_eval: int = param(nonneg, doc="seeded subset of the dev and test splits (0 = all)")
    olsa_depths: list[int] = param(positive, unique,
                                   doc="OLSA from scratch on every dataset (OLSA Table 1)")
    olsa_deep_depths: list[int] = param(positive, unique,
                                        doc="deeper OLSA on SST-2 only (OLSA Table 9)")
    heads: int = param(positive, doc="OLSA, Kim-L2, the standard transformer, the frozen head")
    hidden: int = param(positive)
    gamma: float = param(nonneg, doc="certificate regulariser after its ramp (OLSA: 2.0)")
    gamma_ramp: float = param(nonneg, doc="fraction of all steps gamma grows over (<= 1)")
    gamma_ablation: list[float] = param(nonneg, unique,
                                        doc="gammas of the shallowest OLSA (OLSA Table 2)")
    epochs: dict[str, int] = param(doc="training epochs per dataset of datasets (Kim-L2 and "
                                       "the standard transformer: SST-2's)")
    batch_size: int = param(positive)
    lr: float = param(positive, doc="OLSA-family models (OLSA, Kim-L2, the frozen head)")
    vanilla_lr: float = param(positive, doc="the standard transformer")
    warmup_steps: int = param(nonneg)
    logit_scale: float = param(positive, doc="CE temperature (loss only; never the certificate)")
    olsa_alpha1: float = param(positive, doc="initial alpha1 of every OLSA attention (OLSA: 4)")
    olsa_residual: str = param(one_of(*OLSA_RESIDUALS),
                               doc="averaged: OLSA's 0.5 x + 0.5 f(x); gated: trainable "
                                   "(1 - b) x + b f(x), one b = sigmoid(theta) per sublayer")
    olsa_residual_init: float = param(doc="initial b of the gated residual, in (0, 1)")
    lofast_layers: list[int] = param(positive, unique)
    lofast_heads: list[int] = param(positive, unique)
    lofast_gamma_vo: list[float] = param(positive, unique)
    lofast_dim: int = param(positive)
    lofast_mlp_hidden: int = param(positive)
    lofast_gamma_qk: float = param(positive)
    lofast_radius_attn: float = param(positive)
    lofast_variants: list[str] = param(one_of(*LOFAST_VARIANTS), unique)
    lofast_epochs: int = param(positive)
    lofast_lr: float = param(positive)
    lofast_logit_scale: float = param(positive, doc="CE temperature of the LoFAST grid (its "
                                                    "head is free, unlike OLSA's)")
    frozen_source: str = param(doc="the frozen encoder: 'minilm-package', a hub id or a folder")
    frozen_hidden: int = param(nonneg, doc="the frozen head's width, reached by a 1-Lipschitz "
                                           "map from the encoder's (0 = the encoder's width)")
    frozen_epochs: dict[str, int] = param(doc="the frozen head's epochs per frozen dataset")
    frozen_lr: dict[str, float] = param(doc="the frozen head's learning rate per frozen dataset")
    frozen_lr_decay_epochs: dict[str, list[int]] = param(
        doc="per frozen dataset: the LR x 0.1 after each of these epochs (a step schedule); "
            "[] = the cosine schedule")
    frozen_max_train: int = param(nonneg, doc="seeded subset of the whole training split "
                                              "for the frozen-encoder head, independent of "
                                              "max_train (0 = all of it)")
    attention_alpha1: list[float] = param(positive, unique, doc="the attention sweep: the "
                                          "deepest OLSA, averaged residual, alpha1 fixed at "
                                          "each value (empty: no sweep)")
    n_test: int = param(nonneg, doc="first n test sentences certified (0 = the whole split)")
    n_attack: int = param(positive, doc="first n certified sentences attacked (PGD audit)")
    cert_batch_size: int = param(positive)
    cert_eps: list[float] = param(positive, unique)
    attack_steps: int = param(positive)
    attack_restarts: int = param(positive)
    results_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        def fail(key: str, msg: str):
            raise ParamsError(f"text.{key}: {msg}")

        if STUDY not in self.datasets:
            fail("datasets", f"must include {STUDY!r} (the study every other part of the stage "
                             f"reports), got {self.datasets}")
        lacking = [d for d in self.datasets if d not in self.epochs]
        if lacking:
            fail("epochs", f"needs an entry for {lacking} (one per dataset of text.datasets "
                           f"{self.datasets}), got {sorted(self.epochs)}")
        if any(e <= 0 for e in self.epochs.values()):
            fail("epochs", f"must be > 0, got {self.epochs}")
        for key in ("frozen_epochs", "frozen_lr", "frozen_lr_decay_epochs"):
            table = getattr(self, key)
            lacking = [d for d in self.frozen_datasets if d not in table]
            if lacking:
                fail(key, f"needs an entry for {lacking} (one per dataset of "
                          f"text.frozen_datasets {self.frozen_datasets}), got {sorted(table)}")
        for d, e in self.frozen_epochs.items():
            if isinstance(e, bool) or not isinstance(e, int) or e <= 0:
                fail(f"frozen_epochs.{d}", f"must be an int > 0, got {e!r}")
        for d, lr in self.frozen_lr.items():
            if isinstance(lr, bool) or not isinstance(lr, int | float) or not lr > 0:
                fail(f"frozen_lr.{d}", f"must be a number > 0, got {lr!r}")
        for d, decays in self.frozen_lr_decay_epochs.items():
            last = self.frozen_epochs.get(d, 0)
            if not isinstance(decays, list) or any(
                    isinstance(e, bool) or not isinstance(e, int) or not 0 < e < last
                    for e in decays):
                fail(f"frozen_lr_decay_epochs.{d}", f"must list epochs in [1, {last - 1}] "
                                                    f"(text.frozen_epochs.{d} = {last}), got "
                                                    f"{decays!r}")
        if self.frozen_hidden % self.heads:
            fail("frozen_hidden", f"{self.frozen_hidden} is not divisible by text.heads = "
                                  f"{self.heads}")
        both = sorted(set(self.olsa_depths) & set(self.olsa_deep_depths))
        if both:
            fail("olsa_deep_depths", f"{both} already in text.olsa_depths")
        if self.hidden % self.heads:
            fail("heads", f"hidden = {self.hidden} is not divisible by {self.heads}")
        for h in self.lofast_heads:
            if self.lofast_dim % h:
                fail("lofast_heads", f"lofast_dim = {self.lofast_dim} is not divisible by {h}")
        if not self.lofast_variants:
            fail("lofast_variants", "needs at least one variant")
        if self.gamma_ramp > 1:
            fail("gamma_ramp", f"must be in [0, 1], got {self.gamma_ramp!r}")
        if not 0 < self.olsa_residual_init < 1:
            fail("olsa_residual_init", f"must be in (0, 1) (b = sigmoid(theta)), got "
                                       f"{self.olsa_residual_init!r}")


# -- the plan --------------------------------------------------------------------------------


class Job(NamedTuple):
    """One model of the stage: its certificate family, class, constructor arguments and
    training settings (those of :class:`TextTrainConfig` beyond the stage's common ones)."""

    family: str
    cls: type
    kwargs: dict[str, Any]
    train: dict[str, Any]


def text_datasets(p: Params) -> list[str]:
    """Every dataset the stage reads, SST-2 first: the from-scratch ones, then frozen-only."""
    return [*p.datasets, *(d for d in p.frozen_datasets if d not in p.datasets)]


def jobs(p: Params, vocab: int, dataset: str = STUDY, sep_token_id: int | None = None
         ) -> dict[str, Job]:
    """Every model of the stage on ``dataset`` by name (the names the report reads:
    "olsa-L<depth>-g<gamma>" and so on): on SST-2 the whole study, on the other datasets of
    ``datasets`` OLSA at every ``olsa_depths``; "frozen-olsa" on the frozen datasets
    (``sep_token_id``: the frozen encoder's [SEP], for the segment ids of sentence pairs).
    The controls (Kim-L2, the standard transformer, the averaged residual and the alpha1
    sweep) are at the deepest of ``olsa_depths``, the gamma ablation at the shallowest (OLSA
    Table 2: one layer)."""
    deep, shallow = max(p.olsa_depths), min(p.olsa_depths)
    g = p.gamma
    olsa_layer = dict(alpha1=p.olsa_alpha1, residual=p.olsa_residual,
                      residual_init=p.olsa_residual_init)
    olsa = dict(vocab_size=vocab, max_len=p.max_len, dim=p.hidden, heads=p.heads, **olsa_layer)
    olsa_train = dict(epochs=p.epochs.get(dataset, 0), lr=p.lr, gamma=g)
    frozen = {}
    if dataset in p.frozen_datasets:
        pair = {} if sep_token_id is None else {"sep_token_id": sep_token_id}
        width = {} if p.frozen_hidden == 0 else {"hidden": p.frozen_hidden}
        decays = {"lr_decay_epochs": tuple(p.frozen_lr_decay_epochs[dataset])
                  } if p.frozen_lr_decay_epochs[dataset] else {}
        frozen["frozen-olsa"] = Job("olsa", FrozenEncoderOLSA,
                                    dict(source=p.frozen_source, heads=p.heads, max_len=p.max_len,
                                         **olsa_layer, **pair, **width),
                                    dict(epochs=p.frozen_epochs[dataset],
                                         lr=p.frozen_lr[dataset], gamma=0.0, **decays))
    if dataset != STUDY:
        scratch = p.olsa_depths if dataset in p.datasets else []
        return {f"olsa-L{d}-g{g:g}": Job("olsa", OLSAClassifier, dict(olsa, depth=d), olsa_train)
                for d in scratch} | frozen
    out = {f"olsa-L{d}-g{g:g}": Job("olsa", OLSAClassifier, dict(olsa, depth=d), olsa_train)
           for d in (0, *p.olsa_depths, *p.olsa_deep_depths)}
    out |= {f"olsa-L{shallow}-g{a:g}": Job("olsa", OLSAClassifier, dict(olsa, depth=shallow),
                                           dict(olsa_train, gamma=a))
            for a in p.gamma_ablation}
    if p.olsa_residual != "averaged":
        out[f"olsa-L{deep}-g{g:g}-averaged"] = Job(
            "olsa", OLSAClassifier, dict(olsa, depth=deep, residual="averaged"), olsa_train)
    out |= {f"olsa-L{deep}-g{g:g}-alpha1-{a:g}": Job(
        "olsa", OLSAClassifier, dict(olsa, depth=deep, residual="averaged", alpha1=a,
                                     train_alpha1=False), olsa_train)
        for a in p.attention_alpha1}
    out[f"kim-l2-L{deep}-g{g:g}"] = Job("olsa", OLSAClassifier,
                                        dict(olsa, depth=deep, attention="l2"), olsa_train)
    out[f"vanilla-L{deep}"] = Job("none", StandardTextTransformer,
                                  dict(vocab_size=vocab, max_len=p.max_len, dim=p.hidden,
                                       depth=deep, heads=p.heads, mlp_hidden=2 * p.hidden),
                                  dict(epochs=p.epochs[STUDY], lr=p.vanilla_lr, gamma=0.0))
    out |= {f"lofast-L{L}-H{H}-vo{vo:g}": Job(
        "lofast", LipschitzTextTransformer,
        dict(config=TextTransformerConfig(vocab_size=vocab, max_len=p.max_len, dim=p.lofast_dim,
                                          depth=L, heads=H, mlp_hidden=p.lofast_mlp_hidden,
                                          radius_attn=p.lofast_radius_attn,
                                          gamma_qk=p.lofast_gamma_qk, gamma_vo=vo)),
        dict(epochs=p.lofast_epochs, lr=p.lofast_lr, gamma=0.0,
             logit_scale=p.lofast_logit_scale))
        for L in p.lofast_layers for H in p.lofast_heads for vo in p.lofast_gamma_vo}
    return out | frozen


@dataclass
class Result:
    """What the notebook shows. ``data``: the SST-2 source, split sizes, reported split,
    vocabulary size, certified and attacked counts, device; ``audits``: {model: audit rows}
    for :func:`attncert.soundness.require_sound`; ``figures``: {file name: figure}, saved."""

    data: dict[str, Any]
    jobs: pd.DataFrame
    table: pd.DataFrame
    audit: pd.DataFrame
    audits: dict[str, list[dict[str, Any]]]
    versus: pd.DataFrame
    verdict: str
    paper_vs_ours: pd.DataFrame
    ablation: pd.DataFrame
    figures: dict[str, Any]
    datasets: dict[str, dict[str, Any]]  # Yelp, QQP: their metrics entry or why unavailable
    datasets_table: pd.DataFrame  # :func:`datasets_table`
    seconds: float


class Fitted(NamedTuple):
    """The models of one dataset, trained and evaluated: metrics per model, the curve rows,
    the audit rows per model."""

    results: dict[str, dict[str, Any]]
    curves: list[dict[str, Any]]
    audits: dict[str, list[dict[str, Any]]]


def _fit(todo: Mapping[str, Job], splits: Mapping[str, Mapping], frozen_splits: Mapping | None,
         folder: Path, common: Mapping[str, Any], evaluation: Mapping[str, Any], reported: str,
         base: BaseParams, batch_size: int, label: str = "") -> Fitted:
    """Train (resumably, in ``folder/<name>``) and evaluate every job on one dataset's encoded
    splits; the frozen-encoder head on its own splits' encoder states (memory-mapped in
    ``<results_dir>/scratch/<unit>/``, deleted after the job: not a DVC output)."""
    dev_ = evaluation["device"]
    results, curves, audits = {}, [], {}
    for name, job in todo.items():
        torch.manual_seed(base.seed)
        model = job.cls(**job.kwargs)
        spec = {"class": job.cls.__name__, **{k: str(v) for k, v in job.kwargs.items()}}
        # the hub commit of a frozen encoder (transformers records it; None for a folder):
        # in the report and the resume fingerprint, so a run never resumes on other weights
        revision = getattr(getattr(getattr(model, "encoder", None), "config", None),
                           "_commit_hash", None)
        if revision:
            spec["hub_revision"] = revision
        data, scratch = splits, None
        if job.cls is FrozenEncoderOLSA:  # the encoder runs once per sentence; the head reads
            t0 = time.perf_counter()       # its states
            scratch = folder.parent.parent / "scratch" / folder.name / name
            data = {s: frozen_states(model, frozen_splits[s], dev_, batch_size,
                                     path=scratch / f"{s}.npy")
                    for s in ("train", "dev", "test")}
            print(f"{label}{name}: encoder outputs of {len(data['train']['y'])} training, "
                  f"{len(data['dev']['y'])} dev and {len(data['test']['y'])} {reported} "
                  f"sentences in {time.perf_counter() - t0:.0f} s")
        history = train_model(model, spec, data["train"], data["dev"],
                              TextTrainConfig(**(common | job.train)), folder / name,
                              dev_, base.precision)
        train_seconds = sum(r["seconds"] for r in history)  # every epoch, resumed or not
        metrics, curve, audits[name] = evaluate_model(name, model, job.family, data["dev"],
                                                      data["test"], **evaluation)
        results[name] = metrics | {"train_seconds": train_seconds, "epochs": job.train["epochs"],
                                   "gamma": job.train["gamma"],
                                   **({"hub_revision": revision} if revision else {})}
        if scratch is not None:
            del data
            shutil.rmtree(scratch, ignore_errors=True)
        curves += curve
        best = max(metrics["avg_radius"], key=metrics["avg_radius"].get)
        print(f"{label}{name}: dev {metrics['dev_acc']:.3f} {reported} "
              f"{metrics['test_acc']:.3f} avg radius {metrics['avg_radius'][best]:.3f} "
              f"(correct only {metrics['avg_radius_correct'][best]:.3f}) "
              f"({train_seconds:.0f} s training)")
    return Fitted(results, curves, audits)


def _frozen_tokenizer(p: Params, tok):
    return tok if p.frozen_source == p.tokenizer else load_tokenizer(p.frozen_source)


def _other_dataset(p: Params, base: BaseParams, name: str, processed_dir: str, tok,
                   common: Mapping[str, Any], evaluation: Mapping[str, Any], folder: Path
                   ) -> tuple[dict[str, Any], Fitted | None]:
    """OLSA from scratch at every depth (and the frozen-encoder head where listed) on Yelp
    polarity or QQP: (the dataset's metrics entry, the fitted models). A dataset the data
    stage skipped gives ({"unavailable": why}, None): reported, never fatal."""
    skipped = dataset_skipped(name, processed_dir)
    if skipped is not None:
        print(f"{name}: unavailable ({skipped})")
        return {"unavailable": skipped}, None
    ds = load_processed(name, processed_dir)
    raw, reported = select_splits(ds, p.max_train, p.max_eval, base.seed)
    splits = {s: encode_split(v, tok, p.max_len) for s, v in raw.items()}
    pairs = "text_pair" in raw["train"]
    frozen_splits, frozen_tok = None, None
    if name in p.frozen_datasets:
        frozen_tok = _frozen_tokenizer(p, tok)
        frozen_raw, _ = select_splits(ds, p.frozen_max_train, p.max_eval, base.seed)
        frozen_splits = {s: encode_split(v, frozen_tok, p.max_len) for s, v in frozen_raw.items()}
    todo = jobs(p, tok.vocab_size, name,
                frozen_tok.sep_token_id if pairs and frozen_tok is not None else None)
    fitted = _fit(todo, splits, frozen_splits, folder, common, evaluation, reported, base,
                  p.cert_batch_size, label=f"{name} ")
    n_cert = (len(raw["test"]["y"]) if p.n_test == 0
              else min(p.n_test, len(raw["test"]["y"])))
    entry = {"source": ds["source"], "pairs": pairs, "reported_split": reported,
             "dev_held_out": "dev" not in ds, "train_sentences": len(raw["train"]["y"]),
             "dev_sentences": len(raw["dev"]["y"]),
             "frozen_train_sentences": (len(frozen_splits["train"]["y"])
                                        if frozen_splits else 0),
             "n_reported": len(raw["test"]["y"]), "n_certified": n_cert,
             "n_attacked": min(p.n_attack, n_cert), "models": fitted.results,
             "broken": sum(r["broken"] for r in fitted.results.values())}
    return entry, fitted


def paper_reference(dataset: str, model: str, olsa_depth: int | None) -> tuple[float, str] | None:
    """OLSA's abstract number for a model of the stage on ``dataset`` (average radius, its
    own embedding space), or None: the 3-layer OLSA on Yelp, the OLSA head over frozen BERT-base
    on QQP (SST-2's 3-layer OLSA: :func:`headline_rows`)."""
    if dataset == "yelp_polarity" and olsa_depth == OLSA_PAPER_DEPTH:
        return (paper.OLSA_AVG_RADIUS["yelp"],
                f"OLSA abstract ({OLSA_PAPER_DEPTH}-layer OLSA, Yelp; softmax constant "
                f"{paper.OLSA_SOFTMAX_LIPSCHITZ:g}: unsound, ours 1/2; Shi et al.: "
                f"{paper.OLSA_SHI_AVG_RADIUS['yelp']:g})")
    if dataset == "qqp" and model == "frozen-olsa":
        return (paper.OLSA_FROZEN_BERT_QQP["olsa"],
                "OLSA abstract (OLSA head over frozen BERT-base, QQP, BERT's embedding space; "
                f"Shi et al.: {paper.OLSA_FROZEN_BERT_QQP['shi']:g})")
    return None


def datasets_table(entries: Mapping[str, Mapping[str, Any]]) -> pd.DataFrame:
    """One row per model of every dataset beyond SST-2: accuracy on the reported split, the
    average radius (both rules; best variant), certified accuracy per eps, broken
    certificates, OLSA's number beside where it reports one; one row per unavailable
    dataset saying why."""
    rows = []
    for dataset, e in entries.items():
        if "unavailable" in e:
            rows.append({"dataset": dataset, "model": "-", "status": f"unavailable: "
                                                                      f"{e['unavailable']}"})
            continue
        for name, r in e["models"].items():
            match = _OLSA_NAME.match(name)
            ref = paper_reference(dataset, name, int(match.group(1)) if match else None)
            best = max(r["avg_radius"], key=r["avg_radius"].get)
            rows.append({"dataset": dataset, "model": name, "status": "run",
                         "split": e["reported_split"], "test_acc": r["test_acc"],
                         "avg_radius": r["avg_radius"][best],
                         "avg_radius_correct": r["avg_radius_correct"][best],
                         **{f"cert@{k}": v for k, v in r["certified_acc"].items()},
                         "broken": r["broken"],
                         "paper_avg_radius": ref[0] if ref else None})
    return pd.DataFrame(rows)


#: The stage's independent units, each one DVC stage (dvc.yaml's ``text_unit`` matrix lists
#: them): SST-2's study in four parts (:func:`unit_jobs`), then every other dataset (its OLSA
#: runs and frozen-encoder head; nothing where the scale leaves it out). :func:`run` gathers.
UNITS = ("sst2-olsa", "sst2-controls", "sst2-lofast", "sst2-frozen", "yelp_polarity", "qqp")


def unit_jobs(p: Params, vocab: int, unit: str, sep_token_id: int | None = None
              ) -> dict[str, Job]:
    """The jobs of one unit of :data:`UNITS`: on SST-2, ``sst2-olsa`` (OLSA at depth 0 and
    every depth), ``sst2-lofast`` (LoFAST's grid), ``sst2-frozen`` (the frozen-encoder head)
    and ``sst2-controls`` (the rest: gamma ablation, residual, alpha1 sweep, Kim-L2, the
    standard transformer); another dataset's unit is :func:`jobs` on it ({} when the scale
    leaves it out)."""
    if unit not in UNITS:
        raise ValueError(f"text unit {unit!r}: not one of {UNITS}")
    if not unit.startswith(f"{STUDY}-"):
        return jobs(p, vocab, unit, sep_token_id) if unit in text_datasets(p) else {}
    depths = {f"olsa-L{d}-g{p.gamma:g}" for d in (0, *p.olsa_depths, *p.olsa_deep_depths)}

    def group(name: str, job: Job) -> str:
        if job.cls is FrozenEncoderOLSA:
            return "sst2-frozen"
        if job.family == "lofast":
            return "sst2-lofast"
        return "sst2-olsa" if name in depths else "sst2-controls"
    return {n: j for n, j in jobs(p, vocab).items() if group(n, j) == unit}


def unit_file(p: Params, unit: str) -> Path:
    """Where :func:`run_unit` writes the unit's record (JSON)."""
    return Path(p.results_dir) / "units" / f"{unit}.json"


def _settings(p: Params, base: BaseParams, dev_: torch.device
              ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(training settings every job shares, the evaluation's settings)."""
    common = dict(batch_size=p.batch_size, warmup_steps=p.warmup_steps,
                  logit_scale=p.logit_scale, gamma_ramp=p.gamma_ramp, seed=base.seed)
    evaluation = dict(n_test=p.n_test, n_attack=p.n_attack, cert_eps=p.cert_eps,
                      attack_steps=p.attack_steps, attack_restarts=p.attack_restarts,
                      device=dev_, batch_size=p.cert_batch_size, seed=base.seed,
                      variants=p.lofast_variants)
    return common, evaluation


def run(p: Params, ctx: Context) -> dict[str, Any] | Result:
    """``ctx.item``: one unit of :data:`UNITS` (:func:`_run_unit`: its record); ``None``: the
    gathering stage (:func:`_gather`: what the notebook shows)."""
    return _gather(p, ctx) if ctx.item is None else _run_unit(p, ctx, ctx.item)


def _run_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """Train and evaluate the jobs of one unit of :data:`UNITS` on ``ctx.device``
    (checkpoints in ``results_dir/ckpt/<unit>/<model>``: an interrupted unit resumes); write
    its record to :func:`unit_file` and return it; then its soundness audit (a broken
    certificate raises :class:`attncert.soundness.UnsoundCertificateError`, the record kept
    for inspection)."""
    if unit not in UNITS:
        raise ValueError(f"text unit {unit!r}: not one of {UNITS}")
    base, dev_, processed_dir = ctx.require_base(), ctx.device, ctx.processed_dir
    t0 = time.perf_counter()
    torch.manual_seed(base.seed)
    folder = Path(p.results_dir) / "ckpt" / unit
    folder.mkdir(parents=True, exist_ok=True)  # a DVC output, even for a unit with no job
    common, evaluation = _settings(p, base, dev_)
    tok = load_tokenizer(p.tokenizer)
    record: dict[str, Any] = {"unit": unit, "key": unit_key("text", p, base), "device": str(dev_),
                              "results": {}, "curves": [], "audits": {}, "jobs": [],
                              "data": None, "entry": None}
    if unit.startswith(f"{STUDY}-"):
        sst2 = load_processed(STUDY, processed_dir)
        raw, reported = select_splits(sst2, p.max_train, p.max_eval, base.seed)
        splits = {name: encode_split(s, tok, p.max_len) for name, s in raw.items()}
        todo = unit_jobs(p, tok.vocab_size, unit)
        # the frozen head's own seeded subset of the whole training split (its cost is the
        # encoder's forward pass once per sentence, not training steps); dev and test the same
        frozen_splits = None
        if "frozen-olsa" in todo:
            frozen_raw, _ = select_splits(sst2, p.frozen_max_train, p.max_eval, base.seed)
            frozen_tok = _frozen_tokenizer(p, tok)
            frozen_splits = {name: encode_split(s, frozen_tok, p.max_len)
                             for name, s in frozen_raw.items()}
        fitted = _fit(todo, splits, frozen_splits, folder, common, evaluation, reported, base,
                      p.cert_batch_size)
        n_cert = (len(raw["test"]["y"]) if p.n_test == 0
                  else min(p.n_test, len(raw["test"]["y"])))
        record["data"] = {
            "source": sst2["source"], "train": len(raw["train"]["y"]),
            "dev": len(raw["dev"]["y"]), "reported": reported,
            "n_reported": len(raw["test"]["y"]), "vocab": tok.vocab_size,
            "n_certified": n_cert, "n_attacked": min(p.n_attack, n_cert), "device": str(dev_),
            "frozen_train": len(frozen_splits["train"]["y"]) if frozen_splits else 0}
        record["jobs"] = [{"model": name, "family": j.family, "class": j.cls.__name__,
                           **j.train} for name, j in todo.items()]
        record |= {"results": fitted.results, "curves": fitted.curves,
                   "audits": fitted.audits}
    elif unit in text_datasets(p):
        entry, fitted = _other_dataset(p, base, unit, processed_dir, tok, common, evaluation,
                                       folder)
        record["entry"] = entry
        if fitted is not None:
            record["audits"] = {f"{unit}/{m}": rows for m, rows in fitted.audits.items()}
    record["seconds"] = time.perf_counter() - t0
    write_json(unit_file(p, unit), record)
    soundness.require_sound(record["audits"], see=str(unit_file(p, unit)))
    return record


def read_unit(p: Params, base: BaseParams, unit: str) -> dict[str, Any]:
    """The record :func:`_run_unit` wrote for ``unit``; ValueError when it is missing or was
    computed from other params (run the unit's DVC stage first)."""
    return read_record(unit_file(p, unit), unit_key("text", p, base),
                       f"the text unit {unit!r}", f"text_unit@{unit}")


def _gather(p: Params, ctx: Context) -> Result:
    """Gather every unit's record (:func:`read_unit`): write ``results_dir`` (models.csv,
    curves.csv, datasets.csv, the figures) and the metrics file; return what the notebook
    shows. Reads records only (no device, no data)."""
    base = ctx.require_base()
    import matplotlib.pyplot as plt

    from attncert.figures import text as figs  # seaborn: not on the path of params checks

    t_stage = time.perf_counter()
    out = Path(p.results_dir)
    records = {u: read_unit(p, base, u) for u in UNITS}
    study = [records[u] for u in UNITS if u.startswith(f"{STUDY}-")]
    data = study[0]["data"]
    order = list(jobs(p, data["vocab"]))  # jobs() order, whichever unit ran a job
    results = {n: r for rec in study for n, r in rec["results"].items()}
    results = {n: results[n] for n in order}
    curves = sorted((c for rec in study for c in rec["curves"]),
                    key=lambda c: order.index(c["model"]))
    audits = {n: rows for rec in study for n, rows in rec["audits"].items()}
    audits = {n: audits[n] for n in order}
    others = {}
    for name in text_datasets(p):
        if name != STUDY:
            others[name] = records[name]["entry"]
            audits |= records[name]["audits"]
    reported, n_cert = data["reported"], data["n_certified"]
    frozen_train = max(rec["data"]["frozen_train"] for rec in study)
    todo_rows = sorted((j for rec in study for j in rec["jobs"]),
                       key=lambda j: order.index(j["model"]))
    curves = pd.DataFrame(curves)
    table = attention_table(results)
    deep, shallow = max(p.olsa_depths), min(p.olsa_depths)
    depth0 = f"olsa-L0-g{p.gamma:g}"
    olsa_rows = table[table["family"] == "olsa"].set_index("model")
    versus, attention_models, verdict = _versus_depth0(olsa_rows, depth0, reported)
    paper_vs_ours = pd.DataFrame([
        {"source": "OLSA paper, 3-layer OLSA (softmax constant 1/4: unsound)",
         "avg_radius": paper.OLSA_AVG_RADIUS["sst"]},
        {"source": "OLSA paper, Shi et al.", "avg_radius": paper.OLSA_SHI_AVG_RADIUS["sst"]},
        *[{"source": f"ours, {name} (constant 1/2)",
           "avg_radius": olsa_rows.loc[name, "avg_radius"],
           "avg_radius_correct": olsa_rows.loc[name, "avg_radius_correct"],
           "test_acc": olsa_rows.loc[name, "test_acc"]}
          for name in (f"olsa-L{d}-g{p.gamma:g}"
                       for d in (0, *p.olsa_depths, *p.olsa_deep_depths))]])
    ablation = olsa_rows.loc[[f"olsa-L{shallow}-g{g:g}" for g in sorted({*p.gamma_ablation,
                                                                         p.gamma})],
                             ["dev_acc", "test_acc", "avg_radius", "avg_radius_correct"]]
    sweep = olsa_rows.loc[[depth0, f"olsa-L{deep}-g{p.gamma:g}",
                           *[n for n in olsa_rows.index if "-alpha1-" in n or
                             n.endswith("-averaged")]]].reset_index()
    certified = curves[curves["variant"] != "none"]  # the standard transformer: no certificate
    figures = {
        "lofast_certified.png": figs.plot_certified_vs_eps(
            curves[curves["model"].str.startswith("lofast")], "LoFAST small-BERT grid on SST-2"),
        "olsa_certified.png": figs.plot_certified_vs_eps(
            certified[~certified["model"].str.startswith("lofast")],
            "OLSA, Kim-L2 and frozen-encoder OLSA on SST-2"),
        "accuracy_radius.png": figs.plot_accuracy_vs_radius(table),
        "attention_sweep.png": figs.plot_attention_tradeoff(sweep)}

    out.mkdir(parents=True, exist_ok=True)
    for file, fig in figures.items():
        with atomic_path(out / file) as tmp:
            fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        plt.close(fig)  # saved; the notebook shows it where it belongs, not here
    with atomic_path(out / "models.csv") as tmp:
        table.to_csv(tmp, index=False)
    with atomic_path(out / "curves.csv") as tmp:
        curves.to_csv(tmp, index=False)
    other_table = datasets_table(others)
    with atomic_path(out / "datasets.csv") as tmp:
        other_table.to_csv(tmp, index=False)
    n_attack = data["n_attacked"]
    seconds = sum(r["seconds"] for r in records.values()) + time.perf_counter() - t_stage
    write_json(p.metrics, {
        "scale": base.scale, "train_sentences": data["train"],
        "frozen_train_sentences": frozen_train,
        "reported_split": reported, "units": {u: r["device"] for u, r in records.items()},
        "n_certified": n_cert, "n_attacked": n_attack, "eps": p.cert_eps,
        "depth0": depth0, "models": results,
        "attention_vs_depth0": {
            name: {"d_test_acc": r["d_test_acc"], "d_avg_radius": r["d_avg_radius"],
                   "d_avg_radius_correct": r["d_avg_radius_correct"]}
            for name, r in attention_models.iterrows()},
        "paper": {"olsa_sst_avg_radius": paper.OLSA_AVG_RADIUS["sst"],
                  "olsa_softmax_lipschitz": paper.OLSA_SOFTMAX_LIPSCHITZ,
                  "shi_sst_avg_radius": paper.OLSA_SHI_AVG_RADIUS["sst"]},
        "datasets": others,
        "broken": int(table["broken"].sum()) + sum(e.get("broken", 0) for e in others.values()),
        "seconds": seconds})
    audit = pd.DataFrame([{"model": name, **r} for name, rows in audits.items() for r in rows])
    soundness.require_sound(audits, see=str(p.metrics))  # every unit's audit, once more
    return Result(
        data=data, jobs=pd.DataFrame(todo_rows),
        table=table, audit=audit, audits=audits, versus=versus, verdict=verdict,
        paper_vs_ours=paper_vs_ours, ablation=ablation, figures=figures,
        datasets=others, datasets_table=other_table, seconds=seconds)


def _versus_depth0(olsa_rows: pd.DataFrame, depth0: str, reported: str
                   ) -> tuple[pd.DataFrame, pd.DataFrame, str]:
    """(every OLSA-family model against the depth-0 baseline: differences in test accuracy
    and average radius (both rules); the attention models among them; the verdict line)."""
    versus = olsa_rows.assign(
        d_test_acc=olsa_rows["test_acc"] - olsa_rows.loc[depth0, "test_acc"],
        d_avg_radius=olsa_rows["avg_radius"] - olsa_rows.loc[depth0, "avg_radius"],
        d_avg_radius_correct=(olsa_rows["avg_radius_correct"]
                              - olsa_rows.loc[depth0, "avg_radius_correct"]))[
        ["test_acc", "d_test_acc", "avg_radius", "d_avg_radius", "avg_radius_correct",
         "d_avg_radius_correct", "attn_ratio", "b_att", "alpha1"]]
    attention_models = versus.drop(index=[depth0, "frozen-olsa"], errors="ignore")
    best_acc, best_radius = (attention_models["d_test_acc"].idxmax(),
                             attention_models["d_avg_radius"].idxmax())
    verdict = (
        f"Over the depth-0 baseline ({versus.loc[depth0, 'test_acc']:.3f} {reported} accuracy, "
        f"average radius {versus.loc[depth0, 'avg_radius']:.3f}), the best attention model in "
        f"accuracy is {best_acc} ({attention_models.loc[best_acc, 'd_test_acc']:+.3f}) and in "
        f"average radius {best_radius} "
        f"({attention_models.loc[best_radius, 'd_avg_radius']:+.3f}).")
    return versus, attention_models, verdict


# -- headline rows ---------------------------------------------------------------------------

#: model names as :func:`jobs` builds them: "olsa-L<depth>-g<gamma>" is OLSA (with
#: "-averaged": OLSA's own residual); the attention sweep's "-alpha1-<a>" is not
_OLSA_NAME = re.compile(r"olsa-L(\d+)-g[0-9.]+(-averaged)?$")
#: the depth of OLSA's headline model (OLSA section 5: a 3-layer OLSA on SST and Yelp)
OLSA_PAPER_DEPTH = 3


def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """Per SST-2 model: accuracy on the reported split, average certified radius per bound
    variant with both rules (0 for misclassified sentences, OLSA's; correctly classified
    only), OLSA's SST radius (its unsound softmax constant 1/4) beside every 3-layer OLSA,
    the differences to the depth-0 baseline, the residual gates, alpha1, the attention's max
    probability against 1/n, certified accuracy per eps, certification cost."""
    ref, shi = paper.OLSA_AVG_RADIUS["sst"], paper.OLSA_SHI_AVG_RADIUS["sst"]
    unlike = scale_caveat(m)  # below the paper scale: not like for like
    src = (f"OLSA section 5 ({OLSA_PAPER_DEPTH}-layer OLSA, SST; softmax constant "
           f"{paper.OLSA_SOFTMAX_LIPSCHITZ:g}: unsound, ours 1/2; Shi et al.: {shi:g}){unlike}")
    split = m.get("reported_split", "test")
    rows = []
    versus = m.get("attention_vs_depth0", {})
    for name, r in m.get("models", {}).items():
        base = f"models/{name}"
        rows.append(row(f"{base}/test_acc", f"{name} {split} accuracy", r["test_acc"],
                         "fraction", brief=True))
        if r.get("family") == "none":   # no certificate: radius and certified accuracy are 0
            continue
        match = _OLSA_NAME.match(name) if r["family"] == "olsa" else None
        olsa_ref = ref if match and int(match.group(1)) == OLSA_PAPER_DEPTH else None
        radii, correct = r.get("avg_radius", {}), r.get("avg_radius_correct", {})
        best = max(radii, key=radii.get) if radii else None
        for variant, radius in radii.items():
            rows.append(row(f"{base}/avg_radius/{variant}",
                             f"{name} average certified radius ({variant}; 0 if wrong)",
                             radius, "value", olsa_ref, src, brief=variant == best))
        for variant, radius in correct.items():
            rows.append(row(f"{base}/avg_radius_correct/{variant}",
                             f"{name} average certified radius ({variant}; correct only)",
                             radius, "value", brief=variant == best))
        for key, label in (("d_test_acc", f"{split} accuracy"),
                           ("d_avg_radius", "average radius")):
            if key in versus.get(name, {}):
                rows.append(row(f"attention_vs_depth0/{name}/{key}",
                                 f"{name} minus depth 0: {label}", versus[name][key],
                                 "value", brief=True))
        if r.get("b_att_mean") is not None:
            rows.append(row(f"{base}/b_att_mean", f"{name} attention gate b (mean over layers)",
                             r["b_att_mean"], "value"))
        if r.get("alpha1_mean") is not None:
            rows.append(row(f"{base}/alpha1_mean", f"{name} alpha1 (mean over layers)",
                             r["alpha1_mean"], "value"))
        att = r.get("attention") or {}
        if att.get("ratio") is not None:
            rows.append(row(f"{base}/attention/ratio",
                             f"{name} attention max probability / uniform (1/n)",
                             att["ratio"], "ratio", brief=r["family"] == "olsa"))
        for eps, acc in r.get("certified_acc", {}).items():
            rows.append(row(f"{base}/certified_acc/{eps}", f"{name} certified at eps {eps}",
                             acc, "fraction"))
        if "cert_seconds_per_batch" in r:
            rows.append(row(f"{base}/cert_seconds_per_batch",
                             f"{name} certification seconds per batch of "
                             f"{r.get('cert_batch_size', '?')}", r["cert_seconds_per_batch"],
                             "seconds"))
    for dataset, e in m.get("datasets", {}).items():
        for name, r in e.get("models", {}).items():  # none when the dataset is unavailable
            base = f"datasets/{dataset}/models/{name}"
            where = f"{dataset} {name}"
            rows.append(row(f"{base}/test_acc", f"{where} {e['reported_split']} accuracy",
                             r["test_acc"], "fraction", brief=True))
            match = _OLSA_NAME.match(name)
            ref = paper_reference(dataset, name, int(match.group(1)) if match else None)
            ref = (ref[0], ref[1] + unlike) if ref else None
            radii = r.get("avg_radius", {})
            for variant, radius in radii.items():
                rows.append(row(f"{base}/avg_radius/{variant}",
                                 f"{where} average certified radius ({variant}; 0 if wrong)",
                                 radius, "value", *(ref or (None, None)), brief=True))
    for key, label in (("n_certified", f"certified {split} sentences"),
                       ("n_attacked", "attacked sentences (PGD audit)"),
                       ("broken", "broken certificates")):
        if key in m:
            rows.append(row(key, label, m[key], "count", brief=True))
    return rows


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: SST-2's deepest OLSA (accuracy on the reported split, average
    certified radius of its best variant), broken certificates of every model."""
    olsa = {int(match.group(1)): r for name, r in m.get("models", {}).items()
            if (match := _OLSA_NAME.match(name)) and not match.group(2)}
    deep = olsa[max(olsa)] if olsa else {}
    radii = deep.get("avg_radius") or {}
    return numbers(clean=deep.get("test_acc"), radius=max(radii.values()) if radii else None,
                   broken=m.get("broken"))
