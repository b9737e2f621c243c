"""SpecFormer's Maximum Singular Value Penalty (MSVP; SpecFormer eq. 12-14, docs/math.md section 7).

    penalty = sum_layers sum_heads lam_q s(W^{Q,h})^2 + lam_k s(W^{K,h})^2 + lam_v s(W^{V,h})^2

s(W) is the largest singular value, estimated by ONE power-iteration step per training call
on persistent per-head vectors, as in spectral normalisation (Miyato et al. 2018): with the
vectors u (d_h), v (d) held fixed, v <- normalise(W_h^T u), u <- normalise(W_h v) and
s = u^T W_h v, whose gradient is u v^T. The vectors are buffers (saved in ``state_dict``).

Head blocks: a projection is an ``nn.Linear(d, d)`` with weight (out, in); head h of W^Q in
the x W convention is ``weight[h*d_h:(h+1)*d_h, :].T`` (docs/math.md section 1), so MSVP uses the
ROW block ``weight[h*d_h:(h+1)*d_h, :]`` (d_h x d, the same singular values). SpecFormer's
public code slices columns, which penalises blocks that are not heads.

An attention module is any module with an integer ``heads`` and linear maps ``q``, ``k``,
``v`` (weight (dim, dim); constrained maps count with their effective matrix, see
:func:`attncert.layers.linear_weight`). When ``k is q`` (tied keys, as in
:class:`attncert.layers.L2MultiHeadAttention`) the key term is lam_k s(W^Q)^2, the formula
with W^K = W^Q, and no second pair of vectors is kept.

A training call batches its work: the head blocks of every map of one kind and shape (all the
layers' W^Q, say) are stacked, so one power step and one product serve them all, where a loop
over layers and maps launched some 800 kernels a step for a 12-layer ViT (with its backward),
eager even when the model's step runs as a CUDA graph. :meth:`MSVP.sigma` keeps the loop, the
reference the tests hold the batch to.

Power iteration converges from below: the estimates are a training regulariser, not
certificate-grade norms. :func:`exact_head_sigma` gives exact values (figures, checks).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from attncert.layers import linear_weight
from attncert.pipeline import rng

__all__ = ["MAPS", "MSVP", "exact_head_sigma", "find_attention_modules", "head_blocks",
           "penalty", "sigma_rows"]

MAPS = ("q", "k", "v")
_TINY = 1e-12


def _is_attention(module: nn.Module) -> bool:
    heads = getattr(module, "heads", None)
    return (isinstance(heads, int) and not isinstance(heads, bool)
            and all(hasattr(getattr(module, m, None), "weight") for m in MAPS))


def find_attention_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Attention modules of ``model`` by qualified name, in ``named_modules`` order.

    A module counts when it has an int ``heads`` and ``q``, ``k``, ``v`` maps with a weight
    (``MultiHeadAttention`` and the modules of ``attncert.layers.attention_variants``). The
    model itself may be one (its name is then "").
    """
    return {name: m for name, m in model.named_modules() if _is_attention(m)}


