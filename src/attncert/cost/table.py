"""The cost table: every stage's work items summed into PFLOP and GPU-hours per stage."""

from __future__ import annotations

import dataclasses
import math

from attncert.cost.counting import (
    GPU,
    UTILISATION,
)
from attncert.cost.graphs import estimated_speedups
from attncert.cost.pricing import crown_bound_seconds, priced
from attncert.cost.work import GPU_MEMORY, Work
from attncert.stages import STAGES  # the pipeline's stages, one list


def stage_work(params, stages=STAGES) -> tuple[list[Work], float]:
    """The work items of ``stages`` at ``params`` (a
    :class:`attncert.pipeline.params.StudyParams`): every stage's jobs
    (:func:`attncert.stages.registry.stage_jobs`) priced, the audits' batches
    grown to ``base.batch_memory`` of a GPU's memory; and CROWN's upper bound in seconds
    (bounds x time limit; 0 without the crown stage)."""
    from attncert.stages.registry import stage_jobs  # every stage's module: seconds

    work = priced(stage_jobs(params, stages), params["base"].batch_memory)
    return work, sum(w.fixed_seconds for w in work if w.stage == "crown")


def _kernel_note(gpu: GPU) -> str:
    """The per-kernel constants the table used: one, or each model kind's and stage's."""
    if not gpu.kernel_seconds_by_stage and not gpu.kernel_seconds_by_kind:
        return f"{gpu.kernel_seconds * 1e6:.2g} us per kernel"
    kinds = ", ".join(f"{k} {v * 1e6:.2g}" for k, v in gpu.kernel_seconds_by_kind)
    stages = ", ".join(f"{s} {v * 1e6:.2g}" for s, v in gpu.kernel_seconds_by_stage)
    return (f"per kernel the constant measured on the model kind a work item runs ({kinds} us), "
            f"else on the kind its stage trains ({stages} us), else the largest, "
            f"{gpu.kernel_seconds * 1e6:.2g} us")


def _graphs_note(gpu: GPU, work: list[Work]) -> str:
    """Which training step kinds count their measured CUDA-graph speed-up, and which of the
    kinds ``work`` trains count eager for want of a measurement."""
    if not gpu.graphs_speedup:
        return ("no CUDA-graph speed-up counted (`base.compile` neither `auto` nor `graphs`, "
                "or no measurement)")
    per = ", ".join(f"{k} {v:.2g}x" for k, v in gpu.graphs_speedup)
    measured = dict(gpu.graphs_speedup)
    eager = sorted({w.graphs for w in work if w.graphs and w.graphs not in measured})
    return (f"training steps replayed as CUDA graphs (`base.compile`), each kind's kernels at "
            f"its measured speed-up ({per}; measured: {gpu.graphs_source}); the rest eager: "
            f"the kinds not yet measured under graphs ({'; '.join(eager) or 'none'}), "
            f"training runs and audits of no bench kind, evaluations and certificates")


def _growth_note(params) -> str:
    """How the audits' batches are counted (``base.batch_memory``)."""
    share = params["base"].batch_memory
    if not share:
        return "; every batch at its section's size (`base.batch_memory` 0)"
    return (f"; the PGD audits, the certificate passes and the attention diagnostics in the "
            f"batches `base.batch_memory` ({share:g}) grows on an {GPU_MEMORY / 1e9:.0f} GB "
            f"GPU (an audit's one size for all radii), from a bound of a point's bytes (the "
            f"bytes the audit step's, the forward's and the diagnostics' kernels output, the "
            f"most the certificate terms hold at once) and the text models' LoFAST "
            f"certificates at their batches, one loop per sentence length")


def _pilot_note(gpu: GPU) -> str:
    if not gpu.pilot_by_stage:
        return ""
    per = ", ".join(f"{s} {v:.2g}x" for s, v in gpu.pilot_by_stage)
    return f"; each stage's time times its measured / estimated in {gpu.pilot_source} ({per})"


def _estimated_row(work: list[Work], gpu: GPU, utilisation: float, total: float) -> list[str]:
    """A row for the total with the step kinds not yet measured under CUDA graphs at an
    estimated speed-up (:func:`attncert.cost.graphs.estimated_speedups`); none without any."""
    est = estimated_speedups(gpu, (w.graphs for w in work))
    if not est:
        return []
    alt = dataclasses.replace(gpu, graphs_speedup=gpu.graphs_speedup + est)
    hours = sum(w.seconds(alt, utilisation) for w in work) / 3600
    per = "; ".join(f"{k} {v:.2g}x" for k, v in est)
    return [f"| total, the unmeasured kinds estimated | - | {hours:.3g} | | an estimate, not "
            f"the total: {total - hours:.3g} h less if each step kind not yet measured under "
            f"CUDA graphs gained as the measured kind it extends does (a PGD training or audit "
            f"step and the lofast margin's whole compiled loss as its model's training step, "
            f"an added MSVP penalty no more than MSVP's, "
            f"OLSA's text models and the frozen-encoder head as the slowest measured text kind): "
            f"{per} |"]


