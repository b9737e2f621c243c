"""A global Lipschitz constant of dot-product attention on a bounded domain.

Dot-product attention has no global Lipschitz constant on R^{n x d}, but on the projected
domain D_R = {X : ||x_i|| <= R for every token} (the output of LayerProject, which the
Lipschitz ViT puts in front of every attention layer) it does. For X in D_R (convex, so the
mean-value theorem applies along the segment between two points of D_R):

  dF = H dX + sum_l [ P_l dX A_l + dP_l X A_l ],
  ||P_l||_2 <= sqrt(||P_l||_1 ||P_l||_inf) <= sqrt(n)          (row-stochastic),
  ||dP_l||_F <= c ||dS_l||_F,  dS_l = (dX B_l X^T + X B_l dX^T) / sqrt(d_h),
  ||X||_2 <= ||X||_F <= sqrt(n) R,

hence Lip(F on D_R) <= ||H|| + sum_l ||A_l|| (sqrt(n) + 2 c n R^2 ||B_l|| / sqrt(d_h)),
with c the row-softmax Lipschitz constant (1 as in LoFAST eq. 20; 1/2 is tight).
"""

from __future__ import annotations

import math

from .lofast import a_norm, b_norm
from .weights import AttentionWeights

__all__ = ["dot_product_attention_lipschitz"]


def dot_product_attention_lipschitz(
    w: AttentionWeights, n: int, radius: float, residual: bool, softmax_lipschitz: float = 1.0
) -> float:
    """Global Lipschitz bound (||.||_F) of F(X) = H X + sum_l P_l(X) X A_l on D_radius."""
    if n < 1 or radius <= 0:
        raise ValueError(f"need n >= 1 and radius > 0, got n={n}, radius={radius}")
    a, b = a_norm(w).double(), b_norm(w).double()  # certificate-grade (upper) norms
    per_head = a * (math.sqrt(n) + 2 * softmax_lipschitz * n * radius**2 * b / math.sqrt(w.d_h))
    return (1.0 if residual else 0.0) + float(per_head.sum())
