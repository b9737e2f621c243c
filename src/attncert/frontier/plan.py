"""The frontier's plan: per unit (``frontier_unit@<dataset>-<setting>``) the setting's model
trained on the first ``max_train`` training images less the held-out ones, certified (a ViT:
LoFAST(M) and the global bound on ``n_val`` held-out images), audited by PGD and, for a ViT,
diagnosed; the linear baseline (a linear map on pixels, its radius exact) trains and is
audited."""

from __future__ import annotations

from attncert.frontier.settings import CERTIFICATE, GLOBAL, parse_setting
from attncert.frontier.study import model_config, train_config
from attncert.pipeline.datasets import TABLE, stand_in
from attncert.pipeline.jobs import Audit, Certify, Diagnostics, Job, Model, Train, capped
from attncert.pipeline.params import StudyParams

#: the bounds every certified setting is certified by (the stage's local and global radii)
VARIANTS = (CERTIFICATE[0], GLOBAL[0])


def jobs(p: StudyParams) -> list[Job]:
    """One job per dataset x setting, in ``units`` order."""
    f, s = p["frontier"], p["train_vit"]
    out = []
    for ds in f.datasets:
        n_tr = capped(f.max_train, capped(p["data"].max_train, TABLE[ds].splits["train"])
                      - f.holdout)
        for setting_name in f.settings:
            setting = parse_setting(setting_name)
            name = f"{ds}-{setting_name}"
            tc = train_config(f, s, setting, 0)
            if setting.kind == "linear":
                d = TABLE[ds]
                model = Model("linear", (d.channels, d.size, d.classes))
            else:
                model = Model("vit", model_config(f, s, setting, ds, stand_in(ds)),
                              msvp=tuple(tc.msvp_lambda), margin=tc.margin,
                              family="standard" if setting.kind == "standard" else "lipschitz")
            adv = tc.adv_steps if tc.adversarial != "none" else 0
            phases = [Train(name, n_tr, f.holdout, tc.epochs, tc.batch_size,
                            tc.eval_batch_size, adv)]  # validated on the held-out images
            if setting.is_vit:
                phases.append(Certify(name, f.n_val, VARIANTS, 1, f.cert_batch_size))
            phases.append(Audit(f"{name}: PGD audit", f.audit.count(f.n_val), len(f.cert_eps),
                                f.audit.steps, f.audit.restarts,
                                f.audit.batch(f.cert_batch_size)))
            if model.kind == "vit":
                phases.append(Diagnostics(f.n_val, f.cert_batch_size))
            out.append(Job("frontier", f"frontier_unit@{name}", name, model, tuple(phases)))
    return out
