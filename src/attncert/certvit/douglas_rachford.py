"""CertViT's layer-wise constraining by Douglas-Rachford splitting (docs/math.md section 7).

Gupta et al. (2023), "CertViT: Certified Robustness of Pre-Trained Vision Transformers",
lower the Lipschitz constant of each linear layer of a pre-trained network while keeping the
layer's behaviour on training data. For one layer with weight W0 (out x in) and recorded
inputs x_k (its input/output pairs are (x_k, W0 x_k + b); the bias is kept):

    minimise  ||W||_1   subject to  W in C = intersection over mini-batches B of C_B,
    C_B = { W : c_B(W) = ||X_B (W - W0)^T||_F / sqrt(|B|) - eta <= 0 },

i.e. on every mini-batch of recorded pairs the root-mean-square deviation of the outputs
stays within eta. W0 is in C, so C is never empty. The l1 norm promotes sparse, smaller
weights, which in practice lowers ||W|| (not guaranteed: the diagnostics measure it), and
gives the sparsity mask kept during fine-tuning. The algorithm numbers follow CertViT's
Algorithms 1-3 as summarised in docs/math.md section 7.

* Algorithm 1 (:func:`douglas_rachford`): with tau the threshold and lambda in (0, 2),
      P_n = prox_{tau ||.||_1}(Z_n)             (soft-thresholding: sign(z) max(|z| - tau, 0))
      W_n = P_C(2 P_n - Z_n)                    (Algorithm 2)
      Z_{n+1} = Z_n + lambda (W_n - P_n);
  the output is the sparse iterate P = prox(Z) (Douglas-Rachford: P_n converges to a
  minimiser; Combettes & Pesquet 2007, "A Douglas-Rachford splitting approach to nonsmooth
  convex variational signal recovery").
* Algorithm 2 (:func:`project_outputs`): the projection onto C by Haugazeau's method
  driven by subgradient projections onto the mini-batch sets (Haugazeau 1968; Bauschke &
  Combettes, "Convex Analysis and Monotone Operator Theory", ch. 29-30). At y, every
  violated C_B gives the subgradient projection p_B = y - c_B(y) g_B / ||g_B||^2,
  g_B = (X_B (y - W0)^T)^T X_B / (sqrt(|B|) ||X_B (y - W0)^T||_F); the mini-batches are
  combined in ONE extrapolated step p = y + L sum_B w_B (p_B - y) (Combettes 1997,
  extrapolated parallel subgradient projections; L = sum w_B ||p_B - y||^2 /
  ||sum w_B (p_B - y)||^2 >= 1), and y <- Q(Z, y, p), the projection of the start Z onto
  {u : <u - y, Z - y> <= 0} cap {u : <u - p, y - p> <= 0}, both of which contain C. Hence
  ||y_n - Z|| <= ||P_C(Z) - Z|| for all n, and y_n -> P_C(Z) (Combettes 2000, "Strong
  convergence of block-iterative outer approximation methods for convex optimization").
  Finitely many steps give a point near P_C(Z), feasible up to the tolerance.
* Algorithm 3 (:func:`constrain`): record every linear layer's inputs on training batches
  (forward hooks), run Algorithm 1 on each layer independently, return the new weights,
  the sparsity masks and per-layer diagnostics.

The certificate does not rely on any of this converging: it is computed from the weights
the procedure returns (:mod:`attncert.certvit.certificate`).

Algorithms 1 and 2 (one layer) live in :mod:`attncert.certvit.splitting`; this module holds
Algorithm 3 (every linear layer of a model) and the sparsity mask of fine-tuning, and
re-exports the one-layer names.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attncert.certvit.splitting import (
    DRConfig,
    ProjectionInfo,
    douglas_rachford,
    haugazeau,
    project_outputs,
    soft_threshold,
)
from attncert.data import as_float
from attncert.layers import L2MultiHeadAttention
from attncert.pipeline import rng

__all__ = [
    "DRConfig",
    "DRResult",
    "MaskHandle",
    "ProjectionInfo",
    "Site",
    "constrain",
    "douglas_rachford",
    "freeze_zeros",
    "haugazeau",
    "linear_sites",
    "project_outputs",
    "record_inputs",
    "soft_threshold",
]


# -- Algorithm 3: every linear layer of a model --------------------------------------------


@dataclass(frozen=True)
class Site:
    """One weight block DR acts on: ``rows`` of the weight of the nn.Linear ``module`` (all
    rows when None). The value map W^V of Kim's L2 attention acts per head on
    u_l = x W^{Q,l} (W^{Q,l})^T / sqrt(d_h), not on the layer input, so it is one site per
    head (its rows l d_h .. (l+1) d_h) with inputs recorded at the attention module."""

    name: str
    module: str
    rows: slice | None = None


def linear_sites(model: nn.Module, include: Sequence[str] | None = None) -> list[Site]:
    """The sites of every nn.Linear inside ``model`` (or of the modules named in ``include``).

    The classifier ``head`` is left out: it is not a factor of the features' Lipschitz
    constant (the pairwise test uses its row differences) and the ViT applies it as a
    functional map (unit rows with ``head_norm``), so it is fine-tuned, not constrained.
    """
    sites, kim_v = [], {}
    for name, m in model.named_modules():
        if isinstance(m, L2MultiHeadAttention) and m.value == "kim":
            kim_v[f"{name}.v"] = m
    for name, m in model.named_modules():
        if (not isinstance(m, nn.Linear) or name == "head"
                or (include is not None and name not in include)):
            continue
        if name in kim_v:
            dh = kim_v[name].d_head
            sites += [Site(f"{name}.head{h}", name, slice(h * dh, (h + 1) * dh))
                      for h in range(kim_v[name].heads)]
        else:
            sites.append(Site(name, name))
    if include is not None:
        missing = sorted(set(include) - {s.module for s in sites})
        if missing:
            raise ValueError(f"no constrainable nn.Linear named {missing} in the model")
    return sites


def _kim_head_inputs(attn: L2MultiHeadAttention, x: Tensor) -> Tensor:
    """(h, B*n, d): u_l = x W^{Q,l} (W^{Q,l})^T / sqrt(d_h), the inputs of head l's W^V."""
    h, dh, d = attn.heads, attn.d_head, attn.dim
    # F.linear, not attn.q(x): calling the module would fire the hook recording q's inputs
    q = nn.functional.linear(x, attn.q.weight).reshape(-1, h, dh).transpose(0, 1)  # (h, B*n, d_h)
    return q @ attn.q.weight.view(h, dh, d) / math.sqrt(dh)


