"""CertViT's layer-wise constraining by Douglas-Rachford splitting (MATH.md section 7).

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
Algorithms 1-3 as summarised in MATH.md section 7.

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
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from attncert import rng
from attncert.data import as_float
from attncert.layers import L2MultiHeadAttention

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


@dataclass(frozen=True)
class DRConfig:
    """Settings of :func:`constrain`.

    threshold: tau, relative to the RMS of the layer's weight entries (DR's step on ||.||_1);
    eta: tolerance on the RMS output deviation per mini-batch, relative to the RMS norm of
    the layer's recorded outputs ||W0 x_k||; relaxation: lambda in (0, 2); iterations:
    Douglas-Rachford steps; batch_size: recorded pairs per constraint set C_B; max_pairs:
    recorded pairs kept per layer (a random subset of the tokens); projection_steps: most
    Haugazeau steps per projection; tol: the projection stops once every c_B <= tol * eta,
    DR once ||Z_{n+1} - Z_n|| <= tol ||Z_n||; seed: the token subset.
    """

    threshold: float = 0.05
    eta: float = 0.05
    relaxation: float = 1.0
    iterations: int = 30
    batch_size: int = 256
    max_pairs: int = 8192
    projection_steps: int = 100
    tol: float = 1e-3
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("iterations", "batch_size", "max_pairs", "projection_steps"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"DRConfig.{name} must be a positive int, got {v!r}")
        for name in ("threshold", "eta", "tol"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
                raise ValueError(f"DRConfig.{name} must be a number > 0, got {v!r}")
        if not 0 < self.relaxation < 2:
            raise ValueError(f"DRConfig.relaxation must be in (0, 2), got {self.relaxation!r}")


def soft_threshold(w: Tensor, tau: float) -> Tensor:
    """prox of tau ||.||_1: sign(w) max(|w| - tau, 0), entrywise."""
    return torch.sign(w) * (w.abs() - tau).clamp_min(0.0)


def haugazeau(x: Tensor, y: Tensor, z: Tensor) -> Tensor:
    """Q(x, y, z): the projection of x onto {u : <u - y, x - y> <= 0} cap {u : <u - z, y - z> <= 0}.

    Haugazeau's formula (Bauschke & Combettes, ch. 29): with pi = <x - y, y - z>, mu = ||x - y||^2,
    nu = ||y - z||^2, rho = mu nu - pi^2 (>= 0),
        Q = z                                        if rho = 0 and pi >= 0,
        Q = x + (1 + pi / nu) (z - y)                if rho > 0 and pi nu >= rho,
        Q = y + (nu / rho) (pi (x - y) + mu (z - y))  if rho > 0 and pi nu < rho.
    (rho = 0 and pi < 0 means the intersection is empty; z is returned, the caller's sets
    are never disjoint.) rho below 1e-12 mu nu counts as 0 (round-off of parallel vectors).
    """
    xy, yz = x - y, y - z
    pi, mu, nu = float((xy * yz).sum()), float(xy.pow(2).sum()), float(yz.pow(2).sum())
    rho = mu * nu - pi * pi
    if nu == 0.0 or rho <= 1e-12 * mu * nu:
        return z
    if pi * nu >= rho:
        return x - (1.0 + pi / nu) * yz
    return y + (nu / rho) * (pi * xy - mu * yz)


@dataclass(frozen=True)
class ProjectionInfo:
    """steps: Haugazeau steps taken; violation: max_B c_B of the result (<= 0: feasible);
    converged: violation <= tol * eta."""

    steps: int
    violation: float
    converged: bool


def _batch_deviation(delta: Tensor, xb: Tensor) -> Tensor:
    """(nb, bs, out): X_B (W - W0)^T for every mini-batch, delta = W - W0."""
    return xb @ delta.T


def project_outputs(z: Tensor, w0: Tensor, xb: Tensor, eta: float, steps: int = 100,
                    tol: float = 1e-3) -> tuple[Tensor, ProjectionInfo]:
    """Algorithm 2: P_C(z), C = {W : ||X_B (W - W0)^T||_F / sqrt(|B|) <= eta for every B}.

    z, w0: (out, in); xb: (nb, bs, in) recorded inputs in nb mini-batches; eta: absolute.
    Haugazeau's method with one extrapolated parallel subgradient projection over all
    violated mini-batches per step (module docstring). Stops when max_B c_B <= tol * eta or
    after ``steps`` steps. All mini-batches are handled in batched products (on a device the
    nb constraints are evaluated in parallel); one step costs O(nb bs in out) operations
    and nb x out x in memory.
    """
    bs = xb.shape[1]
    root = math.sqrt(bs)
    y, step = z.clone(), 0
    while True:
        dev = _batch_deviation(y - w0, xb)  # (nb, bs, out)
        norm = dev.flatten(1).norm(dim=1)  # ||X_B (y - W0)^T||_F
        c = norm / root - eta
        worst = float(c.max())
        if worst <= tol * eta or step == steps:
            return y, ProjectionInfo(step, worst, worst <= tol * eta)
        v = c > 0
        nv, cv = norm[v], c[v]
        m = dev[v].transpose(1, 2) @ xb[v]  # (nv, out, in): D_B^T X_B = sqrt(bs) ||D_B|| g_B
        g2 = m.flatten(1).pow(2).sum(1) / (bs * nv * nv)  # ||g_B||^2
        w = 1.0 / int(v.sum())
        # sum_B w (p_B - y), p_B - y = -(c_B / ||g_B||^2) g_B
        step_sum = torch.einsum("b,boi->oi", -w * cv / (g2 * root * nv), m)
        extrapolation = float(w * (cv * cv / g2).sum()) / float(step_sum.pow(2).sum())
        y = haugazeau(z, y, y + extrapolation * step_sum)
        step += 1


def _batches(x: Tensor, batch_size: int) -> Tensor:
    """(K, in) -> (nb, bs, in): consecutive mini-batches; a remainder < bs is dropped."""
    bs = min(batch_size, x.shape[0])
    nb = x.shape[0] // bs
    return x[: nb * bs].reshape(nb, bs, x.shape[1])


def _rms_rows(t: Tensor) -> float:
    return float(t.pow(2).sum(-1).mean().sqrt())


def douglas_rachford(w0: Tensor, x: Tensor, config: DRConfig,
                     prox: Callable[[Tensor], Tensor] | None = None) -> tuple[Tensor, dict]:
    """Algorithm 1 on one layer: (sparse weight (out, in), diagnostics).

    w0: the layer's weight (out, in); x: its recorded inputs (K, in), already shuffled.
    ``prox``: the proximal step in place of soft-thresholding (None: the l1 objective with
    tau = threshold x RMS weight). The projection onto a closed convex set S (e.g. a
    spectral-norm ball, :func:`attncert.certvit.spectral.clip_spectral`) is the prox of its
    indicator: DR then seeks a point of S cap C, and the result prox(Z) always lies in S
    (when S and C do not meet, it tends to a point of S nearest C: Bauschke, Combettes &
    Luke 2004, "Finding best approximation pairs relative to two closed convex sets").
    Computed in float64 on x's device; the result has w0's dtype and device. Diagnostics:
    spectral norms before/after (exact SVD), the output deviation of the result (max over
    mini-batches of the RMS deviation, relative to the RMS output norm; eta for comparison),
    sparsity (fraction of zero entries), DR iterations, Haugazeau steps, seconds.
    """
    t0 = time.perf_counter()
    w0d = w0.detach().to(device=x.device, dtype=torch.float64)
    xb = _batches(x.to(torch.float64), config.batch_size)
    out_rms = _rms_rows(x.to(torch.float64) @ w0d.T)
    eta = config.eta * out_rms
    if prox is None:
        tau = config.threshold * float(w0d.pow(2).mean().sqrt())

        def prox(w: Tensor) -> Tensor:
            return soft_threshold(w, tau)
    z = w0d.clone()
    proj_steps, iterations = 0, 0
    while iterations < config.iterations:
        p = prox(z)
        w, info = project_outputs(2 * p - z, w0d, xb, eta, config.projection_steps, config.tol)
        proj_steps += info.steps
        iterations += 1
        step = config.relaxation * (w - p)
        z = z + step
        if float(step.norm()) <= config.tol * float(z.norm()):
            break
    result = prox(z)
    dev = _batch_deviation(result - w0d, xb).flatten(1).norm(dim=1) / math.sqrt(xb.shape[1])
    diag = {
        "shape": tuple(w0.shape), "pairs": int(xb.shape[0] * xb.shape[1]),
        "sigma_before": float(torch.linalg.matrix_norm(w0d, 2)),
        "sigma_after": float(torch.linalg.matrix_norm(result, 2)),
        "deviation": float(dev.max()) / out_rms if out_rms > 0 else 0.0, "eta": config.eta,
        "sparsity": float((result == 0).double().mean()),
        "dr_iterations": iterations, "projection_steps": proj_steps,
        "seconds": time.perf_counter() - t0,
    }
    return result.to(dtype=w0.dtype, device=w0.device), diag


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
    from tqdm.auto import tqdm

    cfg = config or DRConfig()
    sites = linear_sites(model, include)
    g = rng.generator(cfg.seed, next(model.parameters()).device)
    inputs = record_inputs(model, images, sites, max_pairs=cfg.max_pairs, generator=g)
    modules = dict(model.named_modules())
    result = DRResult()
    for s in tqdm(sites, desc="Douglas-Rachford", disable=not progress):
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
    :func:`attncert.train.train` (AdamW, fresh state) a zero weight with zero gradient
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
