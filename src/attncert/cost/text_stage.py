"""Work items of the text stage at a params file's scale: every model
:func:`attncert.stages.text.jobs` trains on each dataset of ``text.datasets`` and
``text.frozen.datasets``, counted on the stage's own models (the frozen encoder's forward once
per sentence, its head on the cached states), and the split sizes the stage draws
(:func:`text_sizes`). The image stages' work items are in :mod:`attncert.cost.vision_stages`."""

from __future__ import annotations

import functools

import torch

from attncert.cost.counting import (
    ENCODERS,
    TEXT_SIZES,
    VOCAB,
    Counts,
    attack_step,
    fit,
    forward,
    layer_certificate_counts,
    train_step,
)
from attncert.cost.work import Work, audit_work, capped, in_unit, n_steps, training_work

#: the text models' step kinds for the CUDA-graph speed-up (attncert.cost.graphs); OLSA's has
#: no measurement under graphs yet (its capture failed before its head's closed-form norm),
#: so it counts eager, as every unmeasured kind
TEXT_KINDS = {"OLSAClassifier": "OLSA text", "LipschitzTextTransformer": "LoFAST text",
              "StandardTextTransformer": "standard text"}

_TEXT_COUNTS: dict[tuple, dict[str, Counts]] = {}


def text_sizes(t, sizes: dict[str, int]) -> dict[str, int]:
    """The text stage's counts on one dataset of ``sizes`` (labelled examples per split), as
    :func:`attncert.text.train_text.select_splits` draws them: train, dev + reported (the
    evaluation each epoch), the frozen head's training subset, certified, attacked."""
    if "dev" in sizes:
        n_dev, pool = capped(t.max_test, sizes["dev"]), sizes["train"]
    else:  # a dev split held out of training
        n_dev = max(1, min(capped(t.max_test, sizes["test"]), sizes["train"] // 10))
        pool = sizes["train"] - n_dev
    n_rep = capped(t.max_test, sizes["test"]) if "test" in sizes else n_dev
    n_cert = capped(t.n_test, n_rep)
    return {"train": capped(t.max_train, pool), "eval": n_dev + n_rep,
            "frozen_train": capped(t.frozen.max_train, pool), "certified": n_cert,
            "attacked": t.audit.count(n_cert)}


def text_work(p) -> list[Work]:
    """The text stage's models as :func:`attncert.stages.text.jobs` lists them on every
    dataset of ``text.datasets`` and ``text.frozen.datasets`` (the frozen encoder's forward
    once per sentence, its head on the cached states)."""
    from attncert.stages.text import STUDY, UNITS, jobs, text_datasets, unit_jobs

    t = p["text"]
    # the DVC stage of each job (text_unit@<unit>): SST-2's four parts, another dataset whole
    study_unit = {n: u for u in UNITS if u.startswith(f"{STUDY}-")
                  for n in unit_jobs(t, VOCAB, u)}

    def unit(dataset: str, name: str) -> str:
        return f"text_unit@{study_unit[name] if dataset == STUDY else dataset}"

    def batch(b):
        return (torch.randint(1, VOCAB, (b, t.max_len)),
                torch.ones(b, t.max_len, dtype=torch.bool), torch.zeros(b, dtype=torch.long))

    def emb_batch(model):
        def make(b):
            ids, mask, y = batch(b)
            with torch.no_grad():
                return model.embed(ids, mask), mask, y
        return make

    def counts(model):
        key = (repr(model), t.max_len)
        if key not in _TEXT_COUNTS:
            _TEXT_COUNTS[key] = {"train": fit(train_step(model, batch)),
                                 "forward": fit(forward(model, batch)),
                                 "attack": fit(attack_step(model, emb_batch(model)))}
        return _TEXT_COUNTS[key]

    out = []
    hidden, layers, heads, inter = ENCODERS[t.frozen.source]
    enc = _encoder_forward(hidden, layers, heads, inter, t.max_len)
    for dataset in text_datasets(t):
        n = text_sizes(t, TEXT_SIZES[dataset])
        for name, job in jobs(t, VOCAB, dataset).items():
            if job.cls.__name__ == "FrozenEncoderOLSA":
                continue
            torch.manual_seed(0)
            c = counts(job.cls(**job.kwargs))
            items = training_work("text", f"{dataset} {name}", c, n["train"], n["eval"],
                                  job.train["epochs"], t.train.batch_size, t.cert_batch_size,
                                  graphs=TEXT_KINDS.get(job.cls.__name__, ""))
            if job.family == "lofast":
                cfg = job.kwargs["config"]
                lc = layer_certificate_counts(t.max_len, cfg.dim, cfg.heads, "lofast_M")
                b = n_steps(n["certified"], t.cert_batch_size)
                items.append(Work("text", f"{dataset} {name}: certificates", "fp64",
                                  len(t.lofast.variants) * cfg.depth * b
                                  * lc.flops(t.cert_batch_size),
                                  len(t.lofast.variants) * cfg.depth * b * lc.kernels))
            items.append(audit_work("text", f"{dataset} {name}: PGD audit", c["attack"],
                                    n["attacked"], len(t.cert_eps), t.audit.steps,
                                    t.audit.restarts, t.audit.batch(t.cert_batch_size)))
            out += in_unit(items, unit(dataset, name))
        if dataset not in t.frozen.datasets:
            continue
        # OLSA over a frozen encoder: the encoder's forward once per training and evaluation
        # sentence (its states are cached), then the head trained, evaluated and attacked on
        # those states (counted on the stage's own head over a stand-in encoder of that width)
        job = jobs(t, VOCAB, dataset)["frozen-olsa"]
        head = job.cls(**{**job.kwargs, "encoder": _StandInEncoder(hidden)})
        c = _frozen_head_counts(head, hidden, t.max_len)
        sentences = n_steps(n["frozen_train"] + n["eval"], t.train.batch_size)
        out += in_unit([
            Work("text", f"{dataset} frozen-olsa ({t.frozen.source} encoder forward, once)",
                 "bf16", sentences * enc.flops(t.train.batch_size), sentences * enc.kernels),
            *training_work("text", f"{dataset} frozen-olsa head", c, n["frozen_train"],
                           n["eval"], job.train["epochs"], t.train.batch_size, t.cert_batch_size),
            audit_work("text", f"{dataset} frozen-olsa: PGD audit", c["attack"], n["attacked"],
                       len(t.cert_eps), t.audit.steps, t.audit.restarts,
                       t.audit.batch(t.cert_batch_size))],
            unit(dataset, "frozen-olsa"))
    return out


class _StandInEncoder(torch.nn.Module):
    """What the frozen head reads of its encoder when it is given the cached states: the
    width (``config.hidden_size``)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": hidden})()


def _frozen_head_counts(head, hidden: int, max_len: int) -> dict:
    """The frozen head's train / forward / attack counts on cached (B, L, hidden) states."""
    def states(b):
        return (torch.randn(b, max_len, hidden), torch.ones(b, max_len, dtype=torch.bool),
                torch.zeros(b, dtype=torch.long))
    torch.manual_seed(0)
    return {"train": fit(train_step(head, states)), "forward": fit(forward(head, states)),
            "attack": fit(attack_step(head, states))}


@functools.cache
def _encoder_forward(hidden: int, layers: int, heads: int, inter: int, max_len: int) -> Counts:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                                 num_attention_heads=heads, intermediate_size=inter)).eval()

    def make(b):
        ids = torch.randint(1, VOCAB, (b, max_len))
        return lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        return fit(make)
