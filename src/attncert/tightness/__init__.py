"""Tightness study of LoFAST (its Table 3, Figures 1, 3 and 4) as pure data functions.

Every function returns a long pandas DataFrame (one row per measurement); the figures are
drawn from them by attncert.figures.tightness. Bounds use certificate-grade spectral norms;
"PGD" is a lower bound on the true sensitivity (attncert.bounds.pgd_sensitivity), so a ratio
bound / PGD >= 1 always, and close to 1 means tight.

Until a trained Lipschitz ViT checkpoint exists the study runs on :func:`random_attention_layer`,
a seeded random residual layer whose W^Q, W^K, W^V, W^O have prescribed spectral norms (the
paper's layer is the first residual attention layer of a trained 8-head ViT whose weights are
norm-constrained, with LayerProject(R = 1) inputs).
"""

from attncert.tightness.layer import layer_project, random_attention_layer, study_layer
from attncert.tightness.studies import (
    PAPER_TABLE3,
    figure1_multi_head,
    figure1_single_head,
    figure3_weight_perturbation,
    figure4_input_norm,
    paper_table3_frame,
    summary_metrics,
    table3,
)

__all__ = [
    "PAPER_TABLE3",
    "paper_table3_frame",
    "layer_project",
    "random_attention_layer",
    "table3",
    "figure1_single_head",
    "figure1_multi_head",
    "figure3_weight_perturbation",
    "figure4_input_norm",
    "study_layer",
    "summary_metrics",
]
