"""Does a transformer's attention do anything? Diagnostics of a trained model's attention.

A certified transformer can reach its certificates by switching its attention off: attention
weights driven to uniform (the layer becomes mean pooling) or a value path driven to zero.
A certificate of such a model is a certificate of a token-wise MLP. :func:`attention_diagnostics`
measures, on the points a stage evaluates:

* ``entropy``: per attention layer, the mean over points, heads and query rows of the row
  entropy of the attention matrix divided by log n (1: exactly uniform rows; 0: one-hot rows);
* ``acc`` / ``acc_uniform`` / ``acc_identity``: clean accuracy with the trained attention
  weights, with every attention matrix replaced by uniform weights 1/n (mean pooling over the
  tokens) and by the identity (each token attends to itself only); the value path, the
  residual and everything else are the model's own;
* ``uniform_gap`` / ``identity_gap``: the accuracy lost, in points (100 x fraction), with the
  uniform and the identity replacement: 0 means the trained pattern (resp. any token mixing)
  makes no difference to any prediction;
* ``logit_max``: the largest |attention logit| seen; ``logit_cap``: the structural cap on it
  (:func:`logit_cap`), so every attention weight lies within a factor exp(2 cap) of 1/n.

Every attention module must expose ``compute_probs(x, ...) -> (B, h, n, n)`` and call it in its
forward pass, at least once it is replaced on the instance (the baselines of
:mod:`attncert.layers.attention_variants` always do; the ViT's dot-product attention computes
the same matrix fused with the values until then); a module whose forward bypasses it is
refused, never silently measured as the trained model.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from attncert.pipeline.batching import in_batches

__all__ = ["ABLATIONS", "attention_diagnostics", "attention_layers", "local_global_radius",
           "logit_cap", "override_attention", "row_entropy"]

#: how :func:`override_attention` replaces every attention matrix
ABLATIONS = ("uniform", "identity")
#: points per batch of the diagnostics' forward passes, unless a caller sets its own
BATCH = 500


def attention_layers(model: nn.Module) -> dict[str, nn.Module]:
    """Every module of ``model`` that has an attention matrix (a ``compute_probs`` method), by
    module name, in registration order."""
    return {name: m for name, m in model.named_modules()
            if callable(getattr(type(m), "compute_probs", None))}


def _key_mask(args: tuple, kwargs: Mapping[str, Any]) -> Tensor | None:
    mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
    return mask


def _replacement(mode: str, x: Tensor, heads: int, mask: Tensor | None) -> Tensor:
    """(B, h, n, n) uniform or identity attention for tokens ``x`` (B, n, d); a key mask (B, n)
    (False: padding) spreads the uniform weights over the real keys only."""
    b, n = x.shape[:2]
    if mode == "identity":
        p = torch.eye(n, dtype=x.dtype, device=x.device).expand(b, heads, n, n)
        return p.contiguous()
    keys = (torch.ones(b, n, dtype=x.dtype, device=x.device) if mask is None
            else mask.to(x.dtype))
    p = keys / keys.sum(-1, keepdim=True)
    return p[:, None, None, :].expand(b, heads, n, n).contiguous()


@contextlib.contextmanager
def override_attention(model: nn.Module, mode: str) -> Iterator[dict[str, int]]:
    """Within the block, every attention layer of ``model`` uses ``mode``'s attention matrix
    ("uniform" or "identity", :data:`ABLATIONS`) in place of its own. Yields {layer: calls}:
    :func:`attention_diagnostics` checks that each layer was used (a forward pass that bypasses
    ``compute_probs`` would otherwise be measured as the trained model)."""
    if mode not in ABLATIONS:
        raise ValueError(f"attention ablation {mode!r}: choose from {', '.join(ABLATIONS)}")
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layer (no module with "
                         "compute_probs)")
    calls = dict.fromkeys(layers, 0)

    def make(name: str, module: nn.Module) -> Callable[..., Tensor]:
        def probs(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            calls[name] += 1
            return _replacement(mode, x, module.heads, _key_mask((x, *args), kwargs))
        return probs

    for name, module in layers.items():
        module.compute_probs = make(name, module)  # shadows the method on this instance only
    try:
        yield calls
    finally:
        for module in layers.values():
            del module.compute_probs


def row_entropy(p: Tensor, mask: Tensor | None = None) -> Tensor:
    """(B,) mean over heads and (real) query rows of the row entropy of ``p`` (B, h, n, n)
    divided by log of the number of real keys: 1 for uniform rows, 0 for one-hot rows (a row
    over one key counts 0)."""
    ent = -(p * torch.log(p.clamp_min(1e-30))).sum(-1)  # (B, h, n)
    b, _, n, _ = p.shape
    keys = (torch.full((b,), float(n), dtype=p.dtype, device=p.device) if mask is None
            else mask.to(p.dtype).sum(-1))
    log_n = torch.log(keys).clamp_min(1e-30)[:, None, None]
    rel = (ent / log_n).where(keys[:, None, None] > 1, torch.zeros_like(ent))
    if mask is None:
        return rel.mean((1, 2))
    q = mask.to(p.dtype)[:, None, :]  # real query rows
    return (rel * q).sum((1, 2)) / (q.sum((1, 2)) * p.shape[1])


def logit_cap(config: Any) -> float | None:
    """The largest |attention logit| a Lipschitz ViT's constraints allow: every attention input
    token has norm <= R (``radius_attn``, LayerProject) and ||W^Q_h||, ||W^K_h|| <= gamma_qk, so
    |x_i W^Q_h (x_j W^K_h)^T| / sqrt(d_h) <= R^2 gamma_qk^2 / sqrt(d_h). None for a model without
    that structure (a standard ViT, another attention): nothing caps its logits."""
    if getattr(config, "kind", None) != "lipschitz" or getattr(config, "attention", "dot") != "dot":
        return None
    d_h = config.dim // config.heads
    return float(config.radius_attn) ** 2 * float(config.gamma_qk) ** 2 / math.sqrt(d_h)


def _logits(module: nn.Module, x: Tensor) -> Tensor | None:
    """(B, h, n, n) dot-product logits of a MultiHeadAttention (None for another attention)."""
    from attncert.layers import MultiHeadAttention

    if type(module) is not MultiHeadAttention:
        return None
    q, k = module._split(module.q(x)), module._split(module.k(x))
    return q @ k.transpose(-1, -2) / math.sqrt(module.d_head)


@torch.no_grad()
def attention_diagnostics(model: nn.Module, x: Tensor | tuple[Tensor, ...], y: Tensor,
                          batch_size: int = BATCH) -> dict[str, Any]:
    """The diagnostics of the module docstring on points ``x`` with labels ``y`` (the model
    and the points on one device; batches of ``batch_size``, grown on a CUDA device as
    :func:`attncert.pipeline.batching.in_batches` grows them): ``x`` a tensor of inputs
    (``model(xb)``) or a tuple of tensors with one row per point (``model(*xb)``: a text
    model's ids and mask). Accuracies are fractions, gaps points. The model is left in eval
    mode."""
    parts = x if isinstance(x, tuple) else (x,)
    if any(len(t) != len(y) for t in parts) or len(y) == 0:
        raise ValueError(f"attention_diagnostics needs as many labels as points (> 0), got "
                         f"{[len(t) for t in parts]} points and {len(y)} labels")
    model.eval()
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no attention layer (no module with "
                         "compute_probs)")
    def batch(start: int, stop: int) -> tuple[dict, dict, dict]:
        """This batch's entropy sums, largest logits and correct counts (returned, not added
        up in place, so a batch retried at half its size after running out of memory counts
        once)."""
        ent_sum = dict.fromkeys(layers, 0.0)
        logit_max = dict.fromkeys(layers, 0.0)
        correct = {}

        def capture(name: str):
            def hook(module, args, kwargs, _out):
                xin, mask = args[0], _key_mask(args, kwargs)
                p = (module.compute_probs(xin, mask) if mask is not None
                     else module.compute_probs(xin))
                ent_sum[name] += float(row_entropy(p.double(), mask).sum())
                s = _logits(module, xin)
                if s is not None:
                    logit_max[name] = max(logit_max[name], float(s.abs().max()))
            return hook

        xb, yb = tuple(t[start:stop] for t in parts), y[start:stop]
        handles = [m.register_forward_hook(capture(n), with_kwargs=True)
                   for n, m in layers.items()]
        try:
            correct["trained"] = int((model(*xb).argmax(-1) == yb).sum())
        finally:
            for h in handles:
                h.remove()
        for mode in ABLATIONS:
            with override_attention(model, mode) as calls:
                correct[mode] = int((model(*xb).argmax(-1) == yb).sum())
            unused = [n for n, c in calls.items() if c == 0]
            if unused:
                raise ValueError(f"attention layer(s) {unused} do not form their attention "
                                 "matrix with compute_probs: the ablation cannot replace it")
        return ent_sum, logit_max, correct

    # on a CUDA device the batch grows to base.batch_memory of its memory (pipeline.batching)
    runs = in_batches(len(y), batch_size, batch, "attention diagnostics", device=y.device)
    ent_sum = {k: sum(r[0][k] for r in runs) for k in layers}
    logit_max = {k: max(r[1][k] for r in runs) for k in layers}
    correct = {k: sum(r[2][k] for r in runs) for k in ("trained", *ABLATIONS)}
    n = len(y)
    acc = {k: v / n for k, v in correct.items()}
    entropy = [ent_sum[k] / n for k in layers]
    from attncert.layers import MultiHeadAttention

    dot = [k for k, m in layers.items() if type(m) is MultiHeadAttention]
    config = getattr(model, "config", None)
    return {
        "layers": list(layers),
        "entropy": entropy,
        "entropy_mean": sum(entropy) / len(entropy),
        "acc": acc["trained"],
        "acc_uniform": acc["uniform"],
        "acc_identity": acc["identity"],
        "uniform_gap": 100.0 * (acc["trained"] - acc["uniform"]),
        "identity_gap": 100.0 * (acc["trained"] - acc["identity"]),
        "logit_max": max((logit_max[k] for k in dot), default=None),
        "logit_cap": None if config is None else logit_cap(config),
        "n": n,
    }


def local_global_radius(median_radius: Mapping[str, float], local: str = "lofast_M_pairwise",
                        reference: str = "global_pairwise") -> float | None:
    """The median certified radius of ``local`` over that of ``reference`` (the global bound
    on the projected ball), from a ``median_radius`` mapping ({variant_test: radius}); None
    when either is missing or the reference's median is 0 (no ratio to report)."""
    a, b = median_radius.get(local), median_radius.get(reference)
    if a is None or b is None or not b > 0:
        return None
    return float(a) / float(b)
