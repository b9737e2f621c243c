"""Headline numbers of the reproduced papers, drawn beside ours in the reports.

Transcribed from the papers (the list is in the guide's MATH.md section 8). They are claims to
compare against, never inputs of a computation.
"""

from __future__ import annotations

#: CertViT Table 1, ViT on MNIST: accuracies in %, eps in pixel-space l2. CertViT's code
#: measures eps on the normalised input, so its certificate is overstated (MATH.md section 5).
CERTVIT_MNIST = {"clean": 97.8, "pgd": 64.2, "certified": 54.5, "eps": 1.58, "lipschitz": 1.2}

#: SpecFormer Table 1: ViT-S on CIFAR-10, standard training, accuracies in % under l_inf
#: attacks at 2/255 (labels as :attr:`attncert.specformer.AttackSpec.label` writes them).
SPECFORMER_TABLE1 = {
    "vanilla": {"clean": 87.09, "FGSM 2/255": 45.56, "PGD-2 2/255": 22.35},
    "specformer": {"clean": 88.52, "FGSM 2/255": 50.58, "PGD-2 2/255": 29.53},
}
#: SpecFormer Table 3: a training step with MSVP costs this multiple of a vanilla step.
SPECFORMER_STEP_RATIO = 1.5