def cost_table(params, gpu: GPU, utilisation: float = UTILISATION) -> str:
    """The cost table of docs/cost.md: GPU-hours per stage and the total, with the method in
    one line."""
    work, crown_seconds = stage_work(params)
    hours = {s: 0.0 for s in STAGES}
    pflop = {s: 0.0 for s in STAGES}
    bound_by = {s: set() for s in STAGES}
    for w in work:
        sec = w.seconds(gpu, utilisation)
        hours[w.stage] += sec / 3600
        pflop[w.stage] += w.flops / 1e15
        if w.flops:
            flop_s = w.flops / (getattr(gpu, w.kind) * utilisation)
            bound_by[w.stage].add("kernels" if w.kernel_seconds(gpu) > flop_s else "FLOPs")
    g = params["vit_grid"]
    points = len(g.dataset) * len(g.depth) * len(g.heads) * len(g.gamma_vo)
    notes = {s: f"{points} grid points, {hours[s] / points:.2g} h each"
             for s in ("train_vit", "certify_vit")}
    notes |= {"data": "CPU (downloads)", "figures": "CPU"}
    tv = params["train_vit"]
    if tv.train.margin != "lofast":  # the option: the grid trained with the bound
        alt = type(params)({**params.sections, "train_vit": dataclasses.replace(
            tv, train=dataclasses.replace(tv.train, margin="lofast", lofast_eps=1.0))})
        lofast_h = sum(w.seconds(gpu, utilisation)
                       for w in stage_work(alt, ("train_vit",))[0]) / 3600
        notes["train_vit"] += (f"; {lofast_h:.3g} h with `train_vit.train.margin: lofast` "
                               f"(certified training with the local bound)")
    f = params["frontier"]
    notes["frontier"] = (f"{len(f.datasets)} datasets x {len(f.settings)} settings: margins, "
                         f"the attention axes, the standard ViT and the linear baselines")
    lines = ["| stage | PFLOP (counted) | GPU-hours | bound by | note |", "|---|---|---|---|---|"]
    for s in STAGES:
        lines.append(f"| {s} | {pflop[s]:.3g} | {hours[s]:.3g} | "
                     f"{', '.join(sorted(bound_by[s])) or '-'} | {notes.get(s, '')} |")
    total = sum(hours.values())
    lines.append(f"| **total** | {sum(pflop.values()):.3g} | **{total:.3g}** | | |")
    lines += _estimated_row(work, gpu, utilisation, total)
    c = params["crown"]
    budget = (f", each method capped by crown.time_budget {c.time_budget / 3600:.3g} h a unit"
              if c.time_budget else "")
    skip = ("; points LoFAST certifies skip CROWN (crown.skip_lofast_certified), so fewer run"
            if c.skip_lofast_certified else "")
    if c.cascade:
        skip += ("; alpha-CROWN only where CROWN did not certify (crown.alpha_after_crown), so "
                 "its budget goes to the pairs left")
    per = []
    for m in c.methods:
        secs = [(d, *crown_bound_seconds(d, m, batch=c.batch_size)) for d in c.depths]
        per.append(f"{m} " + ", ".join(f"L{d} {'-' if math.isnan(v) else f'{v:.3g}'} s"
                                       for d, v, _ in secs)
                   + f" ({'; '.join(sorted({how for _, _, how in secs}))})")
    lines.append(f"| of which crown: CROWN / alpha-CROWN bounds | - | at most "
                 f"{crown_seconds / 3600:.3g} | bounds | in the crown row and the total, "
                 f"at their worst: {len(c.datasets)} datasets x {len(c.depths)} depths (one "
                 f"unit each) x {c.n_test} points x {len(c.cert_eps)} eps x {len(c.methods)} "
                 f"methods, each bound at its seconds at the paper shape on a GPU, "
                 f"{c.batch_size} points a call (crown.batch_size) "
                 f"({'; '.join(per)}; `python -m attncert.cost crown`; unmeasured or past it: "
                 f"the time limit {c.time_limit:g} s){budget}{skip} |")
    head = (f"Scale `{params['base'].scale}`; one {gpu.name} at {utilisation:.0%} of its dense "
            f"peak per precision (bf16 {gpu.bf16 / 1e12:.0f}, TF32 {gpu.tf32 / 1e12:.0f}, "
            f"FP32 {gpu.fp32 / 1e12:.0f}, FP64 {gpu.fp64 / 1e12:.0f} TFLOP/s) and "
            f"{_kernel_note(gpu)}"
            f"{f' (measured: {gpu.calibration})' if gpu.calibration else ' (not measured)'}; "
            f"{_graphs_note(gpu, work)}{_growth_note(params)}{_pilot_note(gpu)}; generated by "
            "`python -m attncert.cost readme`.")
    return head + "\n\n" + "\n".join(lines)
