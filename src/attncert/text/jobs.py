"""The text stage's jobs: every model it trains and evaluates (:func:`dataset_jobs`), split into the
independent units (:data:`UNITS`, one DVC stage each) that :func:`unit_jobs` selects. The cost
estimate (:mod:`attncert.cost`) counts the same list. ``p`` is the stage's typed section
(:class:`attncert.text.params.Params`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

from attncert.text.lofast import LipschitzTextTransformer, TextTransformerConfig
from attncert.text.models import (
    FrozenEncoderOLSA,
    OLSAClassifier,
)
from attncert.text.params import STUDY
from attncert.text.standard import StandardTextTransformer

if TYPE_CHECKING:  # the section, for annotations only
    from attncert.text.params import Params



class Job(NamedTuple):
    """One model of the stage: its certificate family, class, constructor arguments and
    training settings (those of :class:`~attncert.text.train_text.TextTrainConfig` beyond the
    stage's common ones)."""

    family: str
    cls: type
    kwargs: dict[str, Any]
    train: dict[str, Any]



def text_datasets(p: Params) -> list[str]:
    """Every dataset the stage reads, SST-2 first: the from-scratch ones, then frozen-only."""
    return [*p.datasets, *(d for d in p.frozen.datasets if d not in p.datasets)]



def dataset_jobs(p: Params, vocab: int, dataset: str = STUDY, sep_token_id: int | None = None
         ) -> dict[str, Job]:
    """Every model of the stage on ``dataset`` by name (the names the report reads:
    "olsa-L<depth>-g<gamma>" and so on): on SST-2 the whole study, on the other datasets of
    ``datasets`` OLSA at every ``olsa.depths``; "frozen-olsa" on the frozen datasets
    (``sep_token_id``: the frozen encoder's [SEP], for the segment ids of sentence pairs).
    The controls (Kim-L2, the standard transformer, the averaged residual and the alpha1
    sweep) are at the deepest of ``olsa.depths``, the gamma ablation at the shallowest (OLSA
    Table 2: one layer)."""
    deep, shallow = max(p.olsa.depths), min(p.olsa.depths)
    g = p.gamma
    olsa_layer = dict(alpha1=p.olsa.alpha1, residual=p.olsa.residual,
                      residual_init=p.olsa.residual_init)
    olsa = dict(vocab_size=vocab, max_len=p.max_len, dim=p.dim, heads=p.heads, **olsa_layer)
    olsa_train = dict(epochs=p.epochs.get(dataset, 0), lr=p.lr, gamma=g)
    frozen = {}
    if dataset in p.frozen.datasets:
        pair = {} if sep_token_id is None else {"sep_token_id": sep_token_id}
        width = {} if p.frozen.dim == 0 else {"hidden": p.frozen.dim}
        decays = {"lr_decay_epochs": tuple(p.frozen.lr_decay_epochs[dataset])
                  } if p.frozen.lr_decay_epochs[dataset] else {}
        frozen["frozen-olsa"] = Job("olsa", FrozenEncoderOLSA,
                                    dict(source=p.frozen.source, heads=p.heads, max_len=p.max_len,
                                         **olsa_layer, **pair, **width),
                                    dict(epochs=p.frozen.epochs[dataset],
                                         lr=p.frozen.lr[dataset], gamma=0.0, **decays))
    if dataset != STUDY:
        scratch = p.olsa.depths if dataset in p.datasets else []
        return {f"olsa-L{d}-g{g:g}": Job("olsa", OLSAClassifier, dict(olsa, depth=d), olsa_train)
                for d in scratch} | frozen
    out = {f"olsa-L{d}-g{g:g}": Job("olsa", OLSAClassifier, dict(olsa, depth=d), olsa_train)
           for d in (0, *p.olsa.depths, *p.olsa.deep_depths)}
    out |= {f"olsa-L{shallow}-g{a:g}": Job("olsa", OLSAClassifier, dict(olsa, depth=shallow),
                                           dict(olsa_train, gamma=a))
            for a in p.gamma_ablation}
    if p.olsa.residual != "averaged":
        out[f"olsa-L{deep}-g{g:g}-averaged"] = Job(
            "olsa", OLSAClassifier, dict(olsa, depth=deep, residual="averaged"), olsa_train)
    out |= {f"olsa-L{deep}-g{g:g}-alpha1-{a:g}": Job(
        "olsa", OLSAClassifier, dict(olsa, depth=deep, residual="averaged", alpha1=a,
                                     train_alpha1=False), olsa_train)
        for a in p.attention_alpha1}
    out[f"kim-l2-L{deep}-g{g:g}"] = Job("olsa", OLSAClassifier,
                                        dict(olsa, depth=deep, attention="l2"), olsa_train)
    out[f"vanilla-L{deep}"] = Job("none", StandardTextTransformer,
                                  dict(vocab_size=vocab, max_len=p.max_len, dim=p.dim,
                                       depth=deep, heads=p.heads, mlp_hidden=2 * p.dim),
                                  dict(epochs=p.epochs[STUDY], lr=p.vanilla.lr, gamma=0.0))
    out |= {f"lofast-L{L}-H{H}-vo{vo:g}": Job(
        "lofast", LipschitzTextTransformer,
        dict(config=TextTransformerConfig(vocab_size=vocab, max_len=p.max_len, dim=p.lofast.dim,
                                          depth=L, heads=H, mlp_hidden=p.lofast.mlp_hidden,
                                          radius_attn=p.lofast.radius_attn,
                                          gamma_qk=p.lofast.gamma_qk, gamma_vo=vo)),
        dict(epochs=p.lofast.epochs, lr=p.lofast.lr, gamma=0.0,
             logit_scale=p.lofast.logit_scale))
        for L in p.lofast.depths for H in p.lofast.heads for vo in p.lofast.gamma_vo}
    return out | frozen



#: The stage's independent units, each one DVC stage (dvc.yaml's ``text_unit`` matrix lists
#: them): SST-2's study in four parts (:func:`unit_jobs`), then every other dataset (its OLSA
#: runs and frozen-encoder head; nothing where the scale leaves it out).
#: :func:`attncert.stages.text.run` gathers.
UNITS = ("sst2-olsa", "sst2-controls", "sst2-lofast", "sst2-frozen", "yelp_polarity", "qqp")



def unit_jobs(p: Params, vocab: int, unit: str, sep_token_id: int | None = None
              ) -> dict[str, Job]:
    """The jobs of one unit of :data:`UNITS`: on SST-2, ``sst2-olsa`` (OLSA at depth 0 and
    every depth), ``sst2-lofast`` (LoFAST's grid), ``sst2-frozen`` (the frozen-encoder head)
    and ``sst2-controls`` (the rest: gamma ablation, residual, alpha1 sweep, Kim-L2, the
    standard transformer); another dataset's unit is :func:`dataset_jobs` on it ({} when the scale
    leaves it out)."""
    if unit not in UNITS:
        raise ValueError(f"text unit {unit!r}: not one of {UNITS}")
    if not unit.startswith(f"{STUDY}-"):
        return dataset_jobs(p, vocab, unit, sep_token_id) if unit in text_datasets(p) else {}
    depths = {f"olsa-L{d}-g{p.gamma:g}" for d in (0, *p.olsa.depths, *p.olsa.deep_depths)}

    def group(name: str, job: Job) -> str:
        if job.cls is FrozenEncoderOLSA:
            return "sst2-frozen"
        if job.family == "lofast":
            return "sst2-lofast"
        return "sst2-olsa" if name in depths else "sst2-controls"
    return {n: j for n, j in dataset_jobs(p, vocab).items() if group(n, j) == unit}
