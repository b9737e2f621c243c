"""Headline numbers of the reproduced papers, drawn beside ours in the reports.

Transcribed from summaries of the papers' tables (the list is in the guide's MATH.md section 8),
not checked against the papers' full text: only OLSA's radii are checked, against its abstract
(README "Fidelity" gives each number's source). They are claims to compare against, never inputs
of a computation.
"""

from __future__ import annotations

#: CertViT Table 1, ViT on MNIST: accuracies in %, eps in pixel-space l2. CertViT's code
#: measures eps on the normalised input, so its certificate is overstated (MATH.md section 5).
CERTVIT_MNIST = {"clean": 97.8, "pgd": 64.2, "certified": 54.5, "eps": 1.58, "lipschitz": 1.2}

#: SpecFormer Table 1: ViT-S on CIFAR-10, standard training, accuracies in % under l_inf
#: attacks at 2/255 (labels as :attr:`attncert.specformer.AttackSpec.label` writes them). The
#: paper has two arXiv versions (v1, and v2 = ECCV 2024); these numbers are checked against neither.
SPECFORMER_TABLE1 = {
    "vanilla": {"clean": 87.09, "FGSM 2/255": 45.56, "PGD-2 2/255": 22.35},
    "specformer": {"clean": 88.52, "FGSM 2/255": 50.58, "PGD-2 2/255": 29.53},
}
#: SpecFormer Table 3: a training step with MSVP costs this multiple of a vanilla step.
SPECFORMER_STEP_RATIO = 1.5

#: LoFAST Table 1: CIFAR-10, 128-d Lipschitz ViT, 1000 test points; certified accuracy in % at
#: pixel-space l2 eps, by depth, and seconds per sample (LoFAST and alpha,beta-CROWN; None
#: where the paper has no number).
LOFAST_TABLE1 = {
    "eps": (0.02, 0.05, 0.1),
    "lofast": {3: (29.1, 16.0, 3.0), 4: (28.9, 11.9, 0.8), 5: (27.6, 8.3, 0.0)},
    "lofast_seconds": {3: 0.055, 4: 0.077, 5: 0.094},
    "crown": {3: (41.2, 14.1, None), 4: (42.9, None, None), 5: (44.7, None, None)},
    "crown_seconds": {3: 6.7, 4: 13.3, 5: 20.4},
}
#: CertViT Table 1, ViT on CIFAR-10 (eps 36/255, measured on CertViT's normalised input).
CERTVIT_CIFAR10 = {"clean": 75.1, "pgd": 42.7, "certified": 33.1, "eps": 0.1412, "lipschitz": 9.1}

#: OLSA's abstract: the l2 certified radius (word-embedding space) of the 3-layer OLSA model on
#: Yelp and SST, against the best earlier certification of that space (Shi et al.'s, per a
#: summary); OLSA as a classifier over a pre-trained BERT on QQP (BERT embedding space). The
#: abstract says "radius"; that it is the average over the test split is a summary's reading.
OLSA_AVG_RADIUS = {"sst": 0.979, "yelp": 1.733}
#: The softmax Lipschitz constant behind OLSA's radii (its Theorem 4.1): 1/4, unsound (the
#: constant is 1/2, MATH.md section 4); our radii use 1/2.
OLSA_SOFTMAX_LIPSCHITZ = 0.25
OLSA_SHI_AVG_RADIUS = {"sst": 0.110, "yelp": 0.061}
OLSA_FROZEN_BERT_QQP = {"olsa": 0.368, "shi": 0.071}

#: LoFAST Table 2 (3-layer ViT): certified accuracy (%) and seconds per sample at eps 0.02 /
#: 0.05, CROWN alone vs LoFAST first with CROWN on the rest.
LOFAST_TABLE2 = {
    "cifar10": {"CROWN": ((41.99, 4.33), (14.35, 6.06)),
                "CROWN+LoFAST": ((41.99, 1.71), (20.03, 4.17))},
    "svhn": {"CROWN": ((43.73, 5.68), (27.45, 8.60)),
             "CROWN+LoFAST": ((43.73, 1.44), (29.51, 3.64))},
}
#: The eps of LoFAST Tables 1 (all three) and 2 (the first two).
LOFAST_TABLE_EPS = (0.02, 0.05, 0.1)


def certvit_table1(dataset: str | None) -> tuple[dict, str] | None:
    """CertViT's Table 1 row for ``dataset`` (MNIST or CIFAR-10) and its name, else None."""
    return {"mnist": (CERTVIT_MNIST, "CertViT Table 1 (MNIST)"),
            "cifar10": (CERTVIT_CIFAR10, "CertViT Table 1 (CIFAR-10)")}.get(dataset or "")
