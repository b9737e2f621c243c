"""CertViT's adaptation of a pre-trained ViT into a globally Lipschitz one (module surgery).

Gupta et al. (2023), "CertViT: Certified Robustness of Pre-Trained Vision Transformers":
a pre-trained ViT has no global Lipschitz constant, for two reasons (docs/math.md section 4):

* dot-product attention is not globally Lipschitz (Kim et al. 2021, "The Lipschitz constant
  of self-attention", Theorem 3.1). Each one is replaced by Kim's L2 attention with tied
  queries and keys, W^K = W^Q (:meth:`attncert.layers.L2MultiHeadAttention.from_dot_product`,
  ``value="kim"``), whose constant is Kim et al. Theorem 3.2;
* LayerNorm divides by the token's standard deviation, so it has no Lipschitz constant.
  CertViT's code keeps it and leaves it out of the bound (unsound). Here every LayerNorm is
  replaced by a Lipschitz map whose constant the certificate counts (``norm``):

  - ``"project"`` (default), :class:`ProjectNorm`: y = gamma * Pi_R(x - mean(x)) + beta with
    Pi_R the projection onto the l2 ball of radius R (as LayerProject, LoFAST eq. 29).
    Since LayerNorm(x) = gamma_LN sqrt(D) c / ||c|| + beta (c = x - mean(x), eps = 0),
    ProjectNorm with gamma = gamma_LN sqrt(D) / R IS LayerNorm on every token with
    ||c|| >= R, and shrinks the others instead of blowing them up. Lipschitz max|gamma|
    (centring is an orthogonal projection, Pi_R is 1-Lipschitz). R = sqrt(D) by default
    (LayerNorm on tokens with std >= 1); :func:`calibrate_radii` sets R per slot from the
    pre-trained model's token statistics, trading fidelity against max|gamma_LN| sqrt(D) / R.
  - ``"center"``: LipsFormer's CenterNorm (Qi et al. 2023), y = gamma (D/(D-1)) (x - mean(x))
    + beta, Lipschitz (D/(D-1)) max|gamma|; the LayerNorm's gamma, beta are copied.
  - ``"identity"``: the LayerNorm is removed, Lipschitz 1.

GELU MLPs, the patch embedding, the input normalisation and the head stay as they are,
unless the certifiable adaptation asks for more (``pool="mean"``: :class:`MeanPooledViT`
averages every token, class token included, a pooling with constant 1/sqrt(n) in place of
the class token's 1; ``head_norm=True``: the head applies unit rows, so a fixed Lipschitz
margin in the loss keeps its meaning, ``attncert.models.vit.ViTConfig.head_norm``). The
adapted model is an ordinary ``nn.Module`` (pixels in [0, 1] -> logits): fine-tune it with
:func:`attncert.training.train.train` ("adaptation epochs"), then constrain it
(:mod:`attncert.certvit.douglas_rachford`) and certify it (:mod:`attncert.certvit.certificate`).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from attncert.layers import CenterNorm, L2MultiHeadAttention, MultiHeadAttention
from attncert.layers.attention_variants import VALUE_MAPS
from attncert.models.vit import ViT, build_vit
from attncert.pipeline.io import torch_save

__all__ = [
    "NORMS",
    "POOLS",
    "Adaptation",
    "MeanPooledViT",
    "ProjectNorm",
    "adapt",
    "calibrate_radii",
    "load_adapted",
    "norm_lipschitz",
    "output_radius",
    "replace_norm",
    "save_adapted",
]

NORMS = ("project", "center", "identity")
POOLS = ("cls", "mean")
_TINY = 1e-12


class MeanPooledViT(ViT):
    """An adapted ViT that pools by the mean of all n tokens (the class token included).

    (1/n) sum_i t_i has Lipschitz constant 1/sqrt(n) in ||.||_F (Cauchy-Schwarz:
    ||sum_i d_i|| <= sqrt(n) ||D||_F), against 1 for reading the class token: the same
    tokens, the same parameters, a smaller factor in the certificate. Built by :func:`adapt`
    with ``Adaptation(pool="mean")`` (it swaps the class of the adapted copy).
    """

    def pool(self, t: Tensor) -> Tensor:
        return t.mean(dim=1)


def pool_lipschitz(model: ViT) -> float:
    """The pooling's constant: 1/sqrt(n) for mean pooling, 1 for the class token."""
    mean = isinstance(model, MeanPooledViT) or model.config.pool == "mean"
    return 1.0 / math.sqrt(model.config.n_tokens) if mean else 1.0


