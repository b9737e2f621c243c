"""A true-size rehearsal: each paper-scale model, built at random, for a few steps on this host.

    python -m attncert.pipeline.rehearse --out reports/rehearsal.json      # make rehearse

Every kind (:data:`KINDS`) builds a big model at params.yaml's paper shapes (random weights)
with the stages' own builders, configs and losses, and runs its pass (a training step, a CROWN
bound) ``--steps`` times at the paper batch, alone in a spawned process whose resident memory
a watchdog samples (``RLIMIT_AS`` would count address space PyTorch reserves, never touches).
Past ``--max-gb`` a try is killed and the batch halved; a kind that fits at no batch is "does
not fit N GB", one that raises "error: ...", and the run goes on (on CUDA: GPU peaks too)."""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools as ft
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from attncert.certify import certify_table
from attncert.cost.counting import DATASETS, random_images
from attncert.models import build_vit
from attncert.models.config import HF_VITS
from attncert.pipeline import rng
from attncert.pipeline.datasets import stand_in
from attncert.pipeline.device import resolve_device, resolve_precision
from attncert.pipeline.io import write_json
from attncert.pipeline.params import PARAMS_FILE, ParamsError, StudyParams, read_yaml
from attncert.pipeline.runs import GridPoint
from attncert.text.tokenize import ENCODERS, VOCAB
from attncert.training.loop import optimizer
from attncert.training.precision import autocast, training_matmuls

#: a step past every ramp (LoFAST radius, OLSA gamma): the loss at its full strength
LATE_STEP = 10**9
GB = 2**30
#: a kind's record, in the order of the table
COLUMNS = ("kind", "parameters", "input_shape", "batch_requested", "batch_used", "steps",
           "seconds_per_step", "gpu_peak_gb", "host_peak_gb", "status", "note")


@dataclass(frozen=True)
class Setup:
    """What a kind's builder reads: the validated params, the device and ``base.seed``."""

    params: StudyParams
    dev: torch.device
    seed: int = 0


@dataclass
class Prepared:
    """A built kind: size, input, batch, ``make(b)`` -> one step at batch b, ``once(b)`` -> the
    note of a pass run once after the steps; ``steps``: a fixed count (None: ``--steps``)."""

    parameters: int
    input_shape: list[int]
    batch: int
    make: Callable[[int], Callable[[], None]]
    once: Callable[[int], str] | None = None
    steps: int | None = None


Builder = Callable[[Setup], Prepared]


def _runner(model, steps, cfg, s: Setup) -> Callable[[], None]:
    """One optimiser step of ``steps`` (a training.loop.Steps) as run_epochs takes it."""
    prec, opt = resolve_precision(s.params["base"].precision, s.dev), optimizer(steps.params, cfg)

    def step() -> None:
        model.train()
        inputs, y = steps.batch(steps.plan(1)[0])
        with training_matmuls(prec, s.dev):
            with autocast(prec, s.dev):
                _, loss = steps.loss(inputs, y, LATE_STEP)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(steps.params, cfg.grad_clip)
            opt.step()
        steps.after_step()
        if s.dev.type == "cuda":
            torch.cuda.synchronize(s.dev)
    return step


def _image_kind(model, cfg, data: Mapping[str, Any], s: Setup,
                once: Callable[[int], str] | None = None) -> Prepared:
    """An image model trained with ``cfg`` (its batch requested) on random images of ``data``."""
    model.to(s.dev)
    shape = list(data["train"]["x"].shape[1:])

    def make(b: int) -> Callable[[], None]:
        g = rng.generator(s.seed, "cpu")
        train = {"x": torch.randint(0, 256, (b, *shape), dtype=torch.uint8, generator=g),
                 "y": torch.randint(0, len(data["classes"]), (b,), generator=g)}
        cfg_b = dataclasses.replace(cfg, batch_size=b)
        return _runner(model, cfg_b.steps(model, train, s.dev), cfg_b, s)
    return Prepared(sum(p.numel() for p in model.parameters()), shape, cfg.batch_size, make, once)


