"""Headline numbers of the reproduced papers, drawn beside ours in the reports.

Transcribed from the papers (the list is in the guide's MATH.md section 8). They are claims to
compare against, never inputs of a computation.
"""

from __future__ import annotations

#: CertViT Table 1, ViT on MNIST: accuracies in %, eps in pixel-space l2. CertViT's code
#: measures eps on the normalised input, so its certificate is overstated (MATH.md section 5).
CERTVIT_MNIST = {"clean": 97.8, "pgd": 64.2, "certified": 54.5, "eps": 1.58, "lipschitz": 1.2}
