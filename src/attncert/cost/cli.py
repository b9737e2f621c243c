"""Cost of the study at the scale of a params file: GPU-hours per stage, and training step times.

The command line (``python -m attncert.cost table | readme | bench | crown | plan | order``) and the
blocks of ``docs/cost.md`` (:data:`COST_DOC`) that ``readme`` rewrites between the cost markers
and the plan markers.
"""

from __future__ import annotations

import argparse
import datetime
from pathlib import Path

import torch

from attncert.cost.bench import (
    COMPILE_MODES,
    CONCURRENCY_KIND,
    bench_audits,
    bench_concurrency,
    bench_margins,
    bench_training,
    merge_concurrency_bench,
)
from attncert.cost.calibrate import (
    CALIBRATION_FILE,
    COMMITTED_CALIBRATION,
    calibrated,
    calibration_path,
    recount,
)
from attncert.cost.counting import (
    GPUS,
    UTILISATION,
)
from attncert.cost.graphs import (
    COMPILE_BENCH,
    PILOT_RECORD,
    compile_rows,
    merge_compile_bench,
    with_graphs,
    with_pilot,
)
from attncert.cost.kinds import bench_models
from attncert.cost.plan import CONCURRENCY_BENCH
from attncert.cost.pricing import CROWN_BENCH
from attncert.cost.table import cost_table

# -- command line -----------------------------------------------------------------------------

#: the page that holds the cost table's and the multi-GPU plan's generated blocks
COST_DOC = "docs/cost.md"
MARKERS = ("<!-- cost:start -->", "<!-- cost:end -->")
#: the multi-GPU plan's block (``python -m attncert.cost readme`` writes both)
PLAN_MARKERS = ("<!-- plan:start -->", "<!-- plan:end -->")


def write_block(table: str, doc: str | Path = COST_DOC,
                markers: tuple[str, str] = MARKERS) -> None:
    """Replace the block of ``doc`` (default :data:`COST_DOC`) between ``markers`` by
    ``table``."""
    from attncert.report.readme import replace_section

    path = Path(doc)
    try:
        path.write_text(replace_section(path.read_text(), table, *markers))
    except ValueError as exc:
        raise ValueError(f"{path}: the markers {' / '.join(markers)}: {exc}") from None


def cuda_name(device: str) -> str | None:
    """The name of the GPU ``device`` resolves to (``auto``: the current one), None when it
    is not a CUDA device."""
    from attncert.pipeline.device import resolve_device

    dev = resolve_device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else None


#: ``bench --kinds``'s name for the grid's Lipschitz ViT timed under each training margin
MARGINS = "margins"


def step_kinds(params) -> list[str]:
    """The single-step bench's kinds in the order it times them: every model kind, SpecFormer's
    two under PGD training, the PGD audit step of each kind of
    :data:`attncert.cost.bench.AUDIT_KINDS` (then :data:`MARGINS`)."""
    from attncert.cost.bench import ADVERSARIAL_KEYS, AUDIT_KEYS

    return [*bench_models(params), *ADVERSARIAL_KEYS, *AUDIT_KEYS]


def _child(params_path: str, fn: str, args: tuple, modes: list[str], kwargs: dict,
           queue) -> None:
    """In a process of its own: ``attncert.cost.bench.<fn>(params, *args, mode=m, **kwargs)``
    for each mode ``m`` of ``modes``, each result sent as it is in."""
    import attncert.cost.bench as bench
    from attncert.stages.registry import load_params

    params = load_params(params_path)
    for mode in modes:
        try:
            queue.put((mode, getattr(bench, fn)(params, *args, mode=mode, **kwargs), ""))
        except BaseException as exc:  # noqa: BLE001 (reported to the parent, which goes on)
            queue.put((mode, None, f"{type(exc).__name__}: {exc}"[:200]))


def isolated(params_path: str, fn: str, args: tuple, modes: list[str], **kwargs
             ) -> dict[str, tuple[list[dict] | None, str]]:
    """Per mode of ``modes``: (``attncert.cost.bench.<fn>``'s rows, "") or (None, why it
    failed), all modes in one fresh process: a CUDA-graph capture that fails leaves the
    process's CUDA state (its random-number offsets) broken for every kind after it. A mode not
    reached when the process dies gets (None, its exit code)."""
    import multiprocessing as mp
    import queue as queues

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_child, args=(params_path, fn, args, list(modes), kwargs, q))
    proc.start()
    out: dict[str, tuple[list[dict] | None, str]] = {}
    try:
        while len(out) < len(modes):  # read before joining: a large result blocks the child
            try:
                mode, rows, why = q.get(timeout=5)
                out[mode] = (rows, why)
            except queues.Empty:
                if not proc.is_alive():
                    proc.join()
                    why = f"its process exited with code {proc.exitcode}"
                    return out | {m: (None, why) for m in modes if m not in out}
    finally:
        proc.join()
    return out