def _hf_vit(source: str, data: Mapping[str, Any], s: Setup):
    """The standard ViT of the HF checkpoint ``source``: a random ``ViTForImageClassification``
    of its config (``HF_VITS``), converted (``vit_from_hf``) and fitted to ``data``."""
    from transformers import ViTConfig, ViTForImageClassification

    from attncert.certvit.load import DEFAULT_MEAN_STD, vit_from_hf
    from attncert.certvit.methods import fit_to_dataset
    if (sh := HF_VITS.get(source)) is None:
        raise ValueError(f"no config known for {source!r}; known: {', '.join(HF_VITS)}")
    hf = ViTForImageClassification(ViTConfig(
        image_size=sh["image_size"], patch_size=sh["patch"], hidden_size=sh["dim"],
        num_hidden_layers=sh["depth"], num_attention_heads=sh["heads"],
        intermediate_size=sh["mlp_hidden"], num_labels=1000)).eval()
    return fit_to_dataset(vit_from_hf(hf, [DEFAULT_MEAN_STD], [DEFAULT_MEAN_STD]), data,
                          s.seed)[0]


def certvit_vit_b16(s: Setup) -> Prepared:
    """certvit: the source ViT adapted (``paper`` mode) and fine-tuned at the adaptation's
    config; once: Douglas-Rachford at ``certvit.dr`` on its first site, on the batch."""
    from attncert.certvit import adapt, constrain, linear_sites
    from attncert.certvit import methods as cv
    from attncert.certvit.study import Configs
    p = s.params["certvit"]
    data, cfg = stand_in(p.dataset), Configs.build(p, s.seed)
    model = (_hf_vit(p.source, data, s) if p.source != cv.PIPELINE
             else cv.source_model(p.source, data, p.vit.arch(), s.seed)[0])
    model = adapt(model, cv.adaptation("paper", p.norm))

    def once(b: int) -> str:
        site, t0 = linear_sites(model)[0].module, time.perf_counter()
        images = torch.rand(b, *data["train"]["x"].shape[1:], device=s.dev)  # upsampled inside
        constrain(model, images, cfg.dr, include=[site])
        return f"Douglas-Rachford on {site} ({b} images): {time.perf_counter() - t0:.1f} s"
    return _image_kind(model, cfg.adapt["paper"], data, s, once)


def specformer_kind(source: str, s: Setup) -> Prepared:
    """specformer: the pre-trained ``source`` fine-tuned with MSVP on the first dataset."""
    from attncert.specformer import methods as sf
    from attncert.specformer.study import recipe
    p = s.params["specformer"]
    data = stand_in(p.datasets[0])
    cfg = sf.method_train_config("specformer", recipe(p, s.seed, source)[0], p.msvp_lambda)
    return _image_kind(_hf_vit(source, data, s), cfg, data, s)


def text_bert_base(s: Setup) -> Prepared:
    """text, frozen route: the encoder (``frozen.source``'s shape) encodes ``cert_batch_size``
    sentences of ``max_len`` tokens; one step of the OLSA head on their states follows."""
    from transformers import BertConfig, BertModel

    from attncert.text.evaluate import frozen_states
    from attncert.text.jobs import dataset_jobs
    from attncert.text.study import settings
    t = s.params["text"]
    width, layers, heads, inter = ENCODERS[t.frozen.source]
    encoder = BertModel(BertConfig(hidden_size=width, num_hidden_layers=layers,
                                   num_attention_heads=heads, intermediate_size=inter)).eval()
    job = dataset_jobs(t, VOCAB, t.frozen.datasets[0])["frozen-olsa"]
    model = job.cls(**(job.kwargs | {"encoder": encoder}))
    cfg = settings(t, s.params["base"], s.dev)[0].config(s.params["base"].seed, job.train)

    def make(b: int) -> Callable[[], None]:
        g = rng.generator(s.seed, "cpu")
        ids = torch.randint(1, VOCAB, (b, t.max_len), generator=g)
        sentences = {"ids": ids, "mask": torch.ones_like(ids, dtype=torch.bool),
                     "y": torch.randint(0, 2, (b,), generator=g)}

        def step() -> None:
            states = frozen_states(model, sentences, s.dev, batch_size=b)
            _runner(model, cfg.steps(model, states, s.dev), cfg, s)()
        return step
    return Prepared(sum(p.numel() for p in model.parameters()), [t.max_len], t.cert_batch_size,
                    make)


