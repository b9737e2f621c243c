"""The reproduced papers' numbers drawn beside ours in the reports, each with its source.

Transcribed from the papers' full texts (tables flattened by the text extraction: a value the
extraction lost is absent, never guessed). :data:`SOURCES` states, for every constant, the
table, the column, the row and the setting it was measured in; ``fidelity.yaml`` says which of
our runs reproduces that setting. They are claims to compare against, never inputs of a
computation, and each is drawn only beside a model of its own setting.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple


class Source(NamedTuple):
    """Where a paper number is printed and what it measures."""

    paper: str
    table: str
    column: str
    row: str
    setting: str


# -- CertViT (Gupta and Verma) -----------------------------------------------------------------

#: The per-channel standard deviations CertViT's code normalises with, before the model (the
#: paper states none): its eps is a radius on the NORMALISED input. A normalised radius eps
#: covers the pixel-space radius eps * min(std) (a pixel perturbation of norm r moves the
#: normalised input by at most r / min(std)): :func:`certvit_pixel_eps`.
CERTVIT_NORM_STD = {"mnist": (0.3081,), "cifar10": (0.2023, 0.1994, 0.2010),
                    "cifar100": (0.2675, 0.2565, 0.2761), "tinyimagenet": (0.5, 0.5, 0.5),
                    "imagenet": (0.229, 0.224, 0.225)}

#: CertViT Table 1, the "CertViT (Ours)" row of the ViT block of each dataset: accuracies in %,
#: eps on the normalised input (App. C.2, Tables 7-8: 1.58 on MNIST, 0.141 on the others; the
#: Table 1 header lost the symbol), "lipschitz" the certified Lipschitz bound.
CERTVIT_TABLE1 = {
    "mnist": {"clean": 97.8, "pgd": 64.2, "certified": 54.5, "eps": 1.58, "lipschitz": 1.2},
    "cifar10": {"clean": 75.1, "pgd": 42.7, "certified": 33.1, "eps": 0.141, "lipschitz": 9.1},
    "cifar100": {"clean": 46.2, "pgd": 21.6, "certified": 9.1, "eps": 0.141, "lipschitz": 12.1},
    "tinyimagenet": {"clean": 36.3, "pgd": 13.1, "certified": 2.3, "eps": 0.141,
                     "lipschitz": 13.2},
}
#: CertViT Table 1, "Standard (n)": the parameter count of each dataset's ViT trained from
#: scratch. It fixes what Table 4 leaves open (the MLP ratio: 4) and reads as an L2-attention
#: ViT with W^Q = W^K and no biases in its linear layers (tests/test_certvit_shapes.py).
CERTVIT_TABLE1_PARAMS = {"mnist": 1_094_528, "cifar10": 4_086_912, "cifar100": 4_916_736}
CERTVIT_MNIST = CERTVIT_TABLE1["mnist"]
CERTVIT_CIFAR10 = CERTVIT_TABLE1["cifar10"]

#: CertViT Table 3, ImageNet-pretrained models constrained on ImageNet (PGD on 1000 validation
#: images, one per class, sec. 4.2): the CertViT columns (clean, PGD, certified in %, the
#: Lipschitz bound). Only ViT-T/16 and DeiT-T certify anything; ViT-B/16 certifies nothing.
CERTVIT_TABLE3 = {
    "ViT-T/16": {"clean": 57.9, "pgd": 32.4, "certified": 21.7, "lipschitz": 10.9},
    "DeiT-T": {"clean": 67.2, "pgd": 31.6, "certified": 17.3, "lipschitz": 13.6},
    "ViT-B/16": {"clean": 73.2, "pgd": 59.3, "certified": 0.0, "lipschitz": 1720.4},
}
#: The field's standard MNIST radius, l2 in pixel space [0, 1], and the published certified
#: accuracy at it that the ViTs here are read against (an anchor of unlike models and training,
#: never a target): GloRo's convolutional network (Leino et al., ICML 2021), 62.8%; CertViT
#: Table 1's L2-attention ViT, 54.5%, is named beside it in the source (the paper does not state
#: its input space; its code normalises first, where 1.58 covers only 0.4867 in pixels).
MNIST_EPS = 1.58
MNIST_ANCHOR = 0.628
MNIST_ANCHOR_SOURCE = (
    "anchor, not like for like: GloRo (Leino et al. 2021), a convolutional network, MNIST eps "
    f"1.58 in pixel space; CertViT Table 1's L2-attention ViT reports "
    f"{CERTVIT_TABLE1['mnist']['certified']:g}% at eps 1.58 (input space not stated; its code "
    "normalises first, where 1.58 covers 0.4867 in pixels)")


def mnist_anchor(dataset: str | None, eps: str | float) -> tuple[float | None, str | None]:
    """(paper fraction, source) of :data:`MNIST_ANCHOR` beside an MNIST certified accuracy at
    eps 1.58, (None, None) for anything else."""
    if dataset == "mnist" and abs(float(eps) - MNIST_EPS) < 1e-9:
        return MNIST_ANCHOR, MNIST_ANCHOR_SOURCE
    return None, None


#: what differs between CertViT Table 1's ViT rows and ours, named in every label that sets
#: them side by side
CERTVIT_TABLE1_DIFFERS = (
    "its ViT trains L2 attention from scratch, ours a dot-product ViT adapted to it; its Lip. "
    "takes GELU as 1.12, leaves out the LayerNorms and the patch embedding and is of its "
    "normalised input to the logits, ours bounds every component from pixels (1/min std "
    "included) to a logit difference (x max ||w_j - w_k||); its PGD on its test set, ours on "
    "the first certvit.audit.n test images")
#: what differs between CertViT Table 3's rows and ours: its models are adapted to L2 attention
#: on ImageNet (Table 10: 50-70 epochs) before CertViT and fine-tuned after; ours adapt by
#: surgery on the calibration images and are not fine-tuned (no ImageNet training images)
CERTVIT_TABLE3_DIFFERS = (
    "its models adapted to L2 attention for 50 ImageNet epochs and fine-tuned, ours adapted by "
    "surgery and not fine-tuned; its eps lost in extraction; ours counts every component")

def certvit_pixel_eps(dataset: str) -> float | None:
    """CertViT Table 1's eps for ``dataset`` converted from its normalised input to our pixel
    space (eps * min std, 4 decimals, rounded down: the radius its claim covers), or None."""
    ref, std = CERTVIT_TABLE1.get(dataset), CERTVIT_NORM_STD.get(dataset)
    if ref is None or std is None:
        return None
    return int(ref["eps"] * min(std) * 1e4) / 1e4


def certvit_table1(dataset: str | None) -> tuple[dict, str] | None:
    """CertViT's Table 1 ViT row for ``dataset`` and its label (with both eps), else None."""
    ref = CERTVIT_TABLE1.get(dataset or "")
    if ref is None:
        return None
    return ref, (f"CertViT Table 1 ({dataset}, its ViT; eps {ref['eps']:g} normalised = "
                 f"{certvit_pixel_eps(dataset):g} pixel l2; {CERTVIT_TABLE1_DIFFERS})")