def head_blocks(module: nn.Module, which: str) -> Tensor:
    """(heads, d_h, d): row blocks of the effective (out, in) weight of map ``which``.

    Block h = ``weight[h*d_h:(h+1)*d_h, :]`` = (W^{which,h})^T in the x W convention; not
    detached (gradients flow to the weight).
    """
    if which not in MAPS:
        raise ValueError(f"which must be one of {MAPS}, got {which!r}")
    w = linear_weight(getattr(module, which))
    out, d = w.shape
    if out % module.heads:
        raise ValueError(f"{out} output features do not split into {module.heads} heads")
    return w.reshape(module.heads, out // module.heads, d)


def _distinct_maps(module: nn.Module) -> tuple[str, ...]:
    """The maps that own a weight: ("q", "v") when keys are tied to queries."""
    return ("q", "v") if module.k is module.q else MAPS


class _HeadVectors(nn.Module):
    """Power-iteration vectors of one attention module: u_{map} (h, d_h), v_{map} (h, d)."""

    def __init__(self, module: nn.Module, generator: torch.Generator | None):
        super().__init__()
        for which in _distinct_maps(module):
            w = head_blocks(module, which).detach()
            h, dh, d = w.shape
            rng.check(generator, w.device, "MSVP initial vectors")
            u = torch.randn(h, dh, generator=generator, device=w.device, dtype=torch.float64)
            v = torch.randn(h, d, generator=generator, device=w.device, dtype=torch.float64)
            self.register_buffer(f"u_{which}", _normalise(u).to(w))
            self.register_buffer(f"v_{which}", _normalise(v).to(w))


def _normalise(t: Tensor) -> Tensor:
    return t / t.norm(dim=-1, keepdim=True).clamp_min(_TINY)


class MSVP(nn.Module):
    """SpecFormer's MSVP over every attention module of ``model``.

    ``forward()``: in training mode, one power-iteration step per head and map (vectors
    updated in place, no gradient), then the penalty
    sum lam_q s_q^2 + lam_k s_k^2 + lam_v s_v^2 over layers and heads, a scalar tensor
    differentiable w.r.t. the weights (s = u^T W_h v, vectors constant). In eval mode the
    vectors are left unchanged. Add the penalty to the loss: ``loss = ce + msvp()``.

    lam_*: SpecFormer's code uses 1e-5 for all three on CIFAR and (5e-3, 6e-4, 7e-5) on
    ImageNet. ``modules``: an explicit {name: attention module} mapping instead of
    :func:`find_attention_modules`. The model's modules are referenced, not registered:
    ``msvp.state_dict()`` holds only the vectors, and ``msvp.to(...)`` moves only them (build
    the MSVP after moving the model, or move both). ``generator`` seeds the initial vectors.
    """

    def __init__(self, model: nn.Module | None = None, lam_q: float = 1e-5, lam_k: float = 1e-5,
                 lam_v: float = 1e-5, *, modules: Mapping[str, nn.Module] | None = None,
                 generator: torch.Generator | None = None):
        super().__init__()
        if (model is None) == (modules is None):
            raise ValueError("give exactly one of model or modules")
        found = find_attention_modules(model) if modules is None else dict(modules)
        if not found:
            raise ValueError("no attention module (int heads and q, k, v maps) found")
        for name, m in found.items():
            if not _is_attention(m):
                raise ValueError(f"{name!r} is not an attention module (heads, q, k, v)")
        self.lam = {"q": float(lam_q), "k": float(lam_k), "v": float(lam_v)}
        self.names = list(found)
        self._targets = list(found.values())  # a plain list: referenced, not registered
        self.vectors = nn.ModuleList(_HeadVectors(m, generator) for m in self._targets)

    @torch.no_grad()
    def power_step(self) -> None:
        """One power-iteration step per head and map: v <- W_h^T u / ||.||, u <- W_h v / ||.||."""
        for module, vec in zip(self._targets, self.vectors, strict=True):
            for which in _distinct_maps(module):
                w = head_blocks(module, which)
                u, v = getattr(vec, f"u_{which}"), getattr(vec, f"v_{which}")
                v.copy_(_normalise(torch.einsum("hod,ho->hd", w, u)))
                u.copy_(_normalise(torch.einsum("hod,hd->ho", w, v)))

    def _sigmas(self) -> list[dict[str, Tensor]]:
        """Per module {map: (heads,) s = u^T W_h v}, differentiable w.r.t. the weights."""
        out = []
        for module, vec in zip(self._targets, self.vectors, strict=True):
            s = {}
            for which in _distinct_maps(module):
                w = head_blocks(module, which)
                # clones: the buffers change in place at the next step, autograd keeps these
                u, v = getattr(vec, f"u_{which}").clone(), getattr(vec, f"v_{which}").clone()
                s[which] = torch.einsum("ho,hod,hd->h", u, w, v)
            s.setdefault("k", s["q"])  # tied keys: W^K = W^Q
            out.append({m: s[m] for m in MAPS})
        return out

    def _groups(self) -> dict[tuple, list[tuple[Tensor, Tensor, Tensor]]]:
        """The maps by (map, keys tied, head blocks' shape, dtype, device): per map its head
        blocks (with their gradient) and its u and v buffers; read at each call, so a model
        moved or cast after the MSVP was built groups as it is now."""
        groups: dict[tuple, list[tuple[Tensor, Tensor, Tensor]]] = {}
        for module, vec in zip(self._targets, self.vectors, strict=True):
            for which in _distinct_maps(module):
                w = head_blocks(module, which)
                key = (which, module.k is module.q, w.shape, w.dtype, w.device)
                groups.setdefault(key, []).append(
                    (w, getattr(vec, f"u_{which}"), getattr(vec, f"v_{which}")))
        return groups

    def forward(self) -> Tensor:
        """The penalty, every group of maps in one batch (:meth:`_groups`); in training mode
        one power step first, the vectors updated in place as :meth:`power_step` does."""
        terms = []
        for (which, tied, *_), maps in self._groups().items():
            w = torch.stack([m[0] for m in maps])  # (maps, heads, d_h, d)
            us, vs = [m[1] for m in maps], [m[2] for m in maps]
            with torch.no_grad():
                u, v = torch.stack(us), torch.stack(vs)  # copies: the buffers change below
                if self.training:
                    wd = w.detach()
                    v = _normalise(torch.einsum("nhod,nho->nhd", wd, u))
                    u = _normalise(torch.einsum("nhod,nhd->nho", wd, v))
                    torch._foreach_copy_(vs, list(v.unbind()))
                    torch._foreach_copy_(us, list(u.unbind()))
            s = torch.einsum("nho,nhod,nhd->nh", u, w, v)
            lam = self.lam[which] + (self.lam["k"] if tied and which == "q" else 0.0)  # W^K=W^Q
            terms.append(lam * s.pow(2).sum())
        return torch.stack(terms).sum()

    @torch.no_grad()
    def sigma(self) -> dict[str, dict[str, Tensor]]:
        """Current estimates {layer name: {"q"|"k"|"v": (heads,) tensor}}, detached, no step."""
        return dict(zip(self.names, self._sigmas(), strict=True))

    def extra_repr(self) -> str:
        lam = ", ".join(f"lam_{m}={self.lam[m]:g}" for m in MAPS)
        return f"layers={len(self.names)}, {lam}"


def penalty(model: nn.Module, msvp: MSVP) -> Tensor:
    """``msvp()`` as a training loss term of ``model``, the form
    :func:`attncert.training.compiled.compiled_loss` compiles: the power step (its vectors
    updated in place) and the penalty, one graph of its own beside the forward pass's."""
    return msvp()


@torch.no_grad()
def exact_head_sigma(model: nn.Module | Mapping[str, nn.Module]) -> dict[str, dict[str, Tensor]]:
    """Exact per-head largest singular values {layer: {"q"|"k"|"v": (heads,) float64}}.

    torch.linalg.matrix_norm(ord=2) of each head block in float64 (SpecFormer Figure 2a:
    max singular value per layer, vanilla vs MSVP-trained). ``model``: a model (searched
    with :func:`find_attention_modules`) or a {name: attention module} mapping.
    """
    found = dict(model) if isinstance(model, Mapping) else find_attention_modules(model)
    return {name: {m: torch.linalg.matrix_norm(head_blocks(mod, m).double(), 2) for m in MAPS}
            for name, mod in found.items()}


def sigma_rows(sigmas: Mapping[str, Mapping[str, Tensor]]) -> list[dict[str, object]]:
    """Tidy rows (layer, depth, map, head, sigma) from :func:`exact_head_sigma` or
    :meth:`MSVP.sigma`, e.g. for ``pandas.DataFrame``; depth is the layer's position."""
    return [{"layer": name, "depth": i, "map": m, "head": h, "sigma": float(s)}
            for i, (name, per_map) in enumerate(sigmas.items())
            for m in MAPS for h, s in enumerate(per_map[m])]
