"""The model kinds the bench times and the cost model prices by (:mod:`attncert.cost.graphs`
names them): each built at its params-file shape with a batch of random inputs, and the terms a
training step adds beyond cross-entropy and AdamW."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from attncert.cost.counting import random_images
from attncert.cost.graphs import (
    FROZEN_HEAD,
    LIPSCHITZ_VIT,
    LOFAST_TEXT,
    MSVP_VIT,
    OLSA_TEXT,
    STANDARD_TEXT,
    STANDARD_VIT,
    TEXT_KINDS,
)
from attncert.pipeline.datasets import stand_in
from attncert.text.tokenize import ENCODERS, VOCAB

__all__ = ["StandInEncoder", "bench_models", "frozen_head", "step_terms"]


class StandInEncoder(nn.Module):
    """What the frozen head reads of its encoder when it is given the cached states: the
    width (``config.hidden_size``)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.config = type("Config", (), {"hidden_size": hidden})()


def frozen_head(t) -> tuple[nn.Module, Callable[[int], tuple], str] | None:
    """The OLSA head over a frozen encoder as ``t`` (the ``text`` section) trains it on its
    first dataset of ``text.frozen.datasets``, on cached states of the encoder's width (a
    stand-in encoder: the head never calls it), and a batch of such states; None when no
    dataset trains one or the encoder's width is unknown."""
    from attncert.text.jobs import dataset_jobs
    from attncert.text.models import FrozenEncoderOLSA

    if not t.frozen.datasets or t.frozen.source not in ENCODERS:
        return None
    job = next(j for j in dataset_jobs(t, VOCAB, t.frozen.datasets[0]).values()
               if j.cls is FrozenEncoderOLSA)
    width = ENCODERS[t.frozen.source][0]
    head = FrozenEncoderOLSA(**job.kwargs, encoder=StandInEncoder(width))

    def states(b):
        e = torch.nn.functional.normalize(torch.randn(b, t.max_len, width), dim=-1)
        return (head.token_norm * e, torch.ones(b, t.max_len, dtype=torch.bool),
                torch.zeros(b, dtype=torch.long))
    to = f" -> {t.frozen.dim}" if t.frozen.dim and t.frozen.dim != width else ""
    return head, states, f"{t.max_len} states of {width}{to}, depth {len(head.layers)}"


def bench_models(params) -> dict[str, tuple[nn.Module, Callable[[int], tuple], str]]:
    """Every trained model kind at its params-file shape: name -> (model, batch(b), shape)."""
    from attncert.grid.params import model_config as grid_model_config
    from attncert.models import build_vit
    from attncert.pipeline.runs import GridPoint
    from attncert.specformer import methods as sf
    from attncert.text.lofast import LipschitzTextTransformer, TextTransformerConfig
    from attncert.text.models import OLSAClassifier
    from attncert.text.standard import StandardTextTransformer

    g, s, sfp, t = params["vit_grid"], params["train_vit"], params["specformer"], params["text"]
    ds, depth, heads = g.dataset[0], max(g.depth), max(g.heads)
    lip = grid_model_config(s, GridPoint(g.results_dir, ds, depth, heads, g.gamma_vo[0]),
                                 stand_in(ds))
    base = sf.base_model_config(stand_in(sfp.datasets[0]), **sfp.vit.arch(), block=sfp.block)

    def images(cfg):
        return functools.partial(random_images, cfg)

    def tokens(b):
        return (torch.randint(1, VOCAB, (b, t.max_len)),
                torch.ones(b, t.max_len, dtype=torch.bool), torch.zeros(b, dtype=torch.long))

    torch.manual_seed(0)
    deep = max(t.olsa.depths)
    lcfg = TextTransformerConfig(vocab_size=VOCAB, max_len=t.max_len, dim=t.lofast.dim,
                                 depth=max(t.lofast.depths), heads=max(t.lofast.heads),
                                 mlp_hidden=t.lofast.mlp_hidden, radius_attn=t.lofast.radius_attn,
                                 gamma_qk=t.lofast.gamma_qk, gamma_vo=t.lofast.gamma_vo[0])
    kinds = {
        LIPSCHITZ_VIT: (build_vit(lip), images(lip),
                        f"{ds} {lip.image_size}px patch {lip.patch}, {lip.dim}-d, depth {depth}, "
                        f"{heads} heads"),
        STANDARD_VIT: (build_vit(base), images(base),
                       f"{base.dim}-d, depth {base.depth}, patch {base.patch}"),
        MSVP_VIT: (build_vit(base), images(base), "as vanilla + MSVP"),
        OLSA_TEXT: (OLSAClassifier(vocab_size=VOCAB, max_len=t.max_len, dim=t.dim,
                                   depth=deep, heads=t.heads), tokens,
                    f"{t.max_len} tokens, {t.dim}-d, depth {deep}"),
        LOFAST_TEXT: (LipschitzTextTransformer(lcfg), tokens,
                      f"{t.max_len} tokens, {lcfg.dim}-d, depth {lcfg.depth}"),
        STANDARD_TEXT: (StandardTextTransformer(VOCAB, t.max_len, t.dim, deep, t.heads,
                                                2 * t.dim), tokens,
                        f"{t.max_len} tokens, {t.dim}-d, depth {deep}"),
    }
    head = frozen_head(t)
    return kinds | ({FROZEN_HEAD: head} if head is not None else {})


def step_terms(params, kind: str, model: nn.Module
               ) -> tuple[Callable[..., Any] | None, Callable[[], None] | None]:
    """(loss(logits, y), after()) of a training step of the bench's ``kind`` beyond
    cross-entropy and AdamW, or (None, None): a text model's as its runs take it
    (:func:`attncert.text.train_text.step_terms`; OLSA's with the certificate regulariser at
    ``text.gamma``, the frozen head's without, as it trains at gamma 0; then every kind's
    re-projection of its orthogonal maps). The bench times and the GPU calibration counts the
    same step."""
    if kind not in TEXT_KINDS:
        return None, None
    from attncert.text.train_text import step_terms as text_step_terms

    return text_step_terms(model, params["text"].gamma if kind == OLSA_TEXT else 0.0)
