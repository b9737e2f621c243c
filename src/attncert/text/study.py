"""The text stage's jobs trained and evaluated (:func:`fit`), and a dataset besides SST-2
(:func:`other_dataset`): the study code the stage (:mod:`attncert.stages.text`) runs per unit.
``p`` is the section's typed params (:class:`attncert.text.params.Params`)."""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from attncert.data import dataset_skipped, load_processed
from attncert.pipeline.params import (
    BaseParams,
)
from attncert.text.evaluate import evaluate_model, frozen_states
from attncert.text.jobs import STUDY
from attncert.text.models import (
    FrozenEncoderOLSA,
)
from attncert.text.tokenize import load_tokenizer
from attncert.text.train_text import encode_split, select_splits, train_model

if TYPE_CHECKING:  # the stage's section and jobs, for annotations only
    from attncert.pipeline.context import Context
    from attncert.text.jobs import Job
    from attncert.text.params import Params, TextRecipe


class Fitted(NamedTuple):
    """The models of one dataset, trained and evaluated: metrics per model, the curve rows,
    the audit rows per model."""

    results: dict[str, dict[str, Any]]
    curves: list[dict[str, Any]]
    audits: dict[str, list[dict[str, Any]]]



def fit(todo: Mapping[str, Job], splits: Mapping[str, Mapping], frozen_splits: Mapping | None,
         folder: Path, common: TextRecipe, evaluation: Mapping[str, Any], reported: str,
         ctx: Context, batch_size: int, label: str = "") -> Fitted:
    """Train (resumably, in ``folder/<name>``) and evaluate every job on one dataset's encoded
    splits; the frozen-encoder head on its own splits' encoder states (memory-mapped in
    ``<results_dir>/scratch/<unit>/``, deleted after the job: not a DVC output)."""
    dev_ = evaluation["device"]
    results, curves, audits = {}, [], {}
    for name, job in todo.items():
        torch.manual_seed(ctx.seed)
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
                              common.config(ctx.seed, job.train), folder / name,
                              dev_, ctx.precision)
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



def frozen_tokenizer(p: Params, tok):
    return tok if p.frozen.source == p.tokenizer else load_tokenizer(p.frozen.source)



def other_dataset(p: Params, ctx: Context, name: str, processed_dir: str, tok,
                  common: TextRecipe, evaluation: Mapping[str, Any], folder: Path,
                  make_jobs: Callable[[int | None], Mapping[str, Job]]
                  ) -> tuple[dict[str, Any], Fitted | None]:
    """OLSA from scratch at every depth (and the frozen-encoder head where listed) on Yelp
    polarity or QQP: (the dataset's metrics entry, the fitted models). ``make_jobs``: the
    stage's jobs on the dataset, given the frozen encoder's [SEP] id of sentence pairs. A
    dataset the data stage skipped gives ({"unavailable": why}, None): reported, never
    fatal."""
    skipped = dataset_skipped(name, processed_dir)
    if skipped is not None:
        print(f"{name}: unavailable ({skipped})")
        return {"unavailable": skipped}, None
    ds = load_processed(name, processed_dir)
    raw, reported = select_splits(ds, p.max_train, p.max_test, ctx.seed)
    splits = {s: encode_split(v, tok, p.max_len) for s, v in raw.items()}
    pairs = "text_pair" in raw["train"]
    frozen_splits, frozen_tok = None, None
    if name in p.frozen.datasets:
        frozen_tok = frozen_tokenizer(p, tok)
        frozen_raw, _ = select_splits(ds, p.frozen.max_train, p.max_test, ctx.seed)
        frozen_splits = {s: encode_split(v, frozen_tok, p.max_len) for s, v in frozen_raw.items()}
    todo = make_jobs(frozen_tok.sep_token_id if pairs and frozen_tok is not None else None)
    fitted = fit(todo, splits, frozen_splits, folder, common, evaluation, reported, ctx,
                  p.cert_batch_size, label=f"{name} ")
    n_cert = (len(raw["test"]["y"]) if p.n_test == 0
              else min(p.n_test, len(raw["test"]["y"])))
    entry = {"source": ds["source"], "pairs": pairs, "reported_split": reported,
             "dev_held_out": "dev" not in ds, "train_sentences": len(raw["train"]["y"]),
             "dev_sentences": len(raw["dev"]["y"]),
             "frozen_train_sentences": (len(frozen_splits["train"]["y"])
                                        if frozen_splits else 0),
             "n_reported": len(raw["test"]["y"]), "n_certified": n_cert,
             "n_attacked": p.audit.count(n_cert), "models": fitted.results,
             "broken": sum(r["broken"] for r in fitted.results.values())}
    return entry, fitted



def settings(p: Params, base: BaseParams, dev_: torch.device
              ) -> tuple[TextRecipe, dict[str, Any]]:
    """(the recipe every job shares, ``text.train``; the evaluation's settings)."""
    common = p.train
    evaluation = dict(n_test=p.n_test, n_attack=p.audit.n or None, cert_eps=p.cert_eps,
                      attack_steps=p.audit.steps, attack_restarts=p.audit.restarts,
                      device=dev_, batch_size=p.cert_batch_size, seed=base.seed,
                      variants=p.lofast.variants,
                      attack_batch_size=p.audit.batch(p.cert_batch_size))
    return common, evaluation


def sst2_unit(p: Params, ctx: Context, processed_dir: str, tok, common: TextRecipe,
              evaluation: Mapping[str, Any], folder: Path, todo: Mapping[str, Job],
              device: str) -> dict[str, Any]:
    """One SST-2 unit's jobs ``todo`` trained and evaluated: its record's ``data``, ``jobs``,
    ``results``, ``curves`` and ``audits``."""
    sst2 = load_processed(STUDY, processed_dir)
    raw, reported = select_splits(sst2, p.max_train, p.max_test, ctx.seed)
    splits = {name: encode_split(s, tok, p.max_len) for name, s in raw.items()}
    # the frozen head's own seeded subset of the whole training split (its cost is the
    # encoder's forward pass once per sentence, not training steps); dev and test the same
    frozen_splits = None
    if "frozen-olsa" in todo:
        frozen_raw, _ = select_splits(sst2, p.frozen.max_train, p.max_test, ctx.seed)
        frozen_tok = frozen_tokenizer(p, tok)
        frozen_splits = {name: encode_split(s, frozen_tok, p.max_len)
                         for name, s in frozen_raw.items()}
    fitted = fit(todo, splits, frozen_splits, folder, common, evaluation, reported, ctx,
                  p.cert_batch_size)
    n_cert = (len(raw["test"]["y"]) if p.n_test == 0
              else min(p.n_test, len(raw["test"]["y"])))
    record = {}
    record["data"] = {
        "source": sst2["source"], "train": len(raw["train"]["y"]),
        "dev": len(raw["dev"]["y"]), "reported": reported,
        "n_reported": len(raw["test"]["y"]), "vocab": tok.vocab_size,
        "n_certified": n_cert, "n_attacked": p.audit.count(n_cert), "device": device,
        "frozen_train": len(frozen_splits["train"]["y"]) if frozen_splits else 0}
    record["jobs"] = [{"model": name, "family": j.family, "class": j.cls.__name__,
                       **j.train} for name, j in todo.items()]
    record |= {"results": fitted.results, "curves": fitted.curves,
               "audits": fitted.audits}
    return record
