"""Layers of the Lipschitz and standard ViTs (LoFAST section 5.2, MATH.md sections 1 and 5)."""

from .attention import MultiHeadAttention, linear_weight
from .embed import PatchEmbed, patchify, spectral_norm_exact
from .linear import NormConstrainedLinear
from .norm import Normalize
from .project import LayerProject
from .sll import SLLResidual

__all__ = [
    "LayerProject",
    "MultiHeadAttention",
    "NormConstrainedLinear",
    "Normalize",
    "PatchEmbed",
    "SLLResidual",
    "linear_weight",
    "patchify",
    "spectral_norm_exact",
]
