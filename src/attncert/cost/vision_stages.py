"""Work items of the image stages at a params file's scale: the ViT grid (``train_vit`` and
``certify_vit``), the frontier, tightness, SpecFormer, CROWN (with the seconds per CROWN bound
measured at the paper shape, :data:`CROWN_BENCH`) and CertViT. Each function lists a stage's
:class:`~attncert.cost.work.Work` items, marked with the DVC unit they run in where the stage is
split; the text stage's are in :mod:`attncert.cost.text_stage`."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from attncert.cost.counting import (
    DATASETS,
    HF_VITS,
    layer_certificate_counts,
    layer_pgd_counts,
    pixel_linear_counts,
    stand_in,
    vit_counts,
    vit_forward64,
)
from attncert.cost.graphs import LIPSCHITZ_VIT, MSVP_VIT, STANDARD_VIT, graphs_key
from attncert.cost.work import (
    Work,
    audit_work,
    capped,
    certify_work,
    diagnostics_work,
    in_unit,
    n_steps,
    training_work,
)
from attncert.models.config import hub_vit_config


def grid_work(p, n_train_max: int, n_test_max: int) -> list[Work]:
    from attncert.grid.params import model_config as grid_model_config
    from attncert.pipeline.runs import GridPoint

    g, s, cv = p["vit_grid"], p["train_vit"], p["certify_vit"]
    out = []
    for ds in g.dataset:
        _, _, _, n_tr, n_te = DATASETS[ds]
        n_tr, n_te = capped(n_train_max, n_tr), capped(n_test_max, n_te)
        for depth in g.depth:
            for heads in g.heads:
                for vo in g.gamma_vo:
                    point = GridPoint(g.results_dir, ds, depth, heads, vo)
                    name = point.name
                    cfg = grid_model_config(s, point, stand_in(ds))
                    c = vit_counts(cfg, tuple(s.train.msvp_lambda), s.train.margin)
                    adv = s.train.adv_steps if s.train.adversarial != "none" else 0
                    out += training_work("train_vit", name, c, n_tr, n_te, s.train.epochs,
                                         s.train.batch_size, s.train.eval_batch_size, adv,
                                         graphs_key(LIPSCHITZ_VIT, s.train.margin,
                                                    any(s.train.msvp_lambda)))
                    n_cert = capped(cv.n_test, n_te)
                    out += certify_work("certify_vit", name, cfg, n_cert,
                                         cv.variants, len(cv.tests), cv.cert_batch_size)
                    out.append(audit_work("certify_vit", f"{name}: PGD audit", c["attack"],
                                          cv.audit.count(n_cert), len(cv.cert_eps),
                                          cv.audit.steps, cv.audit.restarts,
                                          cv.audit.batch(cv.cert_batch_size)))
                    out.append(diagnostics_work("certify_vit", name, cfg, n_cert,
                                                cv.cert_batch_size))
    return out


def frontier_work(p, n_train_max: int) -> list[Work]:
    """Per unit (``frontier_unit@<dataset>-<setting>``): the setting's ViT (the frontier's grid
    shape with the setting's axes; the standard ViT of that shape) trained on the first
    ``max_train`` of the training split minus the held-out images, LoFAST(M) and the global
    bound on ``n_val`` of those (certified settings), the PGD audit on ``audit.n`` and the
    attention diagnostics (three forward passes of ``n_val``); the linear baseline's units (a
    linear model on pixels, its radius exact) its training and audit."""
    from attncert.stages import frontier

    f, s = p["frontier"], p["train_vit"]
    out = []
    for ds in f.datasets:
        _, _, _, n_tr, _ = DATASETS[ds]
        n_tr = capped(n_train_max, n_tr) - f.holdout
        n_tr = capped(f.max_train, n_tr)
        for setting_name in f.settings:
            setting = frontier.parse_setting(setting_name)
            name = f"{ds}-{setting_name}"
            tc = frontier.train_config(f, s, setting, 0)
            adv = tc.adv_steps if tc.adversarial != "none" else 0
            if setting.kind == "linear":  # a linear map on pixels, its radius exact
                cfg, graphs = None, ""
                c = pixel_linear_counts(*DATASETS[ds][:3])  # channels, size, classes
            else:
                cfg = frontier.model_config(f, s, setting, ds, stand_in(ds))
                c = vit_counts(cfg, tuple(tc.msvp_lambda), tc.margin)
                kind = LIPSCHITZ_VIT if setting.kind != "standard" else STANDARD_VIT
                graphs = graphs_key(kind, tc.margin, any(tc.msvp_lambda))
            items = training_work("frontier", name, c, n_tr, min(f.holdout, n_tr),
                                  tc.epochs, tc.batch_size, tc.eval_batch_size, adv, graphs)
            if setting.is_vit:
                items += certify_work("frontier", name, cfg, f.n_val, ["lofast_M", "global"],
                                      1, f.cert_batch_size)
            items.append(audit_work("frontier", f"{name}: PGD audit", c["attack"],
                                    f.audit.count(f.n_val), len(f.cert_eps), f.audit.steps,
                                    f.audit.restarts, f.audit.batch(f.cert_batch_size)))
            if cfg is not None:
                items.append(diagnostics_work("frontier", name, cfg, f.n_val,
                                              f.cert_batch_size))
            out += in_unit(items, f"frontier_unit@{name}")
    return out


def tightness_work(p) -> list[Work]:
    t = p["tightness"]
    setup, step = layer_pgd_counts(t.n_tokens, t.dim, t.heads)
    lc = layer_certificate_counts(t.n_tokens, t.dim, t.heads, "lofast_M")
    # (calls, inputs per call): Table 3, Figure 1 (two pieces), Figure 3 (W^Q, W^K, W^V, W^O
    # per size and draw, then X per size), Figure 4 (one call per scale)
    s = t.samples
    calls = [(1, s * len(t.cert_eps)), (2, s * len(t.cert_eps)),
             (4 * len(t.fig3_sizes) * t.fig3_samples, s),
             (len(t.fig3_sizes), s * t.fig3_samples), (len(t.fig4_scales), s)]
    flops = sum(m * (setup.flops(b) + t.attack_steps * step.flops(t.attack_restarts * b)
                     + lc.flops(b)) for m, b in calls)
    kernels = sum(m * (setup.kernels + t.attack_steps * step.kernels + lc.kernels)
                  for m, _ in calls)
    return [Work("tightness", f"one layer ({t.n_tokens} tokens, {t.dim}-d, {t.heads} heads): "
                 f"PGD-{t.attack_steps} x {t.attack_restarts} and LoFAST", "fp64", flops, kernels)]


def specformer_work(p, n_train_max: int, n_test_max: int) -> list[Work]:
    """The stage's own plan (:func:`attncert.specformer.methods.run_plan` of each source's recipe,
    :func:`attncert.specformer.study.recipe`): per run its training and attacks, Table 5's
    runs (the specformer method of the first source and dataset at every other lambda), then
    the certified pair."""
    from attncert.specformer import methods as sf
    from attncert.specformer.study import CERT_VARIANTS, certified_configs, recipe

    s = p["specformer"]
    out = []
    for ds, src in ((ds, src) for ds in s.datasets for src in s.sources):
        channels, _, k, n_tr, n_te = DATASETS[ds]
        n_tr, n_te = capped(s.max_train, capped(n_train_max, n_tr)), capped(n_test_max, n_te)
        if src == sf.SCRATCH:
            base = sf.base_model_config(stand_in(ds), **s.vit.arch(), block=s.block)
        elif src in HF_VITS:  # fine-tuned at its own input size (the upsampling is free)
            base = hub_vit_config(**HF_VITS[src], channels=channels, num_classes=k)
        else:
            raise ValueError(f"specformer.sources: the shape of {src!r} is unknown here; add it "
                             "to attncert.cost.HF_VITS")
        run = sf.run_label(ds, src)
        n_eval = min(s.n_test, n_te)
        # FGSM (1), PGD-2, CW-n, PGD-n and L2 PGD-n per radius
        steps = 1 + 2 + 2 * s.attack_steps + s.attack_steps * len(s.attack_eps)
        for training, m, t in sf.run_plan(s.methods, s.adv_methods, *recipe(s, 0, src)):
            cfg = sf.method_model_config(m, base, s.lipsformer_alpha)
            c = vit_counts(cfg, tuple(s.msvp_lambda) if m == "specformer" else None)
            adv = t.adv_steps if t.adversarial != "none" else 0
            key = {"vanilla": STANDARD_VIT, "specformer": MSVP_VIT}.get(m, f"{STANDARD_VIT}, {m}")
            items = training_work("specformer", f"{run} {training} {m}", c, n_tr, n_te,
                                  t.epochs, t.batch_size, t.eval_batch_size, adv, key)
            items.append(audit_work("specformer", f"{run} {training} {m}: attacks",
                                    c["attack"], n_eval, 1, steps, 1, s.attack_batch_size))
            out += in_unit(items, f"specformer_runs@{ds}")
            if m != "specformer" or (ds, src) != (s.datasets[0], s.sources[0]):
                continue
            # SpecFormer Table 5: the specformer method at every other lambda
            for i, lam in enumerate(s.msvp_lambda_ablation):
                if [float(v) for v in lam] == [float(v) for v in s.msvp_lambda]:
                    continue  # the main run's own model
                what = f"{run} {training} {m} lambda {lam}"
                items = training_work("specformer", what, c, n_tr, n_te, t.epochs,
                                      t.batch_size, t.eval_batch_size, adv, key)
                items.append(audit_work("specformer", f"{what}: attacks", c["attack"],
                                        n_eval, 1, steps, 1, s.attack_batch_size))
                out += in_unit(items, f"specformer_table5@lambda{i}")
    # the certified pair: two Lipschitz ViTs (with and without MSVP), certified by two bounds
    ds = s.datasets[0]
    _, _, _, n_tr, n_te = DATASETS[ds]
    n_tr, n_te = capped(s.max_train, capped(n_train_max, n_tr)), capped(n_test_max, n_te)
    cfg, t = certified_configs(s, stand_in(ds), 0)
    cert = s.certified
    n_cert = min(cert.n_test, n_te)
    for label, lam in (("without MSVP", None), ("with MSVP", tuple(cert.msvp_lambda))):
        c = vit_counts(cfg, lam)
        items = training_work("specformer", f"certified pair, {label}", c, n_tr, n_te,
                              t.epochs, t.batch_size, t.eval_batch_size,
                              graphs=graphs_key(LIPSCHITZ_VIT, t.margin, lam is not None))
        items += certify_work("specformer", f"certified pair, {label}", cfg, n_cert,
                              list(CERT_VARIANTS), 1, 100)
        items.append(audit_work("specformer", f"certified pair, {label}: PGD audit",
                                c["attack"], cert.audit.count(n_cert), len(cert.cert_eps),
                                cert.audit.steps, cert.audit.restarts,
                                cert.audit.batch(s.attack_batch_size)))
        out += in_unit(items, "specformer_certified")
    return out



#: seconds per CROWN bound measured at the paper shape (``python -m attncert.cost crown
#: --device D --write``): rows of :func:`attncert.cost.bench.bench_crown`, per device type
CROWN_BENCH = "docs/crown_bench.json"


def crown_bound_seconds(depth: int, method: str, path: str | Path = CROWN_BENCH
                        ) -> tuple[float, str]:
    """(seconds, how) of one CROWN bound of the crown ViT of ``depth`` on a GPU: measured on
    CUDA where :data:`CROWN_BENCH` has it; else the CPU's measurement times the median
    CUDA / CPU ratio of the bounds measured on both ("scaled"); else NaN ("not measured")."""
    import json
    import statistics

    path = Path(path)
    rows = json.loads(path.read_text())["rows"] if path.is_file() else []
    by = {(r["device"].split(":")[0], r["depth"], r["method"]): r["seconds_per_bound"]
          for r in rows if math.isfinite(r["seconds_per_bound"])}
    if ("cuda", depth, method) in by:
        return by["cuda", depth, method], "measured on CUDA"
    if ("cpu", depth, method) not in by:
        return math.nan, "not measured"
    ratios = [v / by["cpu", d, m] for (dev, d, m), v in by.items()
              if dev == "cuda" and ("cpu", d, m) in by]
    if not ratios:
        return by["cpu", depth, method], "measured on the CPU, not scaled"
    ratio = statistics.median(ratios)
    return by["cpu", depth, method] * ratio, f"the CPU's x {ratio:.2g} (CUDA / CPU)"


def crown_work(p, n_train_max: int, n_test_max: int) -> tuple[list[Work], float]:
    """Per unit (dataset x depth, ``crown_unit@<dataset>-<depth>``): training, LoFAST, the PGD
    audit and CROWN's bounds: every point x eps x method run, each at its measured seconds
    per bound (:func:`crown_bound_seconds`; the time limit where none is measured or past
    it), capped by the unit's time budget. Returns the items and the bounds' seconds in
    all."""
    from attncert.crown.study import vit_config

    c_p = p["crown"]
    out, bound_seconds = [], 0.0
    for dataset in c_p.datasets:
        _, _, _, n_tr, n_te = DATASETS[dataset]
        n_tr, n_te = capped(c_p.max_train, capped(n_train_max, n_tr)), capped(n_test_max, n_te)
        n = min(c_p.n_test, n_te)
        for depth in c_p.depths:
            cfg = vit_config(stand_in(dataset), c_p, depth)
            c = vit_counts(cfg)
            t = c_p.train
            items = training_work("crown", f"{dataset} L{depth}", c, n_tr, n_te, t.epochs,
                                  t.batch_size, t.eval_batch_size,
                                  graphs=graphs_key(LIPSCHITZ_VIT, t.margin))
            items += certify_work("crown", f"{dataset} L{depth} LoFAST", cfg, n,
                                  [c_p.lofast_variant], 1, 100)
            items.append(audit_work("crown", f"{dataset} L{depth}: PGD audit", c["attack"],
                                    c_p.audit.count(n), len(c_p.cert_eps), c_p.audit.steps,
                                    c_p.audit.restarts, c_p.audit.batch_size))
            worst = 0.0
            for method in c_p.methods:
                sec, _ = crown_bound_seconds(depth, method)
                limit = c_p.time_limit or math.inf
                one = n * len(c_p.cert_eps) * (limit if math.isnan(sec) else min(sec, limit))
                worst += min(one, c_p.time_budget) if c_p.time_budget else one  # per method
            items.append(Work("crown", f"{dataset} L{depth}: CROWN bounds (at most)", "fp64",
                              0.0, 0.0, fixed_seconds=worst))
            bound_seconds += worst
            out += in_unit(items, f"crown_unit@{dataset}-{depth}")
    return out, bound_seconds


def certvit_work(p, n_train_max: int, n_test_max: int) -> list[Work]:
    """The certvit stage's units: its own run (``certvit_main``), one run per CertViT Table 1
    dataset (a small ViT trained here: ``Params.table1_run``; ``certvit_table1@<dataset>``) and
    Table 3's ImageNet route (``certvit_imagenet``)."""
    cv = p["certvit"]
    out = [dataclasses.replace(w, unit="certvit_main")
           for w in _certvit_run_work(cv, n_train_max, n_test_max, "")]
    for d in cv.table1.datasets:
        out += [dataclasses.replace(w, unit=f"certvit_table1@{d}")
                for w in _certvit_run_work(cv.table1_run(d, DATASETS[d][1]), n_train_max,
                                           n_test_max, f"Table 1 {d}: ")]
    n_before = len(out)
    for source in cv.imagenet.sources:  # Table 3: the user's validation images
        if source not in HF_VITS:
            continue
        cfg = hub_vit_config(**HF_VITS[source], channels=3, num_classes=1000)
        c = vit_counts(cfg)
        n_val = p["data"].imagenet_val_images or 50000
        # one image per class of those left after calibration (at most ImageNet's 1000)
        n = min(1000, n_val - min(cv.imagenet.calibration, n_val // 2))
        maps = cfg.depth * 6 + 2
        per_pass = 2 * 2 * cv.dr.max_pairs * cfg.dim * max(cfg.mlp_hidden, cfg.dim)
        passes = cv.dr.iterations * cv.dr.projection_steps  # a step: every mini-batch at once
        f64 = vit_forward64(cfg)
        for mode in cv.constrain:  # accuracy forwards (loaded, adapted), DR, certificate, audit
            what = f"Table 3 ImageNet {source} {mode}"
            out.append(Work("certvit", f"{what}: accuracy forwards", "fp32",
                            2 * n_steps(n, cv.eval_batch_size)
                            * c["forward"].flops(cv.eval_batch_size),
                            2 * n_steps(n, cv.eval_batch_size) * c["forward"].kernels))
            out.append(Work("certvit", f"{what}: Douglas-Rachford", "fp64",
                            maps * passes * per_pass, maps * passes * 20))
            out.append(Work("certvit", f"{what}: global certificate", "fp64",
                            n_steps(n, cv.eval_batch_size) * f64.flops(cv.eval_batch_size),
                            n_steps(n, cv.eval_batch_size) * f64.kernels))
            out.append(audit_work("certvit", f"{what}: PGD audit", c["attack"],
                                  cv.audit.count(n), len(cv.cert_eps), cv.audit.steps,
                                  cv.audit.restarts, cv.audit.batch(cv.eval_batch_size)))
    if len(out) == n_before:  # no hub ViT to load: the unit records that, in seconds
        out.append(Work("certvit", "Table 3 ImageNet: no hub source", "fp32", 0.0, 0.0))
    out[n_before:] = [dataclasses.replace(w, unit="certvit_imagenet") for w in out[n_before:]]
    return out


def _certvit_run_work(cv, n_train_max: int, n_test_max: int, label: str) -> list[Work]:
    """One run of the certvit steps: pre-training (or fine-tuning the loaded ViT), then per
    mode the adaptation fine-tune, Douglas-Rachford, the final fine-tune (``spectral``: its
    projected fine-tune), the certificate and the PGD audit."""
    from attncert.certvit import methods as stage

    _, size, _, n_tr, n_te = DATASETS[cv.dataset]
    n_tr, n_te = capped(n_train_max, n_tr), capped(n_test_max, n_te)
    if cv.source == stage.PIPELINE:
        arch = cv.vit.arch()
        cfg = stage.pretrain_config(stand_in(cv.dataset), **arch)
    elif cv.source in HF_VITS:
        channels, _, k, _, _ = DATASETS[cv.dataset]
        cfg = hub_vit_config(**HF_VITS[cv.source], channels=channels, num_classes=k)
    else:
        raise ValueError(f"certvit.source {cv.source!r}: its shape is unknown here; add it to "
                         "attncert.cost.HF_VITS")
    c = vit_counts(cfg)
    out = training_work("certvit", f"{label}pre-train / fine-tune", c, n_tr, n_te,
                        cv.train.epochs, cv.train.batch_size, cv.train.eval_batch_size,
                        graphs=STANDARD_VIT)
    # Douglas-Rachford (float64): per linear map, at most dr.iterations x dr.projection_steps
    # Haugazeau steps, each one batched pass over all its recorded pairs (the mini-batches are
    # evaluated together: attncert.certvit.splitting.project_outputs)
    maps = cfg.depth * 6 + 2
    per_pass = 2 * 2 * cv.dr.max_pairs * cfg.dim * max(cfg.mlp_hidden, cfg.dim)
    passes = cv.dr.iterations * cv.dr.projection_steps  # a step: every mini-batch at once
    # every mode's final model is certified on n_test images and attacked on audit.n
    n = n_te if cv.n_test == 0 else min(cv.n_test, n_te)
    f64 = vit_forward64(cfg)
    for mode in cv.constrain:
        final = cv.finetune if mode == "paper" else cv.spectral
        for phase, epochs, t in (("adaptation fine-tune", cv.adapt_epochs, cv.train),
                                 ("final fine-tune", final.epochs, final)):
            out += training_work("certvit", f"{label}{mode}: {phase}", c, n_tr, n_te, epochs,
                                 t.batch_size, t.eval_batch_size, graphs=STANDARD_VIT)
        out.append(Work("certvit", f"{label}{mode}: Douglas-Rachford (from its matrix sizes)",
                        "fp64", maps * passes * per_pass, maps * passes * 20))
        out.append(Work("certvit", f"{label}{mode}: global certificate (float64 forwards)",
                        "fp64", n_steps(n, cv.eval_batch_size) * f64.flops(cv.eval_batch_size),
                        n_steps(n, cv.eval_batch_size) * f64.kernels))
        out.append(audit_work("certvit", f"{label}{mode}: PGD audit", c["attack"],
                              cv.audit.count(n), len(cv.cert_eps), cv.audit.steps,
                              cv.audit.restarts, cv.audit.batch(cv.eval_batch_size)))
    return out
