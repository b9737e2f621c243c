"""CertViT (Gupta et al. 2023, "CertViT: Certified Robustness of Pre-Trained Vision
Transformers"), soundly: load a pre-trained ViT, adapt it (L2 attention, Lipschitz norms),
constrain its linear layers by Douglas-Rachford splitting, fine-tune, certify with a global
Lipschitz bound that counts every component (docs/math.md sections 4, 5, 7).

    model = load_model("google/vit-base-patch16-224")       # or an HF folder / save_vit file
    adapted = adapt(model, Adaptation(norm="project"))
    calibrate_radii(adapted, model, train_images)            # optional: closer to LayerNorm
    train(adapted, ...)                                       # adaptation epochs
    result = constrain(adapted, train_images, DRConfig())    # Algorithms 1-3
    result.apply(adapted)
    with freeze_zeros(adapted, result.masks):                # fine-tune with the sparsity mask
        train(adapted, ...)
    report = certify(adapted, x, y, eps_grid, attack_steps=100)

Kept apart from attncert.models so the pipeline's ViT stays small and readable.
"""

from .adapt import (
    NORMS,
    POOLS,
    Adaptation,
    MeanPooledViT,
    ProjectNorm,
    adapt,
    calibrate_radii,
    load_adapted,
    norm_lipschitz,
    replace_norm,
    save_adapted,
)
from .baseline import PixelLinear, certify_linear
from .certificate import (
    GlobalBound,
    certified_radius,
    certify,
    certify_pairwise,
    empirical_lipschitz,
    global_bound,
    lipschitz_table,
)
from .douglas_rachford import (
    DRConfig,
    DRResult,
    MaskHandle,
    constrain,
    douglas_rachford,
    freeze_zeros,
    haugazeau,
    linear_sites,
    project_outputs,
    record_inputs,
    soft_threshold,
)
from .load import (
    CheckpointUnavailable,
    hf_normalization,
    hub_revision,
    load_model,
    tiny_hf_vit,
    vit_from_hf,
)

__all__ = [
    "NORMS",
    "POOLS",
    "Adaptation",
    "MeanPooledViT",
    "CheckpointUnavailable",
    "DRConfig",
    "DRResult",
    "GlobalBound",
    "MaskHandle",
    "PixelLinear",
    "ProjectNorm",
    "adapt",
    "calibrate_radii",
    "certified_radius",
    "certify",
    "certify_linear",
    "certify_pairwise",
    "constrain",
    "douglas_rachford",
    "empirical_lipschitz",
    "freeze_zeros",
    "global_bound",
    "haugazeau",
    "hf_normalization",
    "linear_sites",
    "lipschitz_table",
    "load_adapted",
    "hub_revision",
    "load_model",
    "norm_lipschitz",
    "project_outputs",
    "record_inputs",
    "replace_norm",
    "save_adapted",
    "soft_threshold",
    "tiny_hf_vit",
    "vit_from_hf",
]
