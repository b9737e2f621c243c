"""CROWN on the Lipschitz ViT through auto_LiRPA: an equivalent graph, l2 balls in pixel space,
the pairwise margin specification, and per-point failures recorded instead of raised.

:class:`CrownViT` computes exactly the function of :class:`attncert.models.vit.ViT` (same
weights, materialised once as plain tensors) with operators auto_LiRPA bounds soundly:

- normalisation and patch embedding folded into one strided convolution (both are affine);
- LayerProject x min(1, R / ||x||) written as x (1 - relu(1 - R / sqrt(sum x^2)));
- each head of the attention on its own (Q, K, V, O blocks), softmax as exp(s) / sum exp(s)
  (shift-free: see :mod:`attncert.crown.patches`, patch 5);
- SLL with its t = diag(...) a constant, the norm-constrained maps as their effective matrices.

:func:`certify_batch` bounds a batch of points at one radius in one call (the study's batches:
the model is small, so one point leaves a GPU idle between kernel launches), and
:func:`certify_points` one point at a time (the paper's "per sample" cost); both return one
row per point and eps: certified or not, the worst margin lower bound, the seconds (a batch's
shared among its points), and a status that names a failure ("overflow", "domain",
"out_of_memory", "unsupported", "time_limit", "error") without stopping the loop. LoFAST's "-"
marks overflow failures only (its sec. 5.2); ours are counted by status.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.crown.patches import DomainError
from attncert.crown.patches import apply as _apply_patches
from attncert.layers.attention import linear_weight

_apply_patches()

from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm  # noqa: E402

#: auto_LiRPA methods: CROWN (backward linear relaxation) and alpha-CROWN (its optimised
#: relaxations, "CROWN-Optimized" in auto_LiRPA).
METHODS = {"crown": "CROWN", "alpha_crown": "CROWN-Optimized"}
#: Needed for attention (the guide, STACK.md): matrix mode for every linear bound. The ReduceMax
#: option is moot once softmax has no max (patch 5) and is kept for any other max in a graph.
#: alpha-CROWN: auto_LiRPA 0.3's sparse alphas index only vectors (after a linear layer) or
#: (C, H, W) maps, not the ViT's (tokens, features) activations (its init raises): full alphas.
BOUND_OPTS = {"conv_mode": "matrix", "fixed_reducemax_index": True,
              "sparse_features_alpha": False, "sparse_spec_alpha": False}
_TINY = 1e-12
STATUSES = ("ok", "overflow", "domain", "out_of_memory", "unsupported", "time_limit", "error",
            "skipped")


def _constant(module: nn.Module, name: str, value: Tensor | None) -> None:
    """A frozen tensor of the graph. A parameter, not a buffer: auto_LiRPA reads the graph's
    dtype from its first parameter."""
    if value is None:
        module.register_parameter(name, None)
    else:
        module.register_parameter(name, nn.Parameter(value, requires_grad=False))


class CrownProject(nn.Module):
    """LayerProject(R): x min(1, R / ||x||) per token = x (1 - relu(1 - R / ||x||))."""

    def __init__(self, radius: float):
        super().__init__()
        self.radius = float(radius)
        # the graph's constants as tensors (a Python scalar would be traced as float32)
        _constant(self, "one", torch.ones(1))
        _constant(self, "radius_t", torch.full((1,), self.radius))
        _constant(self, "tiny", torch.full((1,), _TINY * _TINY))  # sqrt stays finite at 0

    def forward(self, x: Tensor) -> Tensor:
        if math.isinf(self.radius):
            return x
        norm = torch.sqrt(torch.sum(x * x, dim=-1, keepdim=True) + self.tiny)
        # R * (1 / norm), not R / norm: auto_LiRPA 0.3 evaluates a division by a sqrt as
        # LayerNorm's (its BoundDiv.forward special case)
        return x * (self.one - F.relu(self.one - self.radius_t * torch.reciprocal(norm)))


class CrownAttention(nn.Module):
    """sum_l softmax(X Q_l (X K_l)^T / sqrt(d_h)) X V_l O_l, one head at a time."""

    def __init__(self, attn: nn.Module):
        super().__init__()
        h, dh = attn.heads, attn.d_head
        wq, wk, wv, wo = (linear_weight(m).detach().clone() for m in
                          (attn.q, attn.k, attn.v, attn.o))
        self.heads, self.scale = h, 1.0 / math.sqrt(dh)
        # head l: rows l*d_h:(l+1)*d_h of W^Q, W^K, W^V and the same columns of W^O
        _constant(self, "wq", wq.reshape(h, dh, -1))
        _constant(self, "wk", wk.reshape(h, dh, -1))
        _constant(self, "wv", wv.reshape(h, dh, -1))
        _constant(self, "wo", wo.reshape(wo.shape[0], h, dh).permute(1, 0, 2))

    def forward(self, x: Tensor) -> Tensor:
        out = None
        for l in range(self.heads):  # noqa: E741 (the head index of the papers)
            q, k, v = F.linear(x, self.wq[l]), F.linear(x, self.wk[l]), F.linear(x, self.wv[l])
            e = torch.exp(torch.matmul(q, k.transpose(1, 2)) * self.scale)
            p = e / torch.sum(e, dim=-1, keepdim=True)
            head = F.linear(torch.matmul(p, v), self.wo[l])
            out = head if out is None else out + head
        return out


class CrownSLL(nn.Module):
    """z = x - 2 W^T diag(t) relu(W x + b) with t materialised."""

    def __init__(self, sll: nn.Module):
        super().__init__()
        w = sll.weight.detach().clone()
        _constant(self, "weight", w)
        _constant(self, "bias", sll.bias.detach().clone())
        # 2 diag(t) W as one (hidden, dim) matrix: the term is relu(W x + b) @ (2 diag(t) W)
        _constant(self, "back", (2.0 * sll.compute_t().detach()[:, None] * w).T.clone())

    def forward(self, x: Tensor) -> Tensor:
        return x - F.linear(F.relu(F.linear(x, self.weight, self.bias)), self.back)


class CrownViT(nn.Module):
    """The Lipschitz ViT (stream blocks, dot-product attention) as an auto_LiRPA-friendly graph;
    pixels (B, C, H, W) in [0, 1] -> logits, equal to the ViT's."""

    def __init__(self, vit: nn.Module):
        super().__init__()
        cfg = vit.config
        if cfg.kind != "lipschitz" or cfg.block != "stream":
            raise ValueError(f"CrownViT covers the Lipschitz ViT with stream blocks, got kind "
                             f"{cfg.kind!r}, block {cfg.block!r}")
        self.pool = cfg.pool
        e = vit.embed.per_patch_matrix().detach()  # (dim, C p p), patches flattened (c, i, j)
        w = e.reshape(cfg.dim, cfg.channels, cfg.patch, cfg.patch)
        mean = vit.normalize.mean.to(w.dtype).reshape(-1)
        std = vit.normalize.std.to(w.dtype).reshape(-1)
        # E ((x - mean) / std) + b = (E / std) x + (b - E (mean / std)), per channel
        w = w / std[None, :, None, None]
        bias = vit.embed.proj.bias.detach() - (w * mean[None, :, None, None]).sum((1, 2, 3))
        _constant(self, "embed_weight", w.clone())
        _constant(self, "embed_bias", bias.clone())
        self.patch = cfg.patch
        cls = vit.cls_token.detach().clone() if vit.cls_token is not None else None
        _constant(self, "cls_token", cls)
        # (n, dim) without the leading 1: auto_LiRPA broadcasts constants from the right only
        _constant(self, "pos", vit.pos.detach()[0].clone())
        self.norm_attn = nn.ModuleList(CrownProject(b.norm_attn.radius) for b in vit.blocks)
        self.attn = nn.ModuleList(CrownAttention(b.attn) for b in vit.blocks)
        self.norm_mlp = nn.ModuleList(CrownProject(b.norm_mlp.radius) for b in vit.blocks)
        self.mlp = nn.ModuleList(CrownSLL(b.mlp) for b in vit.blocks)
        self.norm = CrownProject(vit.norm.radius)
        _constant(self, "head_weight", vit.head_weight().detach().clone())
        _constant(self, "head_bias", vit.head.bias.detach().clone())

    def forward(self, x: Tensor) -> Tensor:
        t = F.conv2d(x, self.embed_weight, self.embed_bias, stride=self.patch)
        t = t.flatten(2).transpose(1, 2)  # (B, n, dim), patches row-major as in patchify
        if self.cls_token is not None:
            t = torch.cat([self.cls_token.expand(t.shape[0], -1, -1), t], dim=1)
        t = t + self.pos
        for norm_attn, attn, norm_mlp, mlp in zip(self.norm_attn, self.attn, self.norm_mlp,
                                                  self.mlp, strict=True):
            t = norm_attn(t)
            t = t + attn(t)
            t = mlp(norm_mlp(t))
        t = self.norm(t)
        f = t[:, 0] if self.pool == "cls" else torch.mean(t, dim=1)
        return F.linear(f, self.head_weight, self.head_bias)


