"""The Lipschitz ViT as a graph auto_LiRPA bounds soundly (:class:`CrownViT`).

:class:`CrownViT` computes exactly the function of :class:`attncert.models.vit.ViT` (same
weights, materialised once as plain tensors) with operators auto_LiRPA bounds soundly:

- normalisation and patch embedding folded into one strided convolution (both are affine);
- LayerProject x min(1, R / ||x||) written as x (1 - relu(1 - R / sqrt(sum x^2)));
- the attention's heads batched in one product (bounds equal to one branch per head), softmax
  as exp(s) / sum exp(s) (shift-free: see :mod:`attncert.crown.patches`, patch 5);
- SLL with its t = diag(...) a constant, the norm-constrained maps as their effective matrices.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attncert.layers.attention import linear_weight

_TINY = 1e-12
#: the attention's form in the graph (:class:`CrownAttention`): a measurement's ``graph``
GRAPHS = {False: "batched-heads", True: "split-heads"}


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
    """sum_l softmax(X Q_l (X K_l)^T / sqrt(d_h)) X V_l O_l, all heads in one batched product
    (or, ``split_heads``, one branch of the graph per head).

    Every relaxation of the attention (the bilinear products, exp, the row sums, 1/x) is
    elementwise, so both forms give the same bounds (``tests/test_crown_heads.py``, to 1e-12);
    the batched one has a quarter of the nodes that need intermediate bounds at 4 heads, and
    CROWN's backward passes launch 3.3-3.6x fewer kernels (counted), which a GPU runs
    launch-bound. The split form is the one measured before 2026-11-29 (:data:`GRAPHS`): kept to
    count its kernels and as the reference of the batched one."""

    def __init__(self, attn: nn.Module, split_heads: bool = False):
        super().__init__()
        h, dh = attn.heads, attn.d_head
        wq, wk, wv, wo = (linear_weight(m).detach().clone() for m in
                          (attn.q, attn.k, attn.v, attn.o))
        self.heads, self.scale, self.split_heads = h, 1.0 / math.sqrt(dh), split_heads
        # rows l*d_h:(l+1)*d_h of W^Q, W^K, W^V are head l's, as are those columns of W^O
        if split_heads:
            wq, wk, wv = (w.reshape(h, dh, -1) for w in (wq, wk, wv))
            wo = wo.reshape(wo.shape[0], h, dh).permute(1, 0, 2)
        for name, w in (("wq", wq), ("wk", wk), ("wv", wv), ("wo", wo)):
            _constant(self, name, w.contiguous())

    def forward(self, x: Tensor) -> Tensor:
        if self.split_heads:
            return self._per_head(x)
        b, n, _ = x.shape
        q = F.linear(x, self.wq).reshape(b, n, self.heads, -1).permute(0, 2, 1, 3)
        kt = F.linear(x, self.wk).reshape(b, n, self.heads, -1).permute(0, 2, 3, 1)
        v = F.linear(x, self.wv).reshape(b, n, self.heads, -1).permute(0, 2, 1, 3)
        e = torch.exp(torch.matmul(q, kt) * self.scale)  # (B, h, n, n)
        p = e / torch.sum(e, dim=-1, keepdim=True)
        return F.linear(torch.matmul(p, v).permute(0, 2, 1, 3).reshape(b, n, -1), self.wo)

    def _per_head(self, x: Tensor) -> Tensor:
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
    pixels (B, C, H, W) in [0, 1] -> logits, equal to the ViT's (``split_heads``: the
    attention's form, :class:`CrownAttention`)."""

    def __init__(self, vit: nn.Module, split_heads: bool = False):
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
        self.attn = nn.ModuleList(CrownAttention(b.attn, split_heads) for b in vit.blocks)
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
