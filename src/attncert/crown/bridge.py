"""CROWN on the Lipschitz ViT through auto_LiRPA: l2 balls in pixel space, the pairwise margin
specification, and per-point failures recorded instead of raised, on the equivalent graph of
:mod:`attncert.crown.graph`.

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
import io
import math
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from attncert.crown.graph import CrownViT
from attncert.crown.patches import DomainError
from attncert.crown.patches import apply as _apply_patches

_apply_patches()

from auto_LiRPA import BoundedModule, BoundedTensor, PerturbationLpNorm  # noqa: E402

#: auto_LiRPA methods: CROWN (backward linear relaxation) and alpha-CROWN (its optimised
#: relaxations, "CROWN-Optimized" in auto_LiRPA).
METHODS = {"crown": "CROWN", "alpha_crown": "CROWN-Optimized"}
#: Needed for attention (auto_LiRPA 0.3): matrix mode for every linear bound. The ReduceMax
#: option is moot once softmax has no max (patch 5) and is kept for any other max in a graph.
#: alpha-CROWN: auto_LiRPA 0.3's sparse alphas index only vectors (after a linear layer) or
#: (C, H, W) maps, not the ViT's (tokens, features) activations (its init raises): full alphas.
BOUND_OPTS = {"conv_mode": "matrix", "fixed_reducemax_index": True,
              "sparse_features_alpha": False, "sparse_spec_alpha": False}


def all_margins_positive(lower: Tensor) -> Tensor:
    """(B, 1) bool: every margin's lower bound of the point positive (``lower`` (B, C-1)).

    alpha-CROWN's early stop (auto_LiRPA's ``stop_criterion_func``): a certified point's loss
    is dropped, and once every point of a call is certified its optimisation ends. auto_LiRPA
    keeps each margin's best bound over the iterations, so a point certified at an iteration
    stays certified, and the other points' iterations are unchanged (each point has its own
    relaxations, the optimiser's state is elementwise): the points certified are the full
    run's or more, each bound still sound; a stopped point's margins are the bounds it had
    then, not the tightest 20 iterations would give."""
    return lower.min(dim=1, keepdim=True).values > 0


STATUSES = ("ok", "overflow", "domain", "out_of_memory", "unsupported", "time_limit", "error",
            "skipped")


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
                 dtype: torch.dtype = torch.float64, split_heads: bool = False
                 ) -> CrownCertifier:
        """Build the bridge and its BoundedModule on the ViT's device; a build failure is kept
        (every point then records "unsupported")."""
        t0 = time.perf_counter()
        net = CrownViT(vit, split_heads).to(dtype).eval()
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
                     alpha_iterations: int = 20, stop_certified: bool = True) -> Tensor:
        """(B, C-1): CROWN lower bounds of f_y - f_j over the l2 ball of radius eps (pixels).
        alpha-CROWN with ``stop_certified`` ends its iterations once every point is certified
        (:func:`all_margins_positive`; False: all ``alpha_iterations``, as the cost model's
        measurements run it, the worst case)."""
        return self.margin_call(x, y, eps, method, alpha_iterations, stop_certified)()

    def margin_call(self, x: Tensor, y: Tensor, eps: float, method: str = "crown",
                    alpha_iterations: int = 20, stop_certified: bool = True
                    ) -> Callable[[], Tensor]:
        """:meth:`margin_lower` as a call made ready: the bounded input and the specification
        built, the bound not yet run (what the cost model counts the kernels of)."""
        if self.bounded is None:
            raise NotImplementedError(f"the graph could not be bounded: {self.build_error}")
        x = x.to(self.dtype)
        with default_dtype(self.dtype):
            bx = BoundedTensor(x, PerturbationLpNorm(norm=2, eps=float(eps)))
            c = margin_spec(y, self.num_classes).to(device=x.device, dtype=self.dtype)

        def run() -> Tensor:
            if method == "alpha_crown":  # set when it runs: the module's options are shared
                self.bounded.set_bound_opts({"optimize_bound_args": {
                    "iteration": alpha_iterations, "enable_beta_crown": False,
                    "stop_criterion_func": all_margins_positive if stop_certified else
                    _never}})
            # auto_LiRPA prints its early stops: kept out of the reports
            with default_dtype(self.dtype), contextlib.redirect_stdout(io.StringIO()):
                lower, _ = self.bounded.compute_bounds(x=(bx,), C=c, method=METHODS[method],
                                                       bound_upper=False)
            return lower.detach()

        return run

    def output_bounds(self, x: Tensor, eps: float, method: str = "crown"
                      ) -> tuple[Tensor, Tensor]:
        """(lower, upper) of every logit over the l2 ball (for the soundness tests)."""
        if self.bounded is None:
            raise NotImplementedError(f"the graph could not be bounded: {self.build_error}")
        with default_dtype(self.dtype):
            bx = BoundedTensor(x.to(self.dtype), PerturbationLpNorm(norm=2, eps=float(eps)))
            lower, upper = self.bounded.compute_bounds(x=(bx,), method=METHODS[method])
        return lower.detach(), upper.detach()


def _never(lower: Tensor) -> bool:
    """No early stop (auto_LiRPA's default criterion)."""
    return False


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
                  alpha_iterations: int = 20, stop_certified: bool = True) -> list[dict]:
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
    single point every failure is its row. ``stop_certified``: as
    :meth:`CrownCertifier.margin_lower`'s."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    b = len(y)
    t0 = time.perf_counter()
    alarm = Alarm()
    try:
        with time_limit(time_limit_s * b) as alarm:
            lower = cert.margin_lower(x, y, eps, method, alpha_iterations, stop_certified)
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
                                           time_limit_s, alpha_iterations, stop_certified)]
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
