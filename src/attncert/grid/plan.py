"""The ViT grid's plan (``train_vit`` and ``certify_vit``): per grid point, its Lipschitz ViT
trained on the dataset's training split, then certified by every variant on ``n_test`` test
images, audited by PGD and diagnosed (attention against uniform and identity)."""

from __future__ import annotations

from attncert.grid.params import model_config
from attncert.pipeline.datasets import stand_in
from attncert.pipeline.jobs import (
    Audit,
    Certify,
    Diagnostics,
    Job,
    Model,
    Train,
    capped,
    image_sizes,
)
from attncert.pipeline.params import StudyParams
from attncert.pipeline.runs import GridPoint


def points(p: StudyParams) -> list[GridPoint]:
    """The grid's points in dvc.yaml's order (dataset, depth, heads, gamma_vo)."""
    g = p["vit_grid"]
    return [GridPoint(g.results_dir, d, depth, h, vo) for d in g.dataset for depth in g.depth
            for h in g.heads for vo in g.gamma_vo]


def jobs(p: StudyParams) -> list[Job]:
    """Two jobs per grid point (unit ``grid <point>``): ``train_vit``'s training and
    ``certify_vit``'s certificates, audit and diagnostics, on the same model."""
    s, cv = p["train_vit"], p["certify_vit"]
    t = s.train
    out = []
    for point in points(p):
        n_tr, n_te = image_sizes(p["data"], point.dataset)
        name, unit = point.name, f"grid {point.name}"
        model = Model("vit", model_config(s, point, stand_in(point.dataset)),
                      msvp=tuple(t.msvp_lambda), margin=t.margin,
                      family="standard" if s.kind == "standard" else "lipschitz")
        adv = t.adv_steps if t.adversarial != "none" else 0
        out.append(Job("train_vit", unit, name, model, (
            Train(name, n_tr, n_te, t.epochs, t.batch_size, t.eval_batch_size, adv),)))
        n = capped(cv.n_test, n_te)
        out.append(Job("certify_vit", unit, name, model, (
            Certify(name, n, tuple(cv.variants), len(cv.tests), cv.cert_batch_size),
            Audit(f"{name}: PGD audit", cv.audit.count(n), len(cv.cert_eps), cv.audit.steps,
                  cv.audit.restarts, cv.audit.batch(cv.cert_batch_size)),
            Diagnostics(n, cv.cert_batch_size))))
    return out