# -- SpecFormer --------------------------------------------------------------------------------

#: SpecFormer Tables 1 (standard training: Standard / FGSM / PGD-2 at 2/255) and 2 (adversarial
#: training: Standard / CW-20 / PGD-20 at 8/255; l_inf in its code, the norm is not stated), in
#: %: the "ViT" and "SpecFormer" rows of the ViT-S and DeiT-Ti blocks (ImageNet-1k pre-trained,
#: fine-tuned on each dataset), as {training: {backbone: {dataset: {method: values}}}} in the
#: column order of :data:`SPECFORMER_ATTACKS` (our attack labels). Its MSVP lambda for Table 1
#: is (5e-5, 3e-5, 3e-5) (the Table 5 row with the ViT-S CIFAR-10 numbers); Table 2's is not
#: stated (its ViT-S CIFAR-10 row matches no Table 5 row).
SPECFORMER_ATTACKS = {"standard": ("clean", "FGSM 2/255", "PGD-2 2/255"),
                      "adversarial": ("clean", "CW-20 8/255", "PGD-20 8/255")}
SPECFORMER_TABLES = {
    "standard": {
        "ViT-S": {"cifar10": {"vanilla": (87.09, 45.56, 22.35),
                              "specformer": (88.52, 50.58, 29.53)},
                  "cifar100": {"vanilla": (63.52, 19.82, 7.01),
                               "specformer": (69.78, 23.92, 9.67)},
                  "imagenette": {"vanilla": (94.20, 72.60, 48.00),
                                 "specformer": (97.20, 84.20, 61.60)}},
        "DeiT-Ti": {"cifar10": {"vanilla": (86.40, 46.10, 14.46),
                                "specformer": (87.42, 45.71, 18.10)},
                    "cifar100": {"vanilla": (62.79, 19.89, 2.35),
                                 "specformer": (64.14, 20.93, 1.61)},
                    "imagenette": {"vanilla": (90.00, 64.20, 13.00),
                                   "specformer": (92.20, 70.20, 26.20)}},
    },
    "adversarial": {
        "ViT-S": {"cifar10": {"vanilla": (71.76, 34.34, 35.49),
                              "specformer": (72.73, 31.84, 31.90)},
                  "cifar100": {"vanilla": (36.45, 11.97, 12.89),
                               "specformer": (41.46, 12.80, 13.54)},
                  "imagenette": {"vanilla": (89.60, 62.80, 62.40),
                                 "specformer": (91.60, 67.00, 67.00)}},
        "DeiT-Ti": {"cifar10": {"vanilla": (71.71, 37.15, 38.74),
                                "specformer": (80.03, 48.52, 51.10)},
                    "cifar100": {"vanilla": (40.89, 15.25, 17.40),
                                 "specformer": (44.48, 16.36, 18.21)},
                    "imagenette": {"vanilla": (79.00, 40.60, 41.40),
                                   "specformer": (82.20, 46.20, 46.00)}},
    },
}
#: The hub checkpoints standing for SpecFormer's backbones (by the last part of their id), and
#: how each departs from App. F.2's shape.
SPECFORMER_STAND_INS = {
    "vit-small-patch16-224": ("ViT-S", "its ViT-S is 8 blocks x 768 wide, this one 12 x 384"),
    "deit-tiny-patch16-224": ("DeiT-Ti", "App. F.2's shape"),
}
#: Imagenette: the paper's 0.2-point steps fit the original release's 500 validation images;
#: torchvision's (and ours) is Imagenette 2's 3925.
SPECFORMER_IMAGENETTE_CAVEAT = "its Imagenette release had 500 validation images, ours 3925"


