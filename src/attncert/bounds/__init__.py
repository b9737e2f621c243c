"""Local and global sensitivity bounds for attention layers (docs/math.md sections 1-4).

Pure functions of tensors, batched over samples (x: (B, n, d), eps: float or (B,)), on the
inputs' device and dtype. Certificate-grade spectral norms (mode="upper") are the default.
"""

from .dotproduct import dot_product_attention_lipschitz
from .global_bounds import (
    GELU_LIPSCHITZ,
    averaged_residual,
    compose,
    gelu_lipschitz,
    kim_l2_attention_lipschitz,
    olsa_layer_lipschitz,
    residual,
)
from .lofast import (
    LofastTerms,
    a_norm,
    as_eps,
    b_norm,
    delta21_m,
    delta21_xi,
    delta22_lofast,
    delta22_naive,
    lofast_bound,
    lofast_from_terms,
    lofast_terms,
    m_norm,
    m_operator,
    m_spectral,
    naive_bound,
    naive_from_terms,
    naive_terms,
    xa_norm,
    xi,
    zeta,
    zeta_cheap_upper,
    zeta_operator,
    zeta_spectral,
)
from .pgd import pgd_sensitivity
from .specformer import specformer_bound
from .spectral import LinearOperator, SpectralNorm, norm_of_product, spectral_norm
from .weights import AttentionWeights, attention_forward, attention_probs

__all__ = [
    "AttentionWeights",
    "GELU_LIPSCHITZ",
    "LinearOperator",
    "LofastTerms",
    "SpectralNorm",
    "a_norm",
    "as_eps",
    "attention_forward",
    "attention_probs",
    "averaged_residual",
    "b_norm",
    "compose",
    "delta21_m",
    "delta21_xi",
    "delta22_lofast",
    "delta22_naive",
    "dot_product_attention_lipschitz",
    "gelu_lipschitz",
    "kim_l2_attention_lipschitz",
    "lofast_bound",
    "lofast_from_terms",
    "lofast_terms",
    "m_norm",
    "m_operator",
    "m_spectral",
    "naive_bound",
    "naive_from_terms",
    "naive_terms",
    "norm_of_product",
    "olsa_layer_lipschitz",
    "pgd_sensitivity",
    "residual",
    "spectral_norm",
    "specformer_bound",
    "xa_norm",
    "xi",
    "zeta",
    "zeta_cheap_upper",
    "zeta_operator",
    "zeta_spectral",
]
