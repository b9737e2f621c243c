"""The crown study's plan: per unit (``crown_unit@<dataset>-<depth>``) one Lipschitz ViT of
that depth trained on the first ``max_train`` training images, certified by LoFAST on
``n_test`` test images, audited by PGD, bounded by each CROWN method at every eps, and its
attention diagnosed on the whole test split."""

from __future__ import annotations

from attncert import diagnostics
from attncert.crown.study import vit_config
from attncert.pipeline.datasets import stand_in
from attncert.pipeline.jobs import (
    Audit,
    Certify,
    CrownBounds,
    Diagnostics,
    Job,
    Model,
    Train,
    capped,
    image_sizes,
)
from attncert.pipeline.params import StudyParams


def jobs(p: StudyParams) -> list[Job]:
    """One job per dataset x depth, in ``units`` order."""
    c = p["crown"]
    t = c.train
    out = []
    for ds in c.datasets:
        n_tr, n_te = image_sizes(p["data"], ds)
        n_tr, n = capped(c.max_train, n_tr), min(c.n_test, n_te)
        for depth in c.depths:
            name = f"{ds} L{depth}"
            model = Model("vit", vit_config(stand_in(ds), c, depth), margin=t.margin,
                          family="lipschitz")
            out.append(Job("crown", f"crown_unit@{ds}-{depth}", name, model, (
                Train(name, n_tr, n_te, t.epochs, t.batch_size, t.eval_batch_size),
                Certify(f"{name} LoFAST", n, (c.lofast_variant,), 1, 100),
                Audit(f"{name}: PGD audit", c.audit.count(n), len(c.cert_eps), c.audit.steps,
                      c.audit.restarts, c.audit.batch_size),
                CrownBounds(f"{name}: CROWN bounds (at most)", depth, tuple(c.methods), n,
                            len(c.cert_eps), c.time_limit, c.time_budget, c.batch_size),
                Diagnostics(n_te, diagnostics.BATCH))))  # on the whole test split
    return out