def specformer_reference(run_label: str, training: str, method: str, attack: str
                         ) -> tuple[float, str] | None:
    """SpecFormer Table 1 or 2's accuracy (%) for one of our runs (``<dataset>@<checkpoint>``,
    :func:`attncert.specformer.methods.run_label`) and its label (table, backbone, dataset,
    caveats); None where the run stands for no printed cell (another checkpoint, method or
    attack)."""
    dataset, _, checkpoint = run_label.partition("@")
    backbone, caveat = SPECFORMER_STAND_INS.get(checkpoint, (None, ""))
    values = SPECFORMER_TABLES.get(training, {}).get(backbone, {}).get(dataset, {}).get(method)
    if values is None or attack not in SPECFORMER_ATTACKS[training]:
        return None
    caveats = [caveat] + ([SPECFORMER_IMAGENETTE_CAVEAT] if dataset == "imagenette" else [])
    table = 1 if training == "standard" else 2
    return (values[SPECFORMER_ATTACKS[training].index(attack)],
            f"SpecFormer Table {table} ({backbone}, {dataset}; {'; '.join(caveats)})")


def specformer_rows(run_labels: Sequence[str]) -> list[dict[str, Any]]:
    """Every printed Table 1-2 cell that one of ``run_labels`` stands for: rows (dataset =
    the run label, training, method, attack, accuracy %)."""
    rows = []
    for label in run_labels:
        for training, attacks in SPECFORMER_ATTACKS.items():
            for method in ("vanilla", "specformer"):
                for attack in attacks:
                    ref = specformer_reference(label, training, method, attack)
                    if ref is not None:
                        rows.append({"dataset": label, "training": training, "method": method,
                                     "attack": attack, "accuracy": ref[0]})
    return rows


