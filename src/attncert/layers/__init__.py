"""Layers of the Lipschitz and standard ViTs (LoFAST section 5.2, docs/math.md sections 1 and 5)."""

from .attention import MultiHeadAttention, linear_weight
from .attention_variants import (
    CenterNorm,
    L2MultiHeadAttention,
    LNFormerAttention,
    ResidualScale,
    ScaledCosineAttention,
    spectral_init_,
)
from .embed import PatchEmbed, patchify, spectral_norm_exact
from .linear import NormConstrainedLinear, OrthogonalLinear
from .norm import Normalize
from .project import LayerProject, project_local_lipschitz
from .sll import SLLResidual

__all__ = [
    "CenterNorm",
    "L2MultiHeadAttention",
    "LNFormerAttention",
    "LayerProject",
    "MultiHeadAttention",
    "NormConstrainedLinear",
    "OrthogonalLinear",
    "Normalize",
    "PatchEmbed",
    "ResidualScale",
    "SLLResidual",
    "ScaledCosineAttention",
    "linear_weight",
    "patchify",
    "project_local_lipschitz",
    "spectral_init_",
    "spectral_norm_exact",
]
