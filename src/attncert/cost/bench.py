"""Measured training step times (forward, backward, AdamW) of every model kind at its params-file
shape (``python -m attncert.cost bench``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from attncert.cost.counting import random_images
from attncert.cost.graphs import (
    LIPSCHITZ_VIT,
    MSVP_VIT,
    STANDARD_VIT,
    TEXT_KINDS,
    graphs_key,
)
from attncert.cost.kinds import bench_models, step_terms
from attncert.pipeline.datasets import stand_in
from attncert.training.loop import fused_on_cuda

# -- training step times (make bench) ----------------------------------------------------------

#: how a bench step runs: eager, or compiled as training runs it in ``base.compile``'s modes
#: (:mod:`attncert.training.compiled`: ``compile``, ``graphs`` with CUDA graphs on CUDA)
COMPILE_MODES = ("eager", "compile", "graphs")


#: the bench's kinds that also train adversarially (SpecFormer's PGD twins): each times a PGD
#: training step too, as the step kind :func:`attncert.cost.graphs.graphs_key` names
ADVERSARIAL_KINDS = (STANDARD_VIT, MSVP_VIT)
#: their step kinds under PGD training -> the kind
ADVERSARIAL_KEYS = {graphs_key(k, adversarial=True): k for k in ADVERSARIAL_KINDS}


def _bench_kinds(params, only: tuple[str, ...], adversarial: bool
                 ) -> Iterator[tuple[str, nn.Module, Any, str, Any]]:
    """(name, model, batch(b), shape, adversarial recipe or None) of every bench kind
    (``only``: these), or with ``adversarial`` each kind of :data:`ADVERSARIAL_KINDS` under PGD
    training as ``specformer.finetune``'s adversarial twin, named by its step kind."""
    models = bench_models(params)
    if not adversarial:
        for name, (model, make_batch, shape) in models.items():
            if not only or name in only:
                yield name, model, make_batch, shape, None
        return
    _, pgd = params["specformer"].finetune.configs(0)  # the fine-tunes' PGD twin
    for key, name in ADVERSARIAL_KEYS.items():
        if not only or key in only:
            model, make_batch, shape = models[name]
            yield key, model, make_batch, f"{shape}, PGD-{pgd.adv_steps}", pgd


