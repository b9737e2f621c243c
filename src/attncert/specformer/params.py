"""The specformer section's schema (params.yaml ``specformer``): :class:`Params`, its two
recipes (``train`` from scratch, ``finetune`` of the pre-trained sources: each a
:class:`attncert.training.recipe.AdversarialRecipe`) and the certified pair
(:class:`CertifiedParams`). The stage (:mod:`attncert.stages.specformer`) and the study
(:mod:`attncert.specformer.study`) read it; it imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

from attncert.pipeline.audit import Audit
from attncert.pipeline.params import (
    IMAGE_DATASETS,
    VIT_BLOCKS,
    fail,
    nonempty,
    nonneg,
    one_of,
    param,
    positive,
    unique,
)
from attncert.pipeline.shapes import VitShape
from attncert.specformer import methods as sf
from attncert.training.recipe import AdversarialRecipe, Training

__all__ = ["CERT_VARIANTS", "CertifiedParams", "Params"]


#: the certified pair's certificates (pairwise test)
CERT_VARIANTS = ("lofast_M", "specformer")


@dataclass(frozen=True)
class CertifiedParams:
    """params.yaml ``specformer.certified``: the certified pair, LoFAST section 5.2's Lipschitz
    ViT (LayerProject, constrained attention, SLL MLPs, x - mean inside) trained with the LMT
    margin without and with MSVP, certified with :data:`CERT_VARIANTS` and attacked (the
    soundness audit, ``audit``: batch_size 0 is ``specformer.attack_batch_size``) on the first
    ``n_test`` test images; ``train``: its whole recipe (the member with MSVP at
    ``msvp_lambda``)."""

    vit: VitShape = param(doc="the name of a shape of the vit section (mlp_hidden: the SLL "
                              "hidden width)")
    gamma_qk: float = param(positive, doc="spectral norm of every W^Q_l, W^K_l")
    gamma_vo: float = param(positive, doc="spectral norm of every W^V_l, W^O_l")
    radius_attn: float = param(positive, doc="LayerProject radius of every attention input")
    train: Training = param(doc="the pair's recipe (the LMT margin, no MSVP: the member with "
                                "MSVP replaces its msvp_lambda)")
    msvp_lambda: list[float] = param(nonneg, doc="(lam_q, lam_k, lam_v) of the MSVP member")
    n_test: int = param(positive, doc="first n test images certified and attacked")
    cert_eps: list[float] = param(positive, unique, doc="certified l2 radii (pixel space)")
    audit: Audit = param(doc="the PGD soundness audit (attncert.pipeline.audit.Audit)")

    def __post_init__(self) -> None:
        if len(self.msvp_lambda) != 3:
            raise ValueError(f"msvp_lambda needs 3 values, got {self.msvp_lambda!r}")
        self.vit.require("specformer.certified.vit", "depth", "heads")
        self.train.require("specformer.certified.train", "none", "lmt", "olsa", "lofast")
        if any(self.train.msvp_lambda) or self.train.adversarial != "none":
            fail("specformer.certified.train", "the pair trains without MSVP and without "
                                               "PGD (msvp_lambda 0, adversarial none); the "
                                               "MSVP member's penalty is certified.msvp_lambda")


@dataclass(frozen=True)
class Params:
    """params.yaml ``specformer``: SpecFormer and the Lipschitz-attention baselines, attacked
    and compared. l_inf radii are in units of 1/255 (pixel space), l2 radii in pixels."""

    datasets: list[str] = param(one_of(*IMAGE_DATASETS), unique)
    sources: list[str] = param(nonempty, unique,
                               doc="'scratch' (a ViT of the shape vit, trained here) or "
                                   "a pre-trained ViTForImageClassification: HF hub id or "
                                   "save_pretrained folder, fine-tuned with the finetune recipe")
    image_size: int = param(positive, doc="input size of the pre-trained sources; images are "
                                          "upsampled to it inside the model (integer factor)")
    methods: list[str] = param(one_of(*sf.METHODS), unique, doc="standard training")
    adv_methods: list[str] = param(one_of(*sf.METHODS), unique,
                                   doc="PGD adversarial training ([] = none)")
    vit: VitShape = param(doc="source scratch: the name of a shape of the vit section")
    block: str = param(one_of(*VIT_BLOCKS))
    max_train: int = param(nonneg, doc="seeded subset of every training split (0 = all)")
    lipsformer_alpha: float = param(positive, doc="LipsFormer's residual scale x + alpha f(x)")
    msvp_lambda: list[float] = param(nonneg, doc="(lam_q, lam_k, lam_v) of the specformer method")
    msvp_lambda_ablation: list[list[float]] = param(doc="SpecFormer Table 5: more (lam_q, "
                                                    "lam_k, lam_v) of the specformer method, "
                                                    "first dataset and source, both trainings")
    train: AdversarialRecipe = param(doc="source scratch: the standard run's whole recipe "
                                         "and its PGD twin's epochs")
    finetune: AdversarialRecipe = param(doc="the pre-trained sources' fine-tune and its PGD "
                                            "twin's epochs")
    n_test: int = param(positive, doc="first n test images attacked")
    attack_batch_size: int = param(positive, doc="images attacked at once (halved on a CUDA "
                                                 "out-of-memory error)")
    std_eps_255: float = param(positive, doc="FGSM and PGD-2 radius (l_inf, x 1/255)")
    adv_eval_eps_255: float = param(positive, doc="CW and PGD radius (l_inf, x 1/255)")
    attack_steps: int = param(positive, doc="CW-n, PGD-n and L2 PGD steps")
    attack_eps: list[float] = param(positive, unique, doc="L2 PGD radii (pixels; attacked, "
                                                           "not certified)")
    timing_steps: int = param(positive)
    timing_rounds: int = param(positive)
    timing_warmup: int = param(nonneg)
    certified: CertifiedParams = param(doc="the certified pair: a Lipschitz ViT trained without"
                                                " and with MSVP, certified and attacked")
    results_dir: str = param()
    metrics: str = param()

    def __post_init__(self) -> None:
        if len(self.msvp_lambda) != 3:
            fail("specformer.msvp_lambda", f"needs 3 values, got {self.msvp_lambda!r}")
        for lam in self.msvp_lambda_ablation:
            if len(lam) != 3 or any(v < 0 for v in lam):
                fail("specformer.msvp_lambda_ablation", f"each entry needs 3 values >= 0, got "
                                                        f"{lam!r}")
        self.vit.require("specformer.vit", "depth", "heads")
        for key in ("train", "finetune"):
            recipe = getattr(self, key)
            recipe.require(f"specformer.{key}", "none")
            if recipe.adversarial != "none" or any(recipe.msvp_lambda):
                fail(f"specformer.{key}", "the standard run's recipe: adversarial none and "
                                          "msvp_lambda 0 (adv_epochs makes its PGD twin; "
                                          "specformer.msvp_lambda the specformer method's MSVP)")
        if "vanilla" not in self.methods:
            fail("specformer.methods", "needs vanilla (the reference of the step-time ratios)")
        pretrained = [s for s in self.sources if s != sf.SCRATCH]
        for key in ("methods", "adv_methods"):
            bad = [m for m in getattr(self, key) if m not in sf.PRETRAINED_METHODS]
            if pretrained and bad:
                fail(f"specformer.{key}", f"the pre-trained weights of {pretrained[0]!r} do not "
                      f"fit {', '.join(bad)} (the baselines change the ViT's attention or "
                      f"norms); with a pre-trained source use "
                      f"{', '.join(sf.PRETRAINED_METHODS)}, the baselines with "
                      f"sources: [{sf.SCRATCH}]")
