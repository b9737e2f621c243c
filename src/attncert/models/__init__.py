"""Models: the Lipschitz ViT of LoFAST section 5.2 and the standard ViT."""

from .vit import (
    Block,
    Component,
    ViT,
    ViTConfig,
    build_vit,
    lipschitz_product,
    load_vit,
    propagate,
    save_vit,
)

__all__ = ["Block", "Component", "ViT", "ViTConfig", "build_vit",
           "lipschitz_product", "load_vit", "propagate", "save_vit"]