def _bench_steps(params, args, kinds: list[str], gpu_name: str | None) -> None:
    """Time each of ``kinds`` in every mode of ``args.modes``, one kind after another, and
    with ``--write-compile`` merge each kind's eager and CUDA-graph times as soon as both are
    measured, so a run stopped part-way keeps the kinds that finished. On CUDA (or with
    ``--isolate``) each kind runs in a process of its own (:func:`isolated`)."""
    from attncert.cost.bench import ADVERSARIAL_KEYS, AUDIT_KEYS
    from attncert.pipeline.device import resolve_device, resolve_precision

    b, dev = args.batch, args.device
    alone = args.isolate or resolve_device(dev).type == "cuda"
    local = {"bench_margins": bench_margins, "bench_audits": bench_audits,
             "bench_training": bench_training}

    def run(kind: str, fn: str, **kwargs) -> dict[str, list[dict]]:
        """Per mode, the rows of ``fn`` (a failure: the kind's row with why, no speed-up)."""
        if not alone:
            return {m: local[fn](params, b, args.steps, dev, mode=m, **kwargs)
                    for m in args.modes}
        out = {}
        for mode, (rows, why) in isolated(args.params, fn, (b, args.steps, dev), args.modes,
                                          **kwargs).items():
            if rows is None and kind == MARGINS:
                print(f"{kind:>48} {mode:>7} failed: {why}", flush=True)
            nan = float("nan")
            out[mode] = rows if rows is not None else [] if kind == MARGINS else [
                {"model": kind, "status": why, "ms_per_step": nan, "first_step_s": nan,
                 "parameters": 0, "shape": "-", "device": dev, "precision": "-"}]
        return out

    print(f"one step at batch {b} per kind and mode, {torch.get_num_threads()} threads: a "
          f"training step (forward, backward, AdamW; under PGD training its attack too), an "
          f"audit's attack step (its float32 copy), the grid's Lipschitz ViT per margin")
    print(f"{'kind':>48} {'mode':>7} {'ms/step':>9} {'first s':>8} {'params':>11}  shape")
    for kind in kinds:
        rows, margins = {}, {}
        if kind == MARGINS:
            margins = run(kind, "bench_margins")
        elif kind in AUDIT_KEYS:
            rows = run(kind, "bench_audits", only=(kind,))
        else:
            rows = run(kind, "bench_training", only=(kind,), adversarial=kind in ADVERSARIAL_KEYS)
        for mode, ms in margins.items():
            for r in ms:
                name = f"margin {r['margin']}"
                print(f"{name:>48} {mode:>7} {r['ms_per_step']:9.1f} "
                      f"{r['first_step_s']:8.1f} {'':>11}  {r['vs_lmt']:.2f}x LMT's step"
                      + (f"  {r['status']}" if r["status"] != "ok" else ""), flush=True)
        for mode, rs in rows.items():
            for r in rs:
                print(f"{r['model']:>48} {mode:>7} {r['ms_per_step']:9.1f} "
                      f"{r['first_step_s']:8.1f} {r['parameters']:11,}  {r['shape']}, "
                      f"{r['device']}, {r['precision']}"
                      + (f"  {r['status']}" if r["status"] != "ok" else ""), flush=True)
        if args.write_compile and (measured := compile_rows(rows, margins)):
            merge_compile_bench(args.write_compile, measured, gpu_name,
                                datetime.date.today().isoformat(), torch.__version__, b,
                                resolve_precision("auto", resolve_device(dev)))