def grid_vit(s: Setup) -> Prepared:
    """train_vit: the grid's largest Lipschitz ViT on a 32-pixel colour dataset, trained with
    ``train_vit.train``'s margin; once: the float64 lofast_M certificate of four points."""
    from attncert.grid.params import model_config
    g, tv, cv = s.params["vit_grid"], s.params["train_vit"], s.params["certify_vit"]
    data = stand_in(ds := next((d for d in g.dataset if DATASETS[d][:2] == (3, 32)), "cifar10"))
    point = GridPoint(g.results_dir, ds, max(g.depth), max(g.heads), g.gamma_vo[0])
    torch.manual_seed(s.seed)
    model = build_vit(model_config(tv, point, data))

    def once(_b: int) -> str:
        x = random_images(model.config, 4, torch.float64)[0].to(s.dev)
        m = model.double().eval()
        with torch.no_grad():
            y = m(x).argmax(1)
        t0 = time.perf_counter()
        certify_table(m, x, y, ["lofast_M"], ["pairwise"], cv.softmax_lipschitz, cv.max_radius,
                      4, progress=False)
        return f"certificate lofast_M (float64, 4 points): {time.perf_counter() - t0:.2f} s"
    return _image_kind(model, tv.train.config(s.seed), data, s, once)


def crown_kind(depth: int, s: Setup) -> Prepared:
    """crown: the stage's Lipschitz ViT at ``depth`` in ``crown.bound_dtype`` and the CROWN
    bounds of one call at the smallest ``crown.cert_eps`` on ``crown.batch_size`` random
    points (the batch the stage starts at; halved while it does not fit)."""
    from attncert.crown.bridge import CrownCertifier, certify_batch
    from attncert.crown.study import vit_config
    c = s.params["crown"]
    dtype, data = getattr(torch, c.bound_dtype), stand_in(c.datasets[0])
    torch.manual_seed(s.seed)
    cfg = vit_config(data, c, depth)
    model = build_vit(cfg).to(device=s.dev, dtype=dtype).eval()
    x = random_images(cfg, c.batch_size, dtype)[0].to(s.dev)
    with torch.no_grad():
        y = model(x).argmax(-1)
    cert = CrownCertifier.from_vit(model, x.shape[1:], dtype)

    def step(b: int) -> None:
        rows = certify_batch(cert, x[:b], y[:b], min(c.cert_eps), "crown", c.time_limit,
                             c.alpha_iterations)
        if bad := [r for r in rows if r["status"] not in ("ok", "overflow")]:
            why = f"CROWN bound {bad[0]['status']}: {bad[0].get('error', '')}"
            raise (MemoryError if bad[0]["status"] == "out_of_memory" else RuntimeError)(why)
    return Prepared(sum(p.numel() for p in model.parameters()), list(x.shape[1:]),
                    c.batch_size, lambda b: ft.partial(step, b), steps=1)


#: every kind of the rehearsal, in run order
KINDS: dict[str, Builder] = {
    "certvit_vit_b16": certvit_vit_b16,
    "specformer_vit_s16": ft.partial(specformer_kind, "WinKawaks/vit-small-patch16-224"),
    "specformer_deit_ti": ft.partial(specformer_kind, "facebook/deit-tiny-patch16-224"),
    "text_bert_base": text_bert_base,
    "grid_vit": grid_vit,
    **{f"crown_L{d}": ft.partial(crown_kind, d) for d in (3, 4, 5)},
}