@torch.no_grad()
def record_inputs(model: nn.Module, images: Tensor, sites: Sequence[Site], batch_size: int = 256,
                  max_pairs: int = 8192, generator: torch.Generator | None = None
                  ) -> dict[str, Tensor]:
    """{site name: (K, in) inputs} recorded by forward hooks on ``images`` (pixels, uint8 or
    float in [0, 1]), K <= max_pairs tokens drawn at random (each batch contributes its
    share), on the model's device, in random order."""
    modules = dict(model.named_modules())
    dev = next(model.parameters()).device
    store: dict[str, list[Tensor]] = {s.name: [] for s in sites}
    quota = [0]  # rows to keep from each site's input in the current batch

    def keep(name: str, rows: Tensor) -> None:
        idx = torch.randperm(rows.shape[0], generator=generator, device=rows.device)
        store[name].append(rows[idx[: quota[0]]])

    handles = []
    for s in sites:
        if s.rows is None:
            def hook(_m, args, name=s.name):
                keep(name, args[0].reshape(-1, args[0].shape[-1]))
            handles.append(modules[s.module].register_forward_pre_hook(hook))
    heads: dict[str, list[str]] = {}  # attention module -> its W^V head sites, in order
    for s in sites:
        if s.rows is not None:
            heads.setdefault(s.module.rsplit(".", 1)[0], []).append(s.name)
    for attn_name, names in heads.items():
        def attn_hook(m, args, names=names):
            u = _kim_head_inputs(m, args[0])
            for h, name in enumerate(names):
                keep(name, u[h])
        handles.append(modules[attn_name].register_forward_pre_hook(attn_hook))
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(images), batch_size):
            xb = images[i:i + batch_size]
            xb = as_float(xb) if xb.dtype == torch.uint8 else xb.float()
            quota[0] = math.ceil(max_pairs * len(xb) / len(images))
            model(xb.to(dev))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    out = {}
    for name, parts in store.items():
        if not parts:
            raise ValueError(f"{name} was never called as a module in the forward pass: its "
                             "inputs cannot be recorded")
        rows = torch.cat(parts)
        out[name] = rows[torch.randperm(rows.shape[0], generator=generator,
                                        device=rows.device)[:max_pairs]]
    return out


