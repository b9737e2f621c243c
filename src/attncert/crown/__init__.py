"""CROWN / alpha-CROWN (auto_LiRPA 0.3) on the Lipschitz ViT, and its combination with LoFAST.

Importing the package applies the compatibility patches of :mod:`attncert.crown.patches`
(idempotent). :mod:`attncert.crown.graph` writes the ViT as a graph auto_LiRPA bounds,
:mod:`attncert.crown.bridge` bounds it and certifies points in batches or one at a time;
:mod:`attncert.crown.study` trains the crown stage's ViTs (:mod:`attncert.stages.crown`) and
gives its rows, :mod:`attncert.crown.tables` assembles LoFAST's Tables 1-2 from them.
"""

from attncert.crown.patches import apply as apply_patches

PATCHES = apply_patches()

from attncert.crown.bridge import (  # noqa: E402
    METHODS,
    CrownCertifier,
    CrownViT,
    certify_batch,
    certify_points,
    margin_spec,
)

__all__ = ["METHODS", "PATCHES", "CrownCertifier", "CrownViT", "apply_patches",
           "certify_batch", "certify_points", "margin_spec"]