#: SpecFormer Table 3: running time of 10 training steps relative to the vanilla ViT, with
#: MSVP, in standard and adversarial training; and the baselines'.
SPECFORMER_STEP_RATIO = 1.5
SPECFORMER_STEP_RATIO_ADV = 2.5
SPECFORMER_TABLE3 = {
    "standard": {"lipsformer": 5.5, "l2former": 2.5, "lnformer": 4.5, "specformer": 1.5},
    "adversarial": {"lipsformer": 12.3, "l2former": 4.3, "lnformer": 11.7, "specformer": 2.5},
}


#: SpecFormer Table 5: CIFAR-10 (ViT-S, by its row equal to Table 1's), the specformer method at
#: each (lam_q, lam_k, lam_v) (keys as ``",".join(f"{v:g}")`` of the triple): standard training
#: (clean, PGD-2, FGSM at 2/255) and adversarial training (clean, CW-20, PGD-20 at 8/255), in %.
SPECFORMER_TABLE5 = {
    "0.0001,0,0": dict(clean=87.36, pgd2=35.32, fgsm=53.91, at_clean=72.54, cw20=31.47,
                       pgd20=31.59),
    "0,0.0001,0": dict(clean=88.58, pgd2=29.02, fgsm=49.81, at_clean=72.56, cw20=31.37,
                       pgd20=31.19),
    "0,0,0.0001": dict(clean=87.66, pgd2=36.19, fgsm=52.40, at_clean=72.51, cw20=31.41,
                       pgd20=31.65),
    "0.0005,7e-05,0.0002": dict(clean=88.32, pgd2=31.42, fgsm=48.82, at_clean=72.53,
                                cw20=31.59, pgd20=31.92),
    "0.0001,0.0001,0.0001": dict(clean=88.14, pgd2=36.07, fgsm=53.71, at_clean=72.46,
                                 cw20=31.94, pgd20=32.23),
    "0.0002,5e-05,7e-05": dict(clean=88.61, pgd2=30.01, fgsm=48.31, at_clean=72.42, cw20=31.56,
                               pgd20=31.82),
    "0.001,9e-05,0.0003": dict(clean=88.15, pgd2=31.75, fgsm=50.46, at_clean=72.43, cw20=31.91,
                               pgd20=32.23),
    "0.001,0.001,0.001": dict(clean=88.07, pgd2=32.59, fgsm=47.85, at_clean=71.70, cw20=31.31,
                              pgd20=31.79),
    "0.0005,0.0003,0.0003": dict(clean=88.81, pgd2=31.28, fgsm=48.32, at_clean=72.19,
                                 cw20=31.69, pgd20=31.89),
    "5e-05,3e-05,3e-05": dict(clean=88.52, pgd2=29.53, fgsm=50.58, at_clean=72.55, cw20=31.68,
                              pgd20=31.72),
    "0.002,0.0003,0.0004": dict(clean=88.29, pgd2=33.25, fgsm=48.25, at_clean=71.75,
                                cw20=31.75, pgd20=32.29),
    "0.004,0.0008,0.001": dict(clean=88.29, pgd2=33.94, fgsm=46.72, at_clean=71.37, cw20=31.84,
                               pgd20=32.19),
}

# -- LoFAST ------------------------------------------------------------------------------------