class ProjectNorm(nn.Module):
    """Per token: y = gamma * Pi_R(x - mean(x)) + beta, Pi_R(c) = c min(1, R / ||c||_2).

    A LayerNorm that clips instead of dividing: with gamma = gamma_LN sqrt(D) / R it equals
    LayerNorm (eps = 0) on every token with ||x - mean(x)|| >= R, i.e. std(x) >= R / sqrt(D),
    and shrinks the smaller tokens instead of blowing them up. Lipschitz max|gamma| per token,
    hence in ||.||_F on the token matrix: centring I - 1 1^T / D is an orthogonal projection
    (norm 1) and Pi_R projects onto a convex set (LayerProject, LoFAST eq. 29). The radius is
    a buffer (saved with the weights): a smaller R matches LayerNorm on more tokens at the
    price max|gamma_LN| sqrt(D) / R, the honest cost of LayerNorm's division.
    """

    def __init__(self, dim: int, radius: float | None = None):
        super().__init__()
        self.dim = dim
        r = math.sqrt(dim) if radius is None else float(radius)
        if not r > 0:
            raise ValueError(f"ProjectNorm radius must be > 0, got {radius!r}")
        self.register_buffer("radius", torch.tensor(r))
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    @classmethod
    def from_layer_norm(cls, ln: nn.LayerNorm, radius: float | None = None) -> ProjectNorm:
        """Equal to ``ln`` on tokens with ||x - mean(x)|| >= radius (default sqrt(D)): gamma =
        gamma_LN sqrt(D) / radius, beta = beta_LN; same device and dtype."""
        (dim,) = ln.normalized_shape
        out = cls(dim, radius).to(device=ln.weight.device, dtype=ln.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(ln.weight * (math.sqrt(dim) / out.radius))
            out.bias.copy_(ln.bias)
        return out

    @torch.no_grad()
    def set_radius(self, radius: float) -> None:
        """Move R, rescaling gamma so that gamma R (the output on clipped tokens) is unchanged."""
        if not radius > 0:
            raise ValueError(f"ProjectNorm radius must be > 0, got {radius!r}")
        self.weight.mul_(self.radius / radius)
        self.radius.fill_(radius)

    def compute_lipschitz(self) -> float:
        """max|gamma|."""
        return float(self.weight.detach().abs().max())

    def forward(self, x: Tensor) -> Tensor:
        c = x - x.mean(dim=-1, keepdim=True)
        scale = (self.radius / c.norm(dim=-1, keepdim=True).clamp_min(_TINY)).clamp(max=1.0)
        return c * scale * self.weight + self.bias

    def extra_repr(self) -> str:
        return f"dim={self.dim}, radius={float(self.radius):g}"


def replace_norm(ln: nn.LayerNorm, norm: str, radius: float | None = None) -> nn.Module:
    """The Lipschitz replacement of one LayerNorm (``norm`` in :data:`NORMS`)."""
    if not isinstance(ln, nn.LayerNorm) or ln.weight is None:
        raise TypeError(f"expected an affine nn.LayerNorm, got {ln!r}")
    if norm == "project":
        return ProjectNorm.from_layer_norm(ln, radius)
    if norm == "center":
        (dim,) = ln.normalized_shape
        out = CenterNorm(dim).to(device=ln.weight.device, dtype=ln.weight.dtype)
        with torch.no_grad():
            out.weight.copy_(ln.weight)
            out.bias.copy_(ln.bias)
        return out
    if norm == "identity":
        return nn.Identity()
    raise ValueError(f"norm {norm!r}: choose from {', '.join(NORMS)}")


def output_radius(module: nn.Module) -> float | None:
    """r such that every output token of the norm slot lies within r of one point (beta),
    whatever the input: R max|gamma| for a ProjectNorm; None (unbounded) otherwise."""
    if isinstance(module, ProjectNorm):
        return float(module.radius) * module.compute_lipschitz()
    return None


def norm_lipschitz(module: nn.Module) -> float:
    """Global Lipschitz constant (per token and in ||.||_F) of a norm slot of the adapted ViT.

    Raises ValueError for a LayerNorm (it has none) or an unknown module.
    """
    if isinstance(module, ProjectNorm | CenterNorm):
        return module.compute_lipschitz()
    if isinstance(module, nn.Identity):
        return 1.0
    if isinstance(module, nn.LayerNorm):
        raise ValueError("LayerNorm has no global Lipschitz constant (it divides by the token's "
                         "std): adapt the model first (attncert.certvit.adapt)")
    raise ValueError(f"no Lipschitz constant known for the norm {module!r}")


@dataclass(frozen=True)
class Adaptation:
    """How a standard ViT was adapted: the norm replacement, its radius (``project`` only;
    None = sqrt(dim)), the L2 attention's value map (``kim``: the Lipschitz one), the pooling
    (``cls``: as pre-trained; ``mean``: :class:`MeanPooledViT`) and whether the head applies
    unit rows (``head_norm``)."""

    norm: str = "project"
    value: str = "kim"
    radius: float | None = None
    pool: str = "cls"
    head_norm: bool = False

    def __post_init__(self) -> None:
        if self.norm not in NORMS:
            raise ValueError(f"Adaptation.norm = {self.norm!r}: choose from {', '.join(NORMS)}")
        if self.value not in VALUE_MAPS:
            raise ValueError(f"Adaptation.value = {self.value!r}: choose from "
                             f"{', '.join(VALUE_MAPS)}")
        if self.radius is not None and not self.radius > 0:
            raise ValueError(f"Adaptation.radius must be > 0, got {self.radius!r}")
        if self.pool not in POOLS:
            raise ValueError(f"Adaptation.pool = {self.pool!r}: choose from {', '.join(POOLS)}")
        if not isinstance(self.head_norm, bool):
            raise ValueError(f"Adaptation.head_norm must be a bool, got {self.head_norm!r}")


def adapt(model: ViT, adaptation: Adaptation | None = None) -> ViT:
    """A copy of the standard ViT ``model`` with L2 attention and Lipschitz norms (CertViT).

    Every ``blocks.N.attn`` becomes ``L2MultiHeadAttention.from_dot_product`` (W^Q kept, W^K
    tied to it, W^V, W^O and their biases copied); every LayerNorm (``blocks.N.norm_attn``,
    ``blocks.N.norm_mlp``, ``norm``) its :func:`replace_norm`; ``pool="mean"`` makes the copy
    a :class:`MeanPooledViT` (a model without a class token already mean-pools) and
    ``head_norm`` sets the config's flag. ``model`` is left unchanged; the copy records its
    :class:`Adaptation` as ``.adaptation``.
    """
    a = adaptation or Adaptation()
    if not isinstance(model, ViT) or model.config.kind != "standard":
        raise ValueError("CertViT adapts the standard ViT (ViTConfig(kind='standard'))")
    out = copy.deepcopy(model)
    for block in out.blocks:
        if not isinstance(block.attn, MultiHeadAttention):
            raise ValueError(f"already adapted: found {type(block.attn).__name__}")
        block.attn = L2MultiHeadAttention.from_dot_product(block.attn, value=a.value)
        block.norm_attn = replace_norm(block.norm_attn, a.norm, a.radius)
        block.norm_mlp = replace_norm(block.norm_mlp, a.norm, a.radius)
    out.norm = replace_norm(out.norm, a.norm, a.radius)
    if a.pool == "mean" and out.config.pool == "cls":
        out.__class__ = MeanPooledViT
    if a.head_norm:
        out.config = dataclasses.replace(out.config, head_norm=True)
    out.adaptation = a
    return out


@torch.no_grad()
def calibrate_radii(adapted: ViT, original: ViT, images: Tensor, quantile: float = 0.1,
                    batch_size: int = 256, slots: Sequence[str] | None = None
                    ) -> dict[str, float]:
    """Set each ProjectNorm's radius to the ``quantile`` of ||x - mean(x)|| over the tokens
    reaching the matching LayerNorm of ``original`` on ``images`` (pixels, uint8 or [0, 1]).
    ``slots``: only the ProjectNorms of these names (default: all).

    Then every ProjectNorm equals its LayerNorm on a fraction >= 1 - quantile of those
    tokens (:meth:`ProjectNorm.set_radius` keeps gamma R): the adapted model stays close to
    the pre-trained one, and the certificate pays max|gamma_LN| sqrt(D) / R per slot.
    Returns {slot name: radius}.
    """
    from attncert.data import as_float

    if not 0 <= quantile < 1:
        raise ValueError(f"quantile must be in [0, 1), got {quantile!r}")
    chosen = slots
    slots = {n: m for n, m in adapted.named_modules()
             if isinstance(m, ProjectNorm) and (chosen is None or n in chosen)}
    if chosen is not None and set(chosen) - set(slots):
        raise ValueError(f"no ProjectNorm named {sorted(set(chosen) - set(slots))}")
    lns = dict(original.named_modules())
    norms: dict[str, list[Tensor]] = {n: [] for n in slots}
    handles = []
    for name in slots:
        if not isinstance(lns.get(name), nn.LayerNorm):
            raise ValueError(f"{name}: no LayerNorm of that name in the original model")

        def hook(_m, args, name=name):
            x = args[0]
            norms[name].append((x - x.mean(-1, keepdim=True)).norm(dim=-1).flatten().cpu())
        handles.append(lns[name].register_forward_pre_hook(hook))
    dev = next(original.parameters()).device
    was_training = original.training
    original.eval()
    try:
        for i in range(0, len(images), batch_size):
            xb = images[i:i + batch_size]
            original((as_float(xb) if xb.dtype == torch.uint8 else xb.float()).to(dev))
    finally:
        for h in handles:
            h.remove()
        original.train(was_training)
    radii = {}
    for name, m in slots.items():
        r = float(torch.quantile(torch.cat(norms[name]).double(), quantile))
        m.set_radius(max(r, _TINY))
        radii[name] = float(m.radius)
    return radii


def save_adapted(model: ViT, path: str | Path) -> None:
    """Atomically save an adapted ViT (config, adaptation, CPU weights) for :func:`load_adapted`."""
    a = getattr(model, "adaptation", None)
    if a is None:
        raise ValueError("not an adapted model (no .adaptation): use attncert.models.vit.save_vit")
    state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    torch_save({"config": model.config.to_dict(), "adaptation": dataclasses.asdict(a),
                "state_dict": state}, path)


def load_adapted(path: str | Path, map_location: str | torch.device = "cpu") -> ViT:
    """Rebuild a model saved by :func:`save_adapted` (eval mode)."""
    obj = torch.load(path, map_location=map_location, weights_only=True)
    model = adapt(build_vit(obj["config"]), Adaptation(**obj["adaptation"]))
    model.load_state_dict(obj["state_dict"])
    return model.to(map_location).eval()
