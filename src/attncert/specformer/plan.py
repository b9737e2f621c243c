"""SpecFormer's plan: per dataset (``specformer_runs@<dataset>``) every method of every source
trained (standard, then adversarial for ``adv_methods``), attacked (FGSM, PGD-2, CW, PGD and
L2 PGD) and diagnosed (attention against uniform and identity), the first dataset's first
source also timed step by step (Table 3); Table 5's lambda ablation
(``specformer_table5@lambda<i>``: the specformer method of the first source and dataset at
every other lambda); the certified pair (``specformer_certified``: two Lipschitz ViTs, with
and without MSVP, certified, audited and diagnosed)."""

from __future__ import annotations

from dataclasses import replace

from attncert.models.config import hub_vit_config, hub_vit_shape
from attncert.pipeline.datasets import TABLE, stand_in
from attncert.pipeline.jobs import (
    Audit,
    Certify,
    Diagnostics,
    Job,
    Model,
    Note,
    Train,
    capped,
    image_sizes,
)
from attncert.pipeline.params import StudyParams
from attncert.specformer import methods as sf
from attncert.specformer.params import CERT_VARIANTS
from attncert.specformer.study import certified_configs, recipe

#: the certified pair's certificate batch: attncert.certify.certify_table's default
CERT_BATCH = 100


def _base(s, ds: str, src: str):
    """The standard ViT a run of ``src`` starts from on ``ds``."""
    if src == sf.SCRATCH:
        return sf.base_model_config(stand_in(ds), **s.vit.arch(), block=s.block)
    if (shape := hub_vit_shape(src)) is not None:  # fine-tuned at its own input size
        d = TABLE[ds]
        return hub_vit_config(**shape, channels=d.channels, num_classes=d.classes)
    raise ValueError(f"specformer.sources: the shape of {src!r} is unknown (neither in "
                     "attncert.models.config.HF_VITS nor a folder with a config.json)")


def _named(what: str, train: Train, attack: Audit) -> tuple[Train, Audit]:
    """A run's training and its attacks, labelled ``what``."""
    return replace(train, what=what), replace(attack, what=f"{what}: attacks")


def jobs(p: StudyParams) -> list[Job]:
    """The stage's units in order: the runs per dataset (every source), Table 5's lambdas (the
    main ``msvp_lambda``'s unit trains nothing: the main runs answer it), the certified pair."""
    s = p["specformer"]
    # FGSM (1), PGD-2, CW-n, PGD-n and L2 PGD-n per radius
    steps = 1 + 2 + 2 * s.attack_steps + s.attack_steps * len(s.attack_eps)
    runs, table5 = [], [[] for _ in s.msvp_lambda_ablation]
    for ds, src in ((ds, src) for ds in s.datasets for src in s.sources):
        n_tr, n_te = image_sizes(p["data"], ds)
        n_tr, n_eval = capped(s.max_train, n_tr), min(s.n_test, n_te)
        base, run = _base(s, ds, src), sf.run_label(ds, src)
        for training, m, t in sf.run_plan(s.methods, s.adv_methods, *recipe(s, 0, src)):
            cfg = sf.method_model_config(m, base, s.lipsformer_alpha)
            model = Model("vit", cfg, msvp=tuple(s.msvp_lambda) if m == "specformer" else None,
                          family={"vanilla": "standard", "specformer": "msvp"}.get(m, m))
            adv = t.adv_steps if t.adversarial != "none" else 0
            train = Train("", n_tr, n_te, t.epochs, t.batch_size, t.eval_batch_size, adv)
            attack = Audit("", n_eval, 1, steps, 1, s.attack_batch_size, copy=False)
            what = f"{run} {training} {m}"
            phases = [*_named(what, train, attack),
                      Diagnostics(n_eval, s.attack_batch_size, fp64=False)]
            timed = s.methods if training == "standard" else s.adv_methods
            if (ds, src) == (s.datasets[0], s.sources[0]) and "vanilla" in timed:
                # Table 3: the step timed beside vanilla's, after its warm-up steps
                timing = s.timing_warmup + s.timing_steps * s.timing_rounds
                phases.append(Train(f"{what}: Table 3 step timing", timing * t.batch_size, 0,
                                    1, t.batch_size, t.eval_batch_size, adv))
            runs.append(Job("specformer", f"specformer_runs@{ds}", what, model, tuple(phases)))
            if m != "specformer" or (ds, src) != (s.datasets[0], s.sources[0]):
                continue
            for i, lam in enumerate(s.msvp_lambda_ablation):  # SpecFormer Table 5
                what = f"{run} {training} {m} lambda {lam}"
                table5[i].append(Job("specformer", f"specformer_table5@lambda{i}", what,
                                     replace(model, msvp=tuple(lam)),
                                     _named(what, train, attack)))
    for i, lam in enumerate(s.msvp_lambda_ablation):
        if [float(v) for v in lam] == [float(v) for v in s.msvp_lambda]:
            table5[i] = [Job("specformer", f"specformer_table5@lambda{i}", f"lambda {lam}",
                             Model("none"), (Note(f"lambda {lam}: the main runs' models"),))]
    out = runs + [j for jobs_i in table5 for j in jobs_i]
    ds, cert = s.datasets[0], s.certified
    n_tr, n_te = image_sizes(p["data"], ds)
    n_tr, n_cert = capped(s.max_train, n_tr), min(cert.n_test, n_te)
    cfg, t = certified_configs(s, stand_in(ds), 0)
    for label, lam in (("without MSVP", None), ("with MSVP", tuple(cert.msvp_lambda))):
        what = f"certified pair, {label}"
        out.append(Job("specformer", "specformer_certified", what,
                       Model("vit", cfg, msvp=lam, margin=t.margin, family="lipschitz"), (
            Train(what, n_tr, n_te, t.epochs, t.batch_size, t.eval_batch_size),
            Certify(what, n_cert, tuple(CERT_VARIANTS), 1, CERT_BATCH),
            Audit(f"{what}: PGD audit", cert.audit.count(n_cert), len(cert.cert_eps),
                  cert.audit.steps, cert.audit.restarts,
                  cert.audit.batch(s.attack_batch_size)),
            Diagnostics(n_cert, s.attack_batch_size))))
    return out