def _peak(gb: float) -> float:
    """A peak in GB rounded up to 0.01: a kind stopped past the cap is never recorded at it."""
    return math.ceil(round(gb * 100, 6)) / 100


def _memory_gb(pid: int | str = "self", field: str = "VmHWM") -> float:
    """A process's peak (VmHWM) or current (VmRSS) resident memory in GB; 0 where unknown."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
        return next(int(ln.split()[1]) * 1024 / GB for ln in lines if ln.startswith(field))
    except (OSError, ValueError, StopIteration):
        return 0.0


def _child(conn, builder: Builder, setup: Setup, batch: int | None, steps: int) -> None:
    """Build the kind, run its steps at ``batch`` (None: its own), send what happened."""
    out: dict[str, Any] = {}
    try:
        prep = builder(setup)
        b = batch or prep.batch
        out.update(parameters=prep.parameters, input_shape=prep.input_shape,
                   batch_requested=prep.batch, batch_used=b, steps=prep.steps or steps)
        conn.send(dict(out))  # what it is, should the steps never end
        step, times = prep.make(b), []
        for _ in range(out["steps"]):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out.update(status="ok", seconds_per_step=round(statistics.median(times), 3),
                   note=prep.once(b) if prep.once else "")
        if setup.dev.type == "cuda":  # the steps' and the once-pass's peak allocation
            out["gpu_peak_gb"] = _peak(torch.cuda.max_memory_allocated(setup.dev) / GB)
    except BaseException as exc:  # noqa: BLE001 (every failure is the kind's result)
        first = (str(exc).strip().splitlines() or [""])[0]
        oom = isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
            isinstance(exc, RuntimeError) and "alloc" in first.lower())  # CPU allocator
        out.update(status="oom" if oom else "error", error=f"{type(exc).__name__}: {first}"[:300])
    conn.send(out | {"host_peak_gb": _memory_gb()})


def run_kind(name: str, builder: Builder, setup: Setup, steps: int = 2, max_gb: float = 22.0,
             timeout_s: float = 600.0) -> dict[str, Any]:
    """Rehearse one kind in spawned tries under the watchdog, halving the batch while it does
    not fit in ``max_gb`` of resident memory; its record (:data:`COLUMNS`)."""
    row: dict[str, Any] = dict.fromkeys(COLUMNS) | {"kind": name, "steps": steps}
    ctx, batch, why = mp.get_context("spawn"), None, []
    while True:
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_child, args=(send, builder, setup, batch, steps), daemon=True)
        t0, peak, stopped, out = time.perf_counter(), 0.0, "", {}
        proc.start()
        send.close()
        while proc.is_alive() or recv.poll():
            try:
                if recv.poll(0.05):
                    out.update(recv.recv())
            except EOFError:
                break
            peak = max(peak, _memory_gb(proc.pid, "VmRSS"))
            if not stopped and peak > max_gb:
                stopped = f"resident memory passed {max_gb:g} GB"
            elif not stopped and time.perf_counter() - t0 > timeout_s:
                stopped = f"no result within {timeout_s:g} s"
            if stopped and proc.is_alive():
                proc.kill()
        proc.join()
        if "status" not in out and not stopped:  # SIGKILL from outside: the kernel's OOM killer
            code = proc.exitcode or 0
            out.update(status="oom" if code == -9 else "error",
                       error=f"killed by signal {-code}" if code < 0 else f"exited {code}")
        row.update({k: v for k, v in out.items() if k in COLUMNS[:-2]})
        row["host_peak_gb"] = _peak(max(peak, out.get("host_peak_gb", 0.0)))
        b = row["batch_used"]
        if stopped.startswith("resident") or out.get("status") == "oom":
            why.append(f"batch {b} does not fit ({stopped or out.get('error')})")
            if b and b > 1:
                batch = b // 2
                continue
            status = f"does not fit {max_gb:g} GB"
        elif (status := out.get("status")) != "ok":
            status = f"error: {stopped or out.get('error', 'unknown')}"
        return row | {"status": status, "note": "; ".join(why + [out.get("note") or ""])
                      .strip("; ")}


def load_paper_params(path: str | Path = PARAMS_FILE) -> StudyParams:
    """params.yaml validated; a ParamsError unless it is the paper scale."""
    raw = read_yaml(path)
    scale = (raw or {}).get("base", {}).get("scale")
    if scale != "paper":
        raise ParamsError(f"{path}: base.scale is {scale!r}; the rehearsal needs the paper "
                          "scale (`make pipeline SCALE=paper` restores it) or --params FILE")
    from attncert.stages.registry import validate  # every stage's module: seconds
    return validate(raw, str(path))


def rehearse(kinds: Mapping[str, Builder], setup: Setup, out: str | Path | None = None,
             steps: int = 2, max_gb: float = 22.0, timeout_s: float = 600.0,
             source: str | Path = PARAMS_FILE) -> dict[str, Any]:
    """Each kind in turn, with progress; the record, written atomically to ``out`` per kind."""
    memory = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB, 1)
    record = {"date": datetime.date.today().isoformat(), "params": str(source), "max_gb": max_gb,
              "machine": {"cpus": os.cpu_count(), "memory_gb": memory, "device": str(setup.dev)},
              "rows": []}
    for i, (name, builder) in enumerate(kinds.items(), 1):
        print(f"[{i}/{len(kinds)}] {name}: starting", flush=True)
        t0 = time.perf_counter()
        record["rows"].append(r := run_kind(name, builder, setup, steps, max_gb, timeout_s))
        timed = f", batch {r['batch_used']}, {r['seconds_per_step']} s/step" * (r["status"] == "ok")
        print(f"[{i}/{len(kinds)}] {name}: {r['status']}{timed}, peak {r['host_peak_gb']} GB "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
        if out is not None:
            write_json(out, record)
    return record


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring): 0 after the run, 2 on bad input, before any work."""
    ap = argparse.ArgumentParser(prog="python -m attncert.pipeline.rehearse",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the record here (JSON)")
    ap.add_argument("--kinds", default="", help=f"comma-separated, of: {', '.join(KINDS)}")
    ap.add_argument("--steps", type=int, default=2, help="steps per kind (median time)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-gb", type=float, default=22.0, help="resident memory cap per kind")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per try of a kind")
    ap.add_argument("--params", default=PARAMS_FILE)
    args = ap.parse_args(argv)
    try:
        names = [k for k in args.kinds.split(",") if k] or list(KINDS)
        if unknown := [n for n in names if n not in KINDS]:
            raise ValueError(f"unknown kind(s) {', '.join(unknown)}; known: {', '.join(KINDS)}")
        if args.steps < 1 or args.max_gb <= 0 or args.timeout <= 0:
            raise ValueError("--steps, --max-gb and --timeout must be positive")
        params = load_paper_params(args.params)
        setup = Setup(params, resolve_device(args.device), params["base"].seed)
    except ValueError as exc:  # ParamsError included
        print(f"rehearse: error: {exc}", file=sys.stderr)
        return 2
    print(f"rehearsal of {len(names)} kind(s): params {args.params}, device {setup.dev}, cap "
          f"{args.max_gb:g} GB", flush=True)
    record = rehearse({n: KINDS[n] for n in names}, setup, args.out, args.steps, args.max_gb,
                      args.timeout, args.params)
    print("\n".join("| " + " | ".join("" if r[c] is None else str(r[c]) for c in COLUMNS) + " |"
                    for r in [{c: c for c in COLUMNS}, dict.fromkeys(COLUMNS, "---"),
                              *record["rows"]]))  # the record as a Markdown table
    return 0


if __name__ == "__main__":
    sys.exit(main())