def margin_spec(y: Tensor, num_classes: int) -> Tensor:
    """(B, C-1, C) rows e_y - e_j for every j != y: CROWN's lower bounds of C f are the
    pairwise margins f_y - f_j; all > 0 certifies y."""
    b = y.shape[0]
    eye = torch.eye(num_classes, dtype=torch.float64, device=y.device)
    c = eye[y][:, None, :] - eye[None, :, :]  # (B, C, C); row y is 0
    keep = torch.ones(b, num_classes, dtype=torch.bool, device=y.device)
    keep[torch.arange(b), y] = False
    return c[keep].reshape(b, num_classes - 1, num_classes)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """auto_LiRPA 0.3 creates some tensors with the default dtype: match the model's."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


class TimeLimit(Exception):
    """A point ran past its time limit."""


@dataclass
class Alarm:
    """Whether a :func:`time_limit` block's alarm went off."""

    fired: bool = False


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[Alarm]:
    """Raise :class:`TimeLimit` inside the block after ``seconds`` (0 = no limit). SIGALRM: the
    main thread of a Unix process only (elsewhere the limit is not enforced).

    Yields an :class:`Alarm`: code inside the block may catch the TimeLimit and raise another
    error from it (auto_LiRPA retries some calls under ``except TypeError``), so the caller
    checks ``fired`` rather than the exception's type."""
    alarm = Alarm()
    usable = seconds > 0 and hasattr(signal, "setitimer")
    if usable:
        try:
            def on_alarm(_signum, _frame):
                alarm.fired = True
                raise TimeLimit(f"over {seconds:g} s")

            previous = signal.signal(signal.SIGALRM, on_alarm)
        except ValueError:  # not the main thread
            usable = False
    if usable:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield alarm
    finally:
        if usable:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def failure_status(exc: BaseException) -> str:
    """The recorded status of a point whose bound raised ``exc``."""
    if isinstance(exc, TimeLimit):
        return "time_limit"
    if isinstance(exc, torch.OutOfMemoryError | MemoryError):
        return "out_of_memory"
    if isinstance(exc, NotImplementedError | KeyError):
        return "unsupported"  # an operator, or an operator's case, auto_LiRPA lacks
    if isinstance(exc, DomainError):
        return "domain"  # an intermediate bound left the domain of 1/x or sqrt (patch 6)
    if isinstance(exc, OverflowError | FloatingPointError):
        return "overflow"
    return "error"