#: LoFAST Table 1: CIFAR-10, 128-d Lipschitz ViTs of 3-5 layers, 1000 test points; certified
#: accuracy in % at l2 eps, and seconds per sample, for LoFAST and alpha,beta-CROWN (run
#: through auto_LiRPA, sec. 5.2; None where the paper prints "-": overflow failures). Its
#: test is Proposition 1's (margin > sqrt(2) delta); which form of Theorem 1 (eq. 27 or 28) it
#: evaluates is not stated.
LOFAST_TABLE1 = {
    "eps": (0.02, 0.05, 0.1),
    "lofast": {3: (29.1, 16.0, 3.0), 4: (28.9, 11.9, 0.8), 5: (27.6, 8.3, 0.0)},
    "lofast_seconds": {3: 0.055, 4: 0.077, 5: 0.094},
    "crown": {3: (41.2, 14.1, None), 4: (42.9, None, None), 5: (44.7, None, None)},
    "crown_seconds": {3: 6.7, 4: 13.3, 5: 20.4},
}
#: LoFAST Table 2 (3-layer ViT): certified accuracy (%) and seconds per sample at eps 0.02 /
#: 0.05, alpha,beta-CROWN alone vs LoFAST first with it on the rest. Its CROWN-alone numbers
#: (41.99 / 14.35) differ from Table 1's 3-layer ones (41.2 / 14.1): not the same model.
LOFAST_TABLE2 = {
    "cifar10": {"CROWN": ((41.99, 4.33), (14.35, 6.06)),
                "CROWN+LoFAST": ((41.99, 1.71), (20.03, 4.17))},
    "svhn": {"CROWN": ((43.73, 5.68), (27.45, 8.60)),
             "CROWN+LoFAST": ((43.73, 1.44), (29.51, 3.64))},
}
#: The eps of LoFAST Tables 1 (all three) and 2 (the first two).
LOFAST_TABLE_EPS = (0.02, 0.05, 0.1)

# -- OLSA --------------------------------------------------------------------------------------

#: OLSA's abstract and sec. 5.2: average l2 certified radius over the test split (word-embedding
#: space) of the 3-layer OLSA trained from scratch on SST and Yelp, and of Shi et al.'s bound
#: propagation (which perturbs one or two word positions on a 5% test sample: not like for like).
OLSA_AVG_RADIUS = {"sst": 0.979, "yelp": 1.733}
OLSA_SHI_AVG_RADIUS = {"sst": 0.110, "yelp": 0.061}
#: The softmax Lipschitz constant behind OLSA's radii (its Theorem 4.1, appendix A step 3):
#: 1/4, unsound (the constant is 1/2, docs/math.md section 4); our radii use 1/2.
OLSA_SOFTMAX_LIPSCHITZ = 0.25
#: OLSA's abstract and Table 3: the 1-layer OLSA head over a frozen pre-trained 12-layer BERT
#: on QQP (GLUE's 40,430 dev pairs), radius in BERT's normalised output space, vs Shi et al.
OLSA_FROZEN_BERT_QQP = {"olsa": 0.368, "shi": 0.071}

#: LoFAST Table 3: the bound on ||F(X') - F(X)||_F of one residual 8-head attention layer at
#: each eps (mean over its test inputs), with the PGD lower bound. Its "LoFAST" row is sec.
#: 5.1's practical multi-head bound, which uses delta_{2,1}^{(2)}: the xi form (eq. 28), our
#: ``lofast_xi``; values as printed (SpecFormer's to three decimals).
LOFAST_TABLE3 = {
    "eps": (0.01, 0.03, 0.05, 0.07, 0.09, 0.10),
    "PGD": (0.0286, 0.0860, 0.1427, 0.2008, 0.2582, 0.2860),
    "LoFAST": (0.0291, 0.0875, 0.1462, 0.2052, 0.2646, 0.2943),
    "SpecFormer": (16.901, 52.515, 90.600, 131.219, 174.436, 197.036),
}