def main(argv: list[str] | None = None) -> int:
    from attncert.pipeline.params import ParamsError
    from attncert.stages.registry import load_params

    ap = argparse.ArgumentParser(prog="python -m attncert.cost",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["table", "readme", "bench", "crown", "plan", "order",
                                        "recount"],
                    help=f"table: print the cost table; readme: rewrite the cost table's and "
                         f"the plan's blocks of {COST_DOC} (--doc) and print the table; bench: "
                         "time a training step of every model kind; crown: time CROWN bounds; "
                         "plan: schedule the units on --gpus; order: the units on stdin, "
                         "longest first; recount: divide the calibration's measured step times "
                         "(--calibration, measured at --params) by the current kernel count")
    ap.add_argument("--doc", default=COST_DOC,
                    help="readme: the page whose blocks between the cost and the plan markers "
                         f"are rewritten (default {COST_DOC})")
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    ap.add_argument("--utilisation", type=float, default=UTILISATION)
    ap.add_argument("--batch", type=int, default=32, help="bench: batch size")
    ap.add_argument("--steps", type=int, default=5, help="bench: timed steps per model")
    ap.add_argument("--device", default="auto", help="bench, crown: auto | cpu | cuda ...")
    ap.add_argument("--modes", nargs="+", default=["eager"], choices=COMPILE_MODES,
                    help="bench: eager, compile (torch.compile), graphs (and CUDA graphs)")
    ap.add_argument("--concurrent", type=int, nargs="+", default=None, metavar="K",
                    help="bench: also K processes training one model kind on the device at once")
    ap.add_argument("--concurrent-only", action="store_true",
                    help="bench --concurrent: only the K-process runs (no single-step tables)")
    ap.add_argument("--kinds", nargs="+", default=None, metavar="KIND",
                    help="bench: these kinds (the bench's names, 'margins', or 'all'; default: "
                         "all); with --concurrent the model kinds run K at once (default: the "
                         "grid's Lipschitz ViT)")
    ap.add_argument("--isolate", action="store_true",
                    help="bench: each kind in a process of its own (always on CUDA)")
    ap.add_argument("--write-compile", metavar="PATH", nargs="?", const=COMPILE_BENCH,
                    default=None,
                    help=f"bench with --modes eager graphs: merge each step kind's eager and "
                         f"CUDA-graph times into PATH (default {COMPILE_BENCH}, which the cost "
                         "table reads)")
    ap.add_argument("--write-concurrency", metavar="PATH", nargs="?", const=CONCURRENCY_BENCH,
                    default=None,
                    help=f"bench --concurrent: merge the rows into PATH (default "
                         f"{CONCURRENCY_BENCH}, which the plan reads per model kind)")
    ap.add_argument("--points", type=int, default=2, help="crown: points bounded per method")
    ap.add_argument("--bound-batch", type=int, default=1, metavar="B",
                    help="crown: points bounded together by one call (crown.batch_size)")
    ap.add_argument("--methods", nargs="+", default=None,
                    help="crown: these of crown.methods (default: all)")
    ap.add_argument("--depths", type=int, nargs="+", default=None,
                    help="crown: these of crown.depths (default: all)")
    ap.add_argument("--count-kernels", action="store_true",
                    help="crown: count the kernels a call launches (on the CPU, a narrow copy) "
                         "instead of timing it")
    ap.add_argument("--split-heads", action="store_true",
                    help="crown: the graph with one branch per head (the form measured before "
                         "2026-11-29) instead of the bridge's batched heads")
    ap.add_argument("--write", metavar="PATH", nargs="?", const=CROWN_BENCH, default=None,
                    help=f"crown: merge the rows into PATH (default {CROWN_BENCH}, which the "
                         "cost table reads), each replacing the row of its device type, depth, "
                         "method, batch and graph (--count-kernels: its kernels)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="plan: GPU counts to schedule the units on")
    ap.add_argument("--per-gpu", type=int, default=1, metavar="K",
                    help="plan, readme: K units sharing each GPU (scripts/repro-gpus --per-gpu K)")
    ap.add_argument("--calibration", default=None,
                    help=f"the per-kernel constant's measurement (default: {CALIBRATION_FILE} "
                         f"of make gpu-check, else the committed {COMMITTED_CALIBRATION})")
    ap.add_argument("--pilot", default=PILOT_RECORD,
                    help=f"the pilot's record, its calibration per unit kind (default "
                         f"{PILOT_RECORD} when it exists; make pilot)")
    args = ap.parse_args(argv)
    if not 0 < args.utilisation <= 1:
        ap.error("--utilisation must be in (0, 1]")
    if args.per_gpu != 1 and args.command in ("plan", "readme"):
        from attncert.cost.plan import slowdown

        try:
            slowdown(args.per_gpu)
        except ValueError as exc:
            ap.error(f"--per-gpu: {exc}")
    if not Path(args.params).is_file():
        ap.error(f"--params {args.params}: no such file")
    try:
        params = load_params(args.params)
    except ParamsError as exc:  # a missing or bad key: named, not a traceback
        ap.error(f"--params {args.params}: {exc}")
    if args.command == "recount":
        path = calibration_path(args.calibration)
        if not path.is_file():
            ap.error(f"recount: {path}: no such file")
        try:
            record = recount(params, path)
        except ValueError as exc:
            ap.error(f"recount: {exc}")
        refused = record["recount_refused"]
        print(f"{path}: recounted with kernel count version {record['counting']}; the largest "
              f"constant {record['kernel_seconds'] * 1e6:.3g} us per kernel ({record['from']})"
              + "".join(f"\n  not recounted, measure again (make gpu-check): {m}: {why}"
                        for m, why in refused.items()))
        return 0
    gpu = None  # the cost model's GPU: the commands that measure need none
    if args.command not in ("bench", "crown"):
        try:
            gpu = with_pilot(with_graphs(calibrated(GPUS[args.gpu], args.calibration), params),
                             args.pilot)
        except ValueError as exc:  # a calibration counted with another kernel count
            ap.error(f"--calibration: {exc}")
    if args.command == "bench" and args.write_compile and (
            not {"eager", "graphs"} <= set(args.modes) or args.concurrent_only):
        ap.error("--write-compile: needs --modes eager graphs (and the single-step tables)")
    for flag, given in (("--concurrent-only", args.concurrent_only),
                        ("--write-concurrency", args.write_concurrency)):
        if args.command == "bench" and given and not args.concurrent:
            ap.error(f"{flag}: needs --concurrent K ...")
    gpu_name = None
    if args.command == "bench" and (args.write_compile or args.write_concurrency):
        gpu_name = cuda_name(args.device)
        if gpu_name is None:
            ap.error("--write-compile, --write-concurrency: the records hold CUDA measurements; "
                     f"--device {args.device} is not a GPU")
    if args.command == "bench":
        models, steps = list(bench_models(params)), step_kinds(params)
        every = [*steps, MARGINS]
        chosen = every if args.kinds in (None, ["all"]) else args.kinds
        if unknown := [k for k in chosen if k not in every]:
            ap.error(f"--kinds: {unknown[0]!r}; one of {', '.join(every)}, all")
        concurrent = (models if args.kinds == ["all"] else args.kinds or [CONCURRENCY_KIND])
        if args.concurrent and (unknown := [k for k in concurrent if k not in models]):
            ap.error(f"--kinds with --concurrent: {unknown[0]!r} is no model kind; one of "
                     f"{', '.join(models)}, all")
        if not args.concurrent_only:
            _bench_steps(params, args, chosen, gpu_name)
        for mode in args.modes if args.concurrent else ():
            for kind in concurrent:
                print(f"\nK processes training {kind} at once, {mode}")
                print(f"{'K':>3} {'ms/step':>9} {'steps/s':>8} {'x K=1':>6}")
                rows = bench_concurrency(params, args.batch, tuple(args.concurrent),
                                         args.steps, args.device, mode, kind)
                for r in rows:
                    print(f"{r['k']:>3} {r['ms_per_step']:9.1f} {r['steps_per_s']:8.1f} "
                          f"{r['speedup']:6.2f}", flush=True)
                if args.write_concurrency:
                    merge_concurrency_bench(args.write_concurrency, rows, gpu_name,
                                            datetime.date.today().isoformat(),
                                            torch.__version__)
        return 0
    if args.command == "crown" and args.count_kernels:
        from attncert.cost.crown_bench import count_crown_kernels, merge_crown_kernels

        print(f"kernels of one call bounding {args.bound_batch} points of the crown stage's ViT")
        print(f"{'depth':>5} {'method':>12} {'graph':>14} {'kernels':>10}")
        for r in count_crown_kernels(params, args.methods, args.depths, args.bound_batch,
                                     args.split_heads):
            print(f"{r['depth']:>5} {r['method']:>12} {r['graph']:>14} {r['kernels']:>10}",
                  flush=True)
            if args.write:
                merge_crown_kernels(args.write, [r])
        return 0
    if args.command == "crown":
        print(f"one CROWN bound (point x eps) of the crown stage's ViT, {args.points} points, "
              f"{args.bound_batch} a call")
        print(f"{'depth':>5} {'method':>12} {'tokens':>6} {'build s':>8} {'s/bound':>8} "
              f"{'peak GB':>7}  status")
        from attncert.cost.crown_bench import bench_crown, merge_crown_bench

        for r in bench_crown(params, args.device, args.points, args.methods, args.depths,
                             args.bound_batch, args.split_heads):
            print(f"{r['depth']:>5} {r['method']:>12} {r['tokens']:>6} "
                  f"{r['build_seconds']:8.2f} {r['seconds_per_bound']:8.2f} "
                  f"{r['peak_gb']:7.1f}  {r['status']}", flush=True)
            if args.write:  # row by row: an out-of-memory kill keeps what finished
                merge_crown_bench(args.write, [r])
        return 0
    torch.set_num_threads(max(1, min(torch.get_num_threads(), 2)))
    if args.command == "plan":
        from attncert.cost.plan import plan_table

        print(plan_table(params, gpu, args.gpus, args.utilisation, args.per_gpu))
        return 0
    if args.command == "order":  # scripts/repro-gpus: its units (stdin) longest first
        import sys

        from attncert.cost.plan import order

        units = [line.strip() for line in sys.stdin if line.strip()]
        print("\n".join(order(units, params, gpu, args.utilisation)))
        return 0
    table = cost_table(params, gpu, args.utilisation)
    if args.command == "readme":
        from attncert.cost.plan import plan_table

        write_block(table, args.doc)
        write_block(plan_table(params, gpu, args.gpus, args.utilisation, args.per_gpu), args.doc,
                    markers=PLAN_MARKERS)
    print(table)
    return 0