@dataclass
class CrownCertifier:
    """A BoundedModule of one ViT (built once; ``build_seconds`` is not charged to points)."""

    bounded: BoundedModule | None
    num_classes: int
    dtype: torch.dtype
    build_seconds: float
    build_error: str = ""

    @classmethod
    def from_vit(cls, vit: nn.Module, image_shape: Sequence[int],
                 dtype: torch.dtype = torch.float64) -> CrownCertifier:
        """Build the bridge and its BoundedModule on the ViT's device; a build failure is kept
        (every point then records "unsupported")."""
        t0 = time.perf_counter()
        net = CrownViT(vit).to(dtype).eval()
        dev = net.head_weight.device
        try:
            with default_dtype(dtype):
                bounded = BoundedModule(net, torch.zeros(1, *image_shape, dtype=dtype,
                                                         device=dev),
                                        bound_opts=dict(BOUND_OPTS), device=dev)
            err = ""
        except Exception as exc:  # noqa: BLE001 (an unsupported graph is a result)
            bounded, err = None, f"{type(exc).__name__}: {exc}"[:300]
        return cls(bounded, net.head_weight.shape[0], dtype, time.perf_counter() - t0, err)

    def margin_lower(self, x: Tensor, y: Tensor, eps: float, method: str = "crown",
                     alpha_iterations: int = 20) -> Tensor:
        """(B, C-1): CROWN lower bounds of f_y - f_j over the l2 ball of radius eps (pixels)."""
        if self.bounded is None:
            raise NotImplementedError(f"the graph could not be bounded: {self.build_error}")
        x = x.to(self.dtype)
        with default_dtype(self.dtype):
            ptb = PerturbationLpNorm(norm=2, eps=float(eps))
            bx = BoundedTensor(x, ptb)
            c = margin_spec(y, self.num_classes).to(device=x.device, dtype=self.dtype)
            if method == "alpha_crown":
                self.bounded.set_bound_opts({"optimize_bound_args": {
                    "iteration": alpha_iterations, "enable_beta_crown": False}})
            lower, _ = self.bounded.compute_bounds(x=(bx,), C=c, method=METHODS[method],
                                                   bound_upper=False)
        return lower.detach()

    def output_bounds(self, x: Tensor, eps: float, method: str = "crown"
                      ) -> tuple[Tensor, Tensor]:
        """(lower, upper) of every logit over the l2 ball (for the soundness tests)."""
        if self.bounded is None:
            raise NotImplementedError(f"the graph could not be bounded: {self.build_error}")
        with default_dtype(self.dtype):
            bx = BoundedTensor(x.to(self.dtype), PerturbationLpNorm(norm=2, eps=float(eps)))
            lower, upper = self.bounded.compute_bounds(x=(bx,), method=METHODS[method])
        return lower.detach(), upper.detach()


