"""The text stage's plan: every model :func:`attncert.text.jobs.dataset_jobs` lists on each
dataset of ``text.datasets`` and ``text.frozen.datasets``, in the unit that trains it
(``text_unit@<unit>``: SST-2's four parts, another dataset whole), at the split sizes the stage
draws from the data stage's subsets (:func:`text_sizes`): trained, certified (LoFAST's models,
per layer) and audited; the OLSA head over a frozen encoder after one forward of the encoder
per sentence (its states are cached)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

from attncert.pipeline.jobs import (
    Audit,
    Diagnostics,
    EncoderForward,
    Forwards,
    Job,
    LayerCertify,
    Model,
    Train,
    capped,
    split_sizes,
)
from attncert.pipeline.params import StudyParams
from attncert.text.jobs import STUDY, UNITS, dataset_jobs, text_datasets, unit_jobs
from attncert.text.models import FrozenEncoderOLSA
from attncert.text.params import Params
from attncert.text.tokenize import ENCODERS, VOCAB


def text_sizes(t: Params, sizes: Mapping[str, int]) -> dict[str, int]:
    """The text stage's counts on one dataset of ``sizes`` (labelled examples per split), as
    :func:`attncert.text.train_text.select_splits` draws them: train, dev (evaluated after
    every epoch), reported, the frozen head's training subset, certified, attacked."""
    if "dev" in sizes:
        n_dev, pool = capped(t.max_test, sizes["dev"]), sizes["train"]
    else:  # a dev split held out of training
        n_dev = max(1, min(capped(t.max_test, sizes["test"]), sizes["train"] // 10))
        pool = sizes["train"] - n_dev
    n_rep = capped(t.max_test, sizes["test"]) if "test" in sizes else n_dev
    n_cert = capped(t.n_test, n_rep)
    return {"train": capped(t.max_train, pool), "dev": n_dev, "reported": n_rep,
            "frozen_train": capped(t.frozen.max_train, pool), "certified": n_cert,
            "attacked": t.audit.count(n_cert)}


def _builder(cls: type, kwargs: Mapping) -> Callable:
    """``cls(**kwargs)``, built when called (a job's model, for its counts)."""
    return lambda **more: cls(**kwargs, **more)


def jobs(p: StudyParams) -> list[Job]:
    """Per dataset, its models in :func:`dataset_jobs` order (the frozen head last)."""
    t = p["text"]
    unit_of = {n: u for u in UNITS if u.startswith(f"{STUDY}-") for n in unit_jobs(t, VOCAB, u)}
    if t.frozen.datasets and t.frozen.source not in ENCODERS:
        raise ValueError(f"text.frozen.source: the shape of {t.frozen.source!r} is unknown; "
                         f"add it to attncert.text.tokenize.ENCODERS (known: "
                         f"{', '.join(ENCODERS)})")
    width = ENCODERS.get(t.frozen.source, (0,))[0]
    out = []
    for dataset in text_datasets(t):
        n = text_sizes(t, split_sizes(p["data"], dataset))
        audit = Audit("", n["attacked"], len(t.cert_eps), t.audit.steps, t.audit.restarts,
                      t.audit.batch(t.cert_batch_size))
        frozen, final = [], n["dev"] + n["reported"]  # the final evaluation: dev and reported
        for name, job in dataset_jobs(t, VOCAB, dataset).items():
            what = f"{dataset} {name}"
            diagnosed = (Diagnostics(n["certified"], t.cert_batch_size, fp64=False),
                         ) if job.kwargs.get("depth", 1) else ()  # depth 0: no attention
            unit = f"text_unit@{unit_of[name] if dataset == STUDY else dataset}"
            if job.cls is FrozenEncoderOLSA:
                frozen = [Job("text", unit, what, Model(
                    "frozen_head", build=_builder(job.cls, job.kwargs), max_len=t.max_len,
                    width=width, margin="olsa" if job.train.get("gamma") else "none"), (
                    EncoderForward(f"{what} ({t.frozen.source} encoder forward, once)",
                                   t.frozen.source, n["frozen_train"] + final,
                                   t.cert_batch_size, t.max_len),
                    Train(f"{what} head", n["frozen_train"], n["dev"], job.train["epochs"],
                          t.train.batch_size, t.train.eval_batch_size),
                    Forwards(f"{what}: final evaluation", final, t.cert_batch_size),
                    replace(audit, what=f"{what}: PGD audit"), *diagnosed))]
                continue
            phases: list = [Train(what, n["train"], n["dev"], job.train["epochs"],
                                  t.train.batch_size, t.train.eval_batch_size),
                            Forwards(f"{what}: final evaluation", final, t.cert_batch_size)]
            if job.family == "lofast":
                cfg = job.kwargs["config"]
                phases.append(LayerCertify(f"{what}: certificates", n["certified"],
                                           len(t.lofast.variants), t.cert_batch_size,
                                           t.max_len, cfg.dim, cfg.heads, cfg.depth))
            phases += [replace(audit, what=f"{what}: PGD audit"), *diagnosed]
            out.append(Job("text", unit, what, Model(
                "text", build=_builder(job.cls, job.kwargs), max_len=t.max_len,
                family=job.cls.__name__, margin="olsa" if job.train.get("gamma") else "none"),
                tuple(phases)))
        out += frozen
    return out