#: Every constant above: where it is printed and what it measures.
SOURCES = {
    "CERTVIT_TABLE1": Source("CertViT", "Table 1 (eps: App. C.2, Tables 7-8)",
                             "Clean / PGD / Cert. (%), Lip.", "CertViT (Ours), ViT block",
                             "its small ViTs trained from scratch (Table 4: MNIST 6 layers "
                             "patch 7 d 128; CIFAR patch 4 d 192, 6 / 12 layers), constrained; "
                             "eps on the normalised input"),
    "CERTVIT_TABLE1_PARAMS": Source("CertViT", "Table 1", "Method (Params)",
                                    "Standard (n), model ViT, per dataset",
                                    "the standard ViT trained from scratch (Table 4's shape)"),
    "CERTVIT_TABLE3": Source("CertViT", "Table 3", "CertViT: Clean / PGD / Cert. (%), Lip.",
                             "ViT-T/16, DeiT-T, ViT-B/16",
                             "ImageNet-pretrained, constrained on ImageNet; 1000 validation "
                             "images, one per class; eps lost in extraction"),
    "SPECFORMER_TABLES": Source("SpecFormer", "Tables 1-2", "CIFAR-10 / CIFAR-100 / Imagenette: "
                                "Standard / FGSM / PGD-2 (Table 1), Standard / CW-20 / PGD-20 "
                                "(Table 2)", "ViT-S and DeiT-Ti blocks: ViT, SpecFormer",
                                "ImageNet-pretrained ViT-S (App. F.2: 8 blocks, 8 heads, "
                                "width 768) and DeiT-Ti fine-tuned on each dataset, standard "
                                "(attacks at 2/255) and adversarial (8/255) training"),
    "SPECFORMER_TABLE5": Source("SpecFormer", "Table 5", "standard: Standard / PGD-2 / FGSM; "
                                "adversarial: Standard / CW-20 / PGD-20 (%)",
                                "one row per (lam_q, lam_k, lam_v)",
                                "CIFAR-10, model not stated (ViT-S: its (5e-5, 3e-5, 3e-5) row "
                                "equals Table 1's)"),
    "SPECFORMER_TABLE3": Source("SpecFormer", "Table 3", "relative time of 10 training steps",
                                "Std. training, Adv. training",
                                "model not stated; vanilla = 1"),
    "LOFAST_TABLE1": Source("LoFAST", "Table 1", "certified accuracy (%) at eps; sec/sample",
                            "ViT 3/4/5-Layer: LoFAST, alpha,beta-CROWN",
                            "128-d Lipschitz ViTs on CIFAR-10, 1000 test points, pixel l2"),
    "LOFAST_TABLE3": Source("LoFAST", "Table 3", "upper bound on ||F(X')-F(X)||_F at eps",
                            "PGD Lower-bound, LoFAST Upper-bound (sec. 5.1: the xi form), "
                            "SpecFormer Upper-bound",
                            "one residual 8-head attention layer of its trained ViT; inputs "
                            "and their number not stated"),
    "LOFAST_TABLE2": Source("LoFAST", "Table 2", "certified accuracy (%) and sec/sample at "
                            "eps 0.02 / 0.05", "CROWN, CROWN+LoFAST",
                            "3-layer Lipschitz ViTs on CIFAR-10 and SVHN"),
    "OLSA_AVG_RADIUS": Source("OLSA", "abstract; sec. 5.2 (Table 1's values were not "
                              "extracted)", "average certified radius",
                              "3-layer OLSA, Shi et al.",
                              "trained from scratch on SST / Yelp, test split, word-embedding "
                              "l2, softmax constant 1/4"),
    "MNIST_ANCHOR": Source("GloRo (Leino et al., ICML 2021)", "its MNIST result",
                           "certified accuracy (%) at eps 1.58", "GloRo's convolutional network",
                           "MNIST, l2 eps 1.58 in pixel space; another model and training than "
                           "ours (CertViT Table 1's ViT, 54.5%, named in the source)"),
    "OLSA_FROZEN_BERT_QQP": Source("OLSA", "abstract (the introduction swaps the two)",
                                   "average certified radius", "1-layer OLSA head, Shi et al.",
                                   "over a frozen 12-layer BERT on QQP (dev), BERT's output "
                                   "space"),
}