def bound_row(index: int, eps: float, method: str, status: str, seconds: float = 0.0,
              batch: int = 1, worst: float = math.nan, error: str = "") -> dict:
    """One (point, eps) row: certified only when the bound ran ("ok") with a positive worst
    margin; ``batch`` 0: no bound ran (a status of :data:`attncert.crown.study.NOT_RUN`)."""
    row = {"index": index, "eps": float(eps), "method": method,
           "certified": status == "ok" and worst > 0, "margin_lower": worst,
           "seconds": seconds, "status": status, "batch": batch}
    if error:
        row["error"] = error
    return row


def certify_batch(cert: CrownCertifier, x: Tensor, y: Tensor, eps: float,
                  method: str = "crown", time_limit_s: float = 0.0,
                  alpha_iterations: int = 20) -> list[dict]:
    """One row per point of ``x`` (B, C, H, W): its CROWN bound at ``eps``, the B points bounded
    by one call of auto_LiRPA (CROWN's relaxations are per point, so a point's bound does not
    depend on the others in its batch; alpha-CROWN optimises the batch's relaxations as one
    loss with one schedule, so its bounds move with the batch by its optimiser's steps, each
    still a sound bound). Rows as :func:`certify_points`'s (``index`` 0..B-1), with
    ``seconds`` the batch's seconds / B and ``batch`` B.

    The time limit is ``time_limit_s`` per bound, B times it for the batch; past it every row
    is "time_limit". Another failure of a batch of several points reruns them one at a time
    (each failure is then its own point's; the failed call's seconds are shared among them),
    except an out-of-memory error, which is raised for the caller to halve the batch; for a
    single point every failure is its row."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    b = len(y)
    t0 = time.perf_counter()
    alarm = Alarm()
    try:
        with time_limit(time_limit_s * b) as alarm:
            lower = cert.margin_lower(x, y, eps, method, alpha_iterations)
            worst = lower.min(dim=1).values.tolist()  # one host read for the batch
        if len(worst) != b:
            raise RuntimeError(f"{len(worst)} bounds for a batch of {b} points")
    except Exception as exc:  # noqa: BLE001 (a failed point is a result, with its status)
        seconds = time.perf_counter() - t0
        status = "time_limit" if alarm.fired else failure_status(exc)
        if status == "out_of_memory" and x.is_cuda:
            torch.cuda.empty_cache()  # the next bounds start from a clean allocator
        if b > 1 and status == "out_of_memory" and isinstance(exc, torch.OutOfMemoryError):
            raise
        if b > 1 and status != "time_limit":
            rows = [dict(r, index=i) for i in range(b)
                    for r in certify_batch(cert, x[i:i + 1], y[i:i + 1], eps, method,
                                           time_limit_s, alpha_iterations)]
            return [dict(r, seconds=r["seconds"] + seconds / b) for r in rows]
        error = f"{type(exc).__name__}: {exc}"[:200]
        return [bound_row(i, eps, method, status, seconds / b, b, error=error) for i in range(b)]
    seconds = time.perf_counter() - t0
    return [bound_row(i, eps, method, "ok" if math.isfinite(w) else "overflow", seconds / b, b,
                 w if math.isfinite(w) else math.nan) for i, w in enumerate(worst)]


def certify_points(cert: CrownCertifier, x: Tensor, y: Tensor, eps_grid: Sequence[float],
                   method: str = "crown", time_limit_s: float = 0.0,
                   alpha_iterations: int = 20, skip: Tensor | None = None,
                   progress: bool = False) -> list[dict]:
    """One row per (point, eps), each bound alone (batch 1): index, eps, method, certified,
    margin_lower (the worst pairwise lower bound), seconds, status, batch (the bounds computed
    together; 0: none ran). ``skip`` (N,
    len(eps_grid)) bool: pairs not run (recorded as status "skipped", 0 s). A failure
    (including non-finite bounds: "overflow") is a row, never an exception; certified is then
    False.
    """
    from attncert.pipeline.progress import bar

    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    rows = []
    pairs = [(i, j) for i in range(len(y)) for j in range(len(eps_grid))]
    for i, j in bar(pairs, desc=method, enabled=progress):
        if skip is not None and bool(skip[i, j]):
            rows.append(bound_row(i, eps_grid[j], method, "skipped", batch=0))
            continue
        (row,) = certify_batch(cert, x[i:i + 1], y[i:i + 1], eps_grid[j], method,
                               time_limit_s, alpha_iterations)
        rows.append(dict(row, index=i))
    return rows
