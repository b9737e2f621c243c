"""The training losses: cross-entropy at a temperature plus an optional margin term.

Margin terms (``margin``; on logits f, true class y, s = ``logit_scale``):
  "none": CE(s f, y);
  "lmt":  CE(s (f + lmt_offset (1 - onehot(y))), y)  (LMT, Tsuzuku et al. 2018: the offset stands
          for sqrt(2) c L, a fixed value here since dot-product attention has no global L);
  "olsa": CE(s f, y) - olsa_gamma * mean(relu(M / sqrt(2))), M = f_y - max_{j != y} f_j
          (OLSA's certificate regulariser, docs/math.md section 7);
  "radius": log(1 + sum_{j != y} exp(s (lmt_offset - (f_y - f_j) / ||w_y - w_j||))), w the
          rows of ``model.head_weight()``: the pairwise certificate's own margin (each rival's
          gap per unit of its head-row distance), so with features L-Lipschitz and
          lmt_offset = L eps a term near 0 means a pairwise radius above eps. Unlike "lmt"'s one
          offset for every rival it needs no assumption on the rows' distances, and rows drawn
          together shrink the gaps and the distances alike (no gain in the loss).
  "lofast": CE(s (f + ||w_y - w_j|| delta_feat(x, eps) (1 - onehot(y))), y), mixed with the
          plain CE: the pairwise certificate's own test with LoFAST's end-to-end bound at a
          training radius, differentiated through it (:mod:`attncert.training.certified_training`;
          it needs the model and its input, so :func:`attncert.training.train.step_loss` computes
          it).
The scale s (a CE temperature) matters for Lipschitz models: their features have norm ~1, so
unscaled CE wants a huge head; s changes the loss only, never the predictions or certificates.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

__all__ = ["MARGINS", "logit_margin", "radius_loss", "training_loss"]

MARGINS = ("none", "lmt", "olsa", "radius", "lofast")


def logit_margin(logits: Tensor, y: Tensor) -> Tensor:
    """(B,): M = f_y - max_{j != y} f_j."""
    true = logits.gather(1, y[:, None]).squeeze(1)
    other = logits.masked_fill(F.one_hot(y, logits.shape[1]).bool(), -math.inf)
    return true - other.max(dim=1).values


def radius_loss(logits: Tensor, y: Tensor, head_weight: Tensor, offset: float,
                scale: float) -> Tensor:
    """The "radius" margin term (module docstring), averaged over the batch: rival j's gap
    (f_y - f_j) / ||w_y - w_j|| below ``offset`` costs softplus-like, ``scale`` per unit."""
    dist = torch.cdist(head_weight, head_weight).to(logits.dtype)[y]  # (B, C), 0 at y
    gap = logits.gather(1, y[:, None]) - logits
    z = scale * (offset - gap / dist.clamp_min(1e-6))
    z = z.masked_fill(F.one_hot(y, logits.shape[1]).bool(), -math.inf)
    return torch.logsumexp(torch.cat([z, torch.zeros_like(z[:, :1])], 1), 1).mean()


def training_loss(logits: Tensor, y: Tensor, cfg: Any,
                  head_weight: Tensor | None = None) -> Tensor:
    """CE plus the configured margin term (module docstring); "radius" needs the head's rows
    ``head_weight`` (C, d)."""
    s = cfg.logit_scale
    if cfg.margin == "radius":
        if head_weight is None:
            raise ValueError("margin 'radius' needs the head's rows (head_weight)")
        return radius_loss(logits, y, head_weight, cfg.lmt_offset, s)
    if cfg.margin == "lmt":
        not_true = 1.0 - F.one_hot(y, logits.shape[1]).to(logits.dtype)
        return F.cross_entropy(s * (logits + cfg.lmt_offset * not_true), y)
    loss = F.cross_entropy(s * logits, y)
    if cfg.margin == "olsa":
        loss = loss - cfg.olsa_gamma * F.relu(logit_margin(logits, y) / math.sqrt(2)).mean()
    return loss