@dataclass
class DRResult:
    """weights / masks: {parameter name ("blocks.0.mlp.fc1.weight"): new weight / bool mask
    of its nonzero entries}; diagnostics: one dict per site (see :func:`douglas_rachford`)."""

    weights: dict[str, Tensor] = field(default_factory=dict)
    masks: dict[str, Tensor] = field(default_factory=dict)
    diagnostics: list[dict] = field(default_factory=list)

    @torch.no_grad()
    def apply(self, model: nn.Module) -> nn.Module:
        """Copy the new weights into ``model`` (in place; returned for chaining)."""
        params = dict(model.named_parameters())
        for name, w in self.weights.items():
            params[name].copy_(w)
        return model


def constrain(model: nn.Module, images: Tensor, config: DRConfig | None = None,
              include: Sequence[str] | None = None, progress: bool = False,
              prox_for: Callable[[Site], Callable[[Tensor], Tensor]] | None = None) -> DRResult:
    """Algorithm 3: Douglas-Rachford (Algorithm 1) on every linear layer of ``model``.

    ``prox_for(site)``: the site's proximal step (None: CertViT's l1 soft-thresholding), e.g.
    the projection onto its spectral-norm ball
    (:func:`attncert.certvit.spectral.constrain_spectral`).

    Inputs are recorded once on ``images`` (training pixels) from the unchanged model; the
    layers are then processed independently, one after the other. The loop over sites is
    embarrassingly parallel: on a device, layers of equal shape could be stacked and run as
    one batched DR, or sites spread over streams/devices. ``model`` is not modified: call
    ``result.apply(model)`` (and :func:`freeze_zeros` with ``result.masks`` to fine-tune).
    """
    from attncert.pipeline.progress import bar

    cfg = config or DRConfig()
    sites = linear_sites(model, include)
    g = rng.generator(cfg.seed, next(model.parameters()).device)
    inputs = record_inputs(model, images, sites, max_pairs=cfg.max_pairs, generator=g)
    modules = dict(model.named_modules())
    result = DRResult()
    for s in bar(sites, desc="Douglas-Rachford", enabled=progress):
        key = f"{s.module}.weight"
        full = result.weights.setdefault(key, modules[s.module].weight.detach().clone())
        rows = slice(None) if s.rows is None else s.rows
        prox = None if prox_for is None else prox_for(s)
        new, diag = douglas_rachford(full[rows], inputs[s.name], cfg, prox)
        full[rows] = new
        result.diagnostics.append({"site": s.name, **diag})
    result.masks = {k: w != 0 for k, w in result.weights.items()}
    return result


# -- fine-tuning with the sparsity mask -------------------------------------------------------


class MaskHandle:
    """Gradient hooks that keep pruned weights at zero; ``remove()`` (or leave the ``with``
    block) to detach them."""

    def __init__(self, handles: list):
        self._handles = handles

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> MaskHandle:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


@torch.no_grad()
def freeze_zeros(model: nn.Module, masks: Mapping[str, Tensor]) -> MaskHandle:
    """Zero the masked-out entries of the named parameters and keep them at zero in training.

    masks: {parameter name: bool tensor, True = trainable}. Each parameter gets a gradient
    hook grad -> grad * mask, so pruned entries get zero gradient. With the optimizers of
    :func:`attncert.training.train.train` (AdamW, fresh state) a zero weight with zero gradient
    stays exactly zero: its moments stay 0, the Adam step is 0 / (0 + eps) = 0 and the
    decoupled weight decay multiplies 0. Works across ``model.to(device)`` (the mask follows
    the gradient's device).
    """
    params = dict(model.named_parameters())
    unknown = sorted(set(masks) - set(params))
    if unknown:
        raise ValueError(f"no parameter named {unknown}")
    handles = []
    for name, mask in masks.items():
        p = params[name]
        if mask.shape != p.shape:
            raise ValueError(f"mask of {name} has shape {tuple(mask.shape)}, parameter "
                             f"{tuple(p.shape)}")
        keep = mask.to(dtype=p.dtype)
        p.mul_(keep.to(p.device))
        handles.append(p.register_hook(lambda g, keep=keep: g * keep.to(g.device)))
    return MaskHandle(handles)