def bench_training(params, batch: int, steps: int = 5, device: str = "auto",
                   precision: str = "auto", mode: str = "eager", only: tuple[str, ...] = (),
                   adversarial: bool = False) -> list[dict[str, Any]]:
    """Seconds per training step (median of ``steps`` after the warm-up: one step eager, three
    compiled, whose first is reported as ``first_step_s``) per model kind (``only``: these);
    with ``adversarial``, of SpecFormer's kinds under PGD adversarial training instead
    (:data:`ADVERSARIAL_KINDS`: the attack's passes and the training pass, as
    :func:`attncert.training.train.step_loss` runs them). ``mode``: one of
    :data:`COMPILE_MODES` (the forward and backward compiled as in training, AdamW eager)."""
    from attncert.msvp import MSVP, penalty
    from attncert.pipeline import rng
    from attncert.pipeline.device import resolve_device, resolve_precision
    from attncert.training import compiled
    from attncert.training.precision import autocast, training_matmuls
    from attncert.training.train import step_loss

    if mode not in COMPILE_MODES:
        raise ValueError(f"mode {mode!r}; one of {', '.join(COMPILE_MODES)}")
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    how = compiled.resolve(dev, "off" if mode == "eager" else mode)
    warm = 1 if mode == "eager" else 3
    rows = []
    for name, model, make_batch, shape, pgd in _bench_kinds(params, only, adversarial):
        model.to(dev).train()
        args = [a.to(dev) for a in make_batch(batch)]
        msvp = (MSVP(model, *params["specformer"].msvp_lambda) if "MSVP" in name else None)
        trained = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=1e-4, **fused_on_cuda(trained))  # as the runs
        gen = rng.generator(0, dev)
        loss_fn, after = step_terms(params, name, model)
        loss_fn = loss_fn or nn.functional.cross_entropy

        def step(model=model, args=args, msvp=msvp, opt=opt, pgd=pgd, gen=gen,
                 loss_fn=loss_fn, after=after):
            compiled.step_begin(how, dev)
            with autocast(prec, dev):
                if pgd is not None:  # images only: (x, y)
                    _, loss = step_loss(model, *args, pgd, msvp, gen)
                else:
                    loss = loss_fn(model(*args[:-1]), args[-1])
                    if msvp is not None:  # compiled as the training runs compile it
                        loss = loss + compiled.compiled_loss(model, penalty)(model, msvp)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if after is not None:
                after()

        times = []
        try:
            with training_matmuls(prec, dev), compiled.compiled_forward(model, how):
                for _ in range(steps + warm):
                    _sync(dev)
                    t0 = time.perf_counter()
                    step()
                    _sync(dev)
                    times.append(time.perf_counter() - t0)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 (a kind that does not compile is a result)
            status = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:200]
        timed = sorted(times[warm:])
        rows.append({"model": name, "shape": shape, "batch": batch, "device": str(dev),
                     "precision": prec, "mode": mode, "status": status,
                     "ms_per_step": 1e3 * timed[len(timed) // 2] if timed else float("nan"),
                     "first_step_s": times[0] if times else float("nan"),
                     "parameters": sum(p.numel() for p in model.parameters())})
        opt.zero_grad(set_to_none=True)  # CUDA graphs own the gradients' memory
        model.cpu()
        torch._dynamo.reset()
    return rows


#: the bench's kinds whose PGD audits are timed (:func:`bench_audits`): the image models' in
#: pixel space, the text models' on their embeddings (:mod:`attncert.text.attacks`)
AUDIT_KINDS = (LIPSCHITZ_VIT, STANDARD_VIT,
               *TEXT_KINDS)
#: their audits' step kinds -> the kind
AUDIT_KEYS = {graphs_key(k, audit=True): k for k in AUDIT_KINDS}
#: attack steps per timed audit
AUDIT_STEPS = 10


def bench_audits(params, batch: int, steps: int = 5, device: str = "auto", mode: str = "eager",
                 only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Seconds per attack step of a PGD audit (L2 PGD, :data:`AUDIT_STEPS` steps, one restart)
    of a float64 model of each kind of :data:`AUDIT_KINDS` (``only``: these audit keys), run
    as the audits run it (a text model's on its embeddings,
    :func:`attncert.text.attacks.pgd_embeddings`): on its float32 attack copy
    (:func:`attncert.attacks.attack_copy`,
    compiled in ``mode``: one of :data:`COMPILE_MODES`), TF32 matmuls on CUDA. Median of
    ``steps`` attacks after the warm-up (one eager, three compiled); an attack's clean and
    final forward passes count in its steps. Rows as :func:`bench_training`'s, ``model`` the
    audit's step kind (:func:`attncert.cost.graphs.graphs_key` with ``audit``)."""
    from attncert.attacks import attack_copy, pgd_l2
    from attncert.pipeline import rng
    from attncert.pipeline.device import resolve_device
    from attncert.text.attacks import pgd_embeddings
    from attncert.training.precision import attack_matmuls

    if mode not in COMPILE_MODES:
        raise ValueError(f"mode {mode!r}; one of {', '.join(COMPILE_MODES)}")
    dev = resolve_device(device)
    warm = 1 if mode == "eager" else 3
    models = bench_models(params)

    def attack(attacker, model, batch, gen):
        if len(batch) == 2:  # images (x, y)
            return pgd_l2(attacker, *batch, 0.5, AUDIT_STEPS, 1, generator=gen)
        ids, mask, y = batch  # text: its embeddings, float32 as the audit attacks them
        e = model.embed(ids, mask).float()
        return pgd_embeddings(lambda z: attacker(z, mask), e, y, 0.5, AUDIT_STEPS, 1,
                              generator=gen)

    rows = []
    for key, kind in AUDIT_KEYS.items():
        if only and key not in only:
            continue
        model, make_batch, shape = models[kind]
        model = model.to(dev, torch.float64).eval()
        attacker = attack_copy(model, mode="off" if mode == "eager" else mode)
        args = [a.to(dev) for a in make_batch(batch)]
        gen = rng.generator(0, dev)
        times, status = [], "ok"
        try:
            with attack_matmuls(dev), torch.enable_grad():
                for _ in range(steps + warm):
                    _sync(dev)
                    t0 = time.perf_counter()
                    attack(attacker, model, args, gen)
                    _sync(dev)
                    times.append((time.perf_counter() - t0) / AUDIT_STEPS)
        except Exception as exc:  # noqa: BLE001 (a kind whose attack does not compile is a result)
            status = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:200]
        timed = sorted(times[warm:])
        rows.append({"model": key, "shape": f"{shape}, L2 PGD-{AUDIT_STEPS}", "batch": batch,
                     "device": str(dev), "precision": "tf32" if dev.type == "cuda" else "fp32",
                     "mode": mode, "status": status,
                     "ms_per_step": 1e3 * timed[len(timed) // 2] if timed else float("nan"),
                     "first_step_s": times[0] * AUDIT_STEPS if times else float("nan"),
                     "parameters": sum(p.numel() for p in model.parameters())})
        del attacker
        model.to("cpu", torch.float32)
        torch._dynamo.reset()
    return rows


#: the model kind timed by default with K processes at once (the study's most common unit)
CONCURRENCY_KIND = LIPSCHITZ_VIT


def _concurrent_child(params, batch, steps, device, mode, kind, barrier, queue) -> None:
    """One of K processes: wait for the others, then warm up and time ``steps`` steps."""
    torch.manual_seed(0)
    barrier.wait()
    queue.put(bench_training(params, batch, steps, device, mode=mode,
                             only=(kind,))[0]["ms_per_step"])


def bench_concurrency(params, batch: int, ks: tuple[int, ...] = (1, 2, 4), steps: int = 20,
                      device: str = "auto", mode: str = "eager", kind: str = CONCURRENCY_KIND
                      ) -> list[dict[str, Any]]:
    """K independent processes each training one model ``kind`` (:func:`bench_models`'s
    names) on one device at once: per K, the median step time in a process and the
    throughput (steps per second of all K together) over K = 1's: what running K units per
    GPU gains (:mod:`attncert.cost.plan` reads it per kind)."""
    import multiprocessing as mp

    if kind not in bench_models(params):
        raise ValueError(f"model kind {kind!r}; one of {', '.join(bench_models(params))}")
    ctx, rows = mp.get_context("spawn"), []
    for k in ks:
        barrier, queue = ctx.Barrier(k), ctx.Queue()
        procs = [ctx.Process(target=_concurrent_child,
                             args=(params, batch, steps, device, mode, kind, barrier, queue))
                 for _ in range(k)]
        for p in procs:
            p.start()
        got = [queue.get(timeout=900) for _ in procs]
        for p in procs:
            p.join()
        step_ms = sorted(got)[k // 2]
        rows.append({"kind": kind, "k": k, "mode": mode, "batch": batch,
                     "ms_per_step": step_ms, "steps_per_s": 1e3 * k / step_ms})
    for r in rows:
        r["speedup"] = r["steps_per_s"] / rows[0]["steps_per_s"]
    return rows


def merge_concurrency_bench(path, rows: list[dict[str, Any]], device: str, date: str,
                            torch_version: str) -> dict[str, Any]:
    """Merge :func:`bench_concurrency` rows into the record at ``path`` (each replacing the
    row of its kind, mode, K, device and batch) and write it atomically; returns the record."""
    from attncert.pipeline.io import merge_rows

    new = [{"kind": r["kind"], "mode": r["mode"], "k": r["k"],
            "ms_per_step": round(r["ms_per_step"], 3), "device": device, "date": date,
            "batch": r["batch"], "torch": torch_version} for r in rows]
    return merge_rows(path, new, lambda r: (r["kind"], r["mode"], r["k"], r.get("device"),
                                            r.get("batch")))


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


#: the grid's training margins timed against LMT (``python -m attncert.cost bench``)
BENCH_MARGINS = ("none", "lmt", "olsa", "lofast")


def bench_margins(params, batch: int, steps: int = 5, device: str = "auto",
                  precision: str = "auto", mode: str = "eager",
                  margins: tuple[str, ...] = BENCH_MARGINS) -> list[dict[str, Any]]:
    """Seconds per training step of the grid's Lipschitz ViT with each training margin
    (:func:`attncert.training.train.step_loss`, the grid's own settings; ``lofast`` at its
    radius or, when the grid's is 0, at 0.1), and each one's ratio to LMT's; ``mode`` as in
    :func:`bench_training` (compiled as in training: the forward pass, and the ``lofast``
    margin's whole loss; ``margins``: these, LMT always among them). A margin that fails
    compiled is a row with its error in ``status``."""
    import dataclasses

    from attncert.grid.params import model_config as grid_model_config
    from attncert.models import build_vit
    from attncert.pipeline.device import resolve_device, resolve_precision
    from attncert.pipeline.runs import GridPoint
    from attncert.training import compiled
    from attncert.training.precision import autocast, training_matmuls
    from attncert.training.train import step_loss

    g, s = params["vit_grid"], params["train_vit"]
    ds = g.dataset[0]
    cfg = grid_model_config(s, GridPoint(g.results_dir, ds, max(g.depth), max(g.heads),
                                              g.gamma_vo[0]), stand_in(ds))
    if mode not in COMPILE_MODES:
        raise ValueError(f"mode {mode!r}; one of {', '.join(COMPILE_MODES)}")
    dev = resolve_device(device)
    prec = resolve_precision(precision, dev)
    how = compiled.resolve(dev, "off" if mode == "eager" else mode)
    warm = 1 if mode == "eager" else 3
    x, y = (a.to(dev) for a in random_images(cfg, batch))
    rows = []
    for margin in margins if "lmt" in margins else ("lmt", *margins):
        train_cfg = dataclasses.replace(s.train.config(0), margin=margin,
                                        lofast_eps=s.train.lofast_eps or 0.1)
        torch.manual_seed(0)
        model = build_vit(cfg).to(dev).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, **fused_on_cuda(model.parameters()))
        times, status = [], "ok"
        try:
            with training_matmuls(prec, dev), compiled.compiled_forward(model, how):
                for _ in range(steps + warm):
                    _sync(dev)
                    t0 = time.perf_counter()
                    compiled.step_begin(how, dev)
                    with autocast(prec, dev):
                        _, loss = step_loss(model, x, y, train_cfg, progress=(10**6, 10**6))
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    _sync(dev)
                    times.append(time.perf_counter() - t0)
        except Exception as exc:  # noqa: BLE001 (a margin that does not compile is a result)
            status = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"[:200]
        timed = sorted(times[warm:])
        rows.append({"margin": margin, "mode": mode, "status": status,
                     "ms_per_step": 1e3 * timed[len(timed) // 2] if timed else float("nan"),
                     "first_step_s": times[0] if times else float("nan")})
        opt.zero_grad(set_to_none=True)
        torch._dynamo.reset()
    lmt = next(r["ms_per_step"] for r in rows if r["margin"] == "lmt")
    for r in rows:
        r["vs_lmt"] = r["ms_per_step"] / lmt
    return rows
