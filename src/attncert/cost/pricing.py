"""The stages' jobs priced: each phase of a job (:mod:`attncert.pipeline.jobs`) as the
:class:`~attncert.cost.work.Work` items the cost table and the plan sum, counted on the job's
model at its shape (FLOPs and kernels, :mod:`attncert.cost.counting`); CROWN's bounds at their
measured (or counted) seconds per bound (:data:`CROWN_BENCH`)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import statistics
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from attncert.cost.counting import (
    Counts,
    attack_step,
    fit,
    forward,
    pixel_linear_counts,
    random_images,
    train_step,
    vit_counts,
    vit_forward64,
)
from attncert.cost.crown_bench import GRAPH, kernel_key, row_key
from attncert.cost.graphs import (
    FROZEN_HEAD,
    LIPSCHITZ_VIT,
    LOFAST_TEXT,
    MSVP_VIT,
    OLSA_TEXT,
    STANDARD_TEXT,
    STANDARD_VIT,
    graphs_key,
)
from attncert.cost.kinds import StandInEncoder
from attncert.cost.layer_counts import layer_certificate_counts, layer_pgd_counts
from attncert.cost.work import (
    Work,
    audit_work,
    certify_work,
    grown_batches,
    n_steps,
    training_work,
)
from attncert.pipeline import jobs as J
from attncert.text.tokenize import ENCODERS, VOCAB

#: seconds per CROWN bound measured at the paper shape (``python -m attncert.cost crown
#: --device D --write``): rows of :func:`attncert.cost.crown_bench.bench_crown`, per device type,
#: and the kernels a bound launches (``crown --count-kernels --write``)
CROWN_BENCH = "docs/crown_bench.json"
#: the text models' step kinds for the CUDA-graph speed-up (attncert.cost.graphs); OLSA's has
#: no measurement under graphs yet (its capture failed before its head's closed-form norm),
#: so it counts eager, as every unmeasured kind
TEXT_KINDS = {"OLSAClassifier": OLSA_TEXT, "LipschitzTextTransformer": LOFAST_TEXT,
              "StandardTextTransformer": STANDARD_TEXT}
#: the image models' step kinds by :attr:`attncert.pipeline.jobs.Model.family`
VIT_KINDS = {"lipschitz": LIPSCHITZ_VIT, "standard": STANDARD_VIT, "msvp": MSVP_VIT}


def crown_bound_seconds(depth: int, method: str, path: str | Path = CROWN_BENCH,
                        batch: int = 1) -> tuple[float, str]:
    """(seconds, how) of one CROWN bound of the crown ViT of ``depth`` on a GPU, through the
    bridge's graph (:data:`~attncert.cost.crown_bench.GRAPH`), its points bounded ``batch`` at
    a time (``crown.batch_size``), from the record at ``path`` (:data:`CROWN_BENCH`):

    1. measured on CUDA, at the largest measured batch up to ``batch`` (a batch not measured
       gains nothing);
    2. else estimated: the kernels a call launches (counted, the record's ``kernels``, at the
       largest counted batch up to ``batch``) x the most seconds per kernel of the bounds
       measured on CUDA whose graph, depth, method and batch are counted too (the bounds run
       launch-bound there);
    3. else the CPU's measurement of the graph (one point a call) x the median CUDA / CPU
       ratio of the bounds measured on both ("scaled");

    else NaN ("not measured")."""
    path = Path(path)
    record = json.loads(path.read_text()) if path.is_file() else {}
    by = {row_key(r): r["seconds_per_bound"] for r in record.get("rows", [])
          if math.isfinite(r["seconds_per_bound"])}
    on_cuda = [b for dev, d, m, b, g in by if (dev, d, m, g) == ("cuda", depth, method, GRAPH)
               and b <= batch]
    if on_cuda:
        b = max(on_cuda)
        at = (f" at batch {b}" if b > 1 else
              ", one point a call (no batch measured)" if batch > 1 else "")
        return by["cuda", depth, method, b, GRAPH], "measured on CUDA" + at
    kernels = {kernel_key(r): r["kernels"] for r in record.get("kernels", [])}
    per_kernel = [s * b / kernels[g, d, m, b] for (dev, d, m, b, g), s in by.items()
                  if dev == "cuda" and (g, d, m, b) in kernels]
    counted = [b for g, d, m, b in kernels if (g, d, m) == (GRAPH, depth, method) and b <= batch]
    if per_kernel and counted:
        b, per = max(counted), max(per_kernel)
        k = kernels[GRAPH, depth, method, b] / b
        return k * per, (f"estimated: its kernels counted, {b} points a call, x {per * 1e6:.0f} "
                         f"us, the most CUDA seconds per counted kernel of {len(per_kernel)} "
                         "measured bounds")
    if ("cpu", depth, method, 1, GRAPH) not in by:
        return math.nan, "not measured"
    ratios = [v / by["cpu", d, m, 1, g] for (dev, d, m, b, g), v in by.items()
              if dev == "cuda" and b == 1 and ("cpu", d, m, 1, g) in by]
    if not ratios:
        return by["cpu", depth, method, 1, GRAPH], "measured on the CPU, not scaled"
    ratio = statistics.median(ratios)
    return by["cpu", depth, method, 1, GRAPH] * ratio, f"the CPU's x {ratio:.2g} (CUDA / CPU)"


def graphs(model: J.Model) -> str:
    """The step kind a training run of ``model`` is measured under graphs as ("": eager)."""
    if model.kind == "frozen_head":
        return FROZEN_HEAD
    if model.kind == "text":
        return TEXT_KINDS.get(model.family, "")
    if model.kind != "vit" or not model.family:
        return ""
    if model.family not in VIT_KINDS:  # a SpecFormer method's standard ViT
        return f"{STANDARD_VIT}, {model.family}"
    return graphs_key(VIT_KINDS[model.family], model.margin, any(model.msvp or ()))


def _measured_kind(model: J.Model) -> str:
    """The bench model kind ``model``'s forward was measured as (an MSVP model's forward is the
    standard ViT's: MSVP is its training), "" for a model of no bench kind."""
    if model.kind == "frozen_head":
        return FROZEN_HEAD
    if model.kind == "text":
        return TEXT_KINDS.get(model.family, "")
    if model.kind != "vit" or model.family not in VIT_KINDS:
        return ""
    return STANDARD_VIT if model.family == "msvp" else VIT_KINDS[model.family]


def audit_graphs(model: J.Model) -> str:
    """The step kind a PGD audit of ``model`` is measured under graphs as (its compiled
    attack copy, :func:`attncert.cost.bench.bench_audits`), "" for a model of no bench kind
    (eager)."""
    kind = _measured_kind(model)
    return graphs_key(kind, audit=True) if kind else ""


def forward_kind(model: J.Model) -> str:
    """The bench model kind whose measured per-kernel constant prices the work on ``model``
    other than its training (its evaluations, certificates and audits): its
    :func:`_measured_kind`, the standard ViT's for the ViTs of no bench kind (SpecFormer's
    comparison methods: standard ViTs with another attention), "" otherwise (its stage's)."""
    kind = _measured_kind(model)
    return kind or (STANDARD_VIT if model.kind == "vit" and model.family else "")


def counts(model: J.Model) -> dict[str, Counts]:
    """Train step, forward and attack step of ``model`` (cached per shape)."""
    if model.kind == "vit":
        return vit_counts(model.config, model.msvp, model.margin)
    if model.kind == "linear":
        return pixel_linear_counts(*model.config)
    if model.kind == "text":
        torch.manual_seed(0)
        return _text_counts(model.build(), model.max_len, model.margin == "olsa")
    if model.kind == "frozen_head":
        torch.manual_seed(0)
        return _frozen_head_counts(model.build(encoder=StandInEncoder(model.width)),
                                   model.width, model.max_len, model.margin == "olsa")
    raise ValueError(f"a {model.kind!r} model has no counts")


def crown_seconds(phase: J.CrownBounds, path: str | Path = CROWN_BENCH) -> float:
    """CROWN's bounds at their worst: every point x eps per method, each at its measured
    seconds (the time limit where none is measured or past it), each method capped by the
    unit's time budget."""
    worst = 0.0
    for method in phase.methods:
        sec, _ = crown_bound_seconds(phase.depth, method, path, phase.batch)
        limit = phase.time_limit or math.inf
        one = phase.n * phase.eps * (limit if math.isnan(sec) else min(sec, limit))
        worst += min(one, phase.time_budget) if phase.time_budget else one
    return worst


def passes(stage: str, what: str, kind: str, one: Counts, calls: int, batch: int) -> Work:
    """``calls`` calls of ``one`` at ``batch``, at precision ``kind``."""
    return Work(stage, what, kind, calls * one.flops(batch), calls * one.kernels)


def grown_passes(stage: str, what: str, kind: str, one: Counts, per_batch: int, batches: int,
                 n: int) -> Work:
    """``per_batch`` calls of ``one`` on each of ``batches`` batches covering ``n`` points."""
    return Work(stage, what, kind, per_batch * (batches * one.per_call + n * one.per_sample),
                per_batch * batches * one.kernels)


def job_work(job: J.Job, share: float = 0.0) -> list[Work]:
    """The work items of ``job``'s phases, marked with its stage and unit; ``share``:
    ``base.batch_memory``, to which the batches of the audits, the image certificates and the
    attention diagnostics grow (:func:`attncert.cost.work.grown_batches`; 0: the sections'
    sizes)."""
    m, s = job.model, job.stage
    c = functools.cache(lambda: counts(m))  # the model's counts, when a phase needs them
    out: list[Work] = []
    for ph in job.phases:
        if isinstance(ph, J.Train):
            out += training_work(s, ph.what, c(), ph.n_train, ph.n_eval, ph.epochs, ph.batch,
                                 ph.eval_batch, ph.adv_steps, graphs(m))
        elif isinstance(ph, J.Certify):
            out += certify_work(s, ph.what, m.config, ph.n, ph.variants, ph.tests, ph.batch,
                                share)
        elif isinstance(ph, J.Audit):
            out.append(audit_work(s, ph.what, c()["attack"], ph.n, ph.eps, ph.steps,
                                  ph.restarts, ph.batch, audit_graphs(m) if ph.copy else "",
                                  share))
        elif isinstance(ph, J.Diagnostics):  # trained, uniform and identity attention
            f = diagnostics_counts(m, ph.fp64)
            batches = grown_batches(ph.n, ph.batch, 1, f.bytes_per_sample, share)
            out.append(grown_passes(s, f"{job.name}: attention diagnostics",
                                    "fp64" if ph.fp64 else "fp32", f, 1, batches, ph.n))
        elif isinstance(ph, J.Forwards):
            f = vit_forward64(m.config) if ph.fp64 else c()["forward"]
            out.append(passes(s, ph.what, "fp64" if ph.fp64 else "fp32", f,
                              ph.passes * n_steps(ph.n, ph.batch), ph.batch))
        elif isinstance(ph, J.LayerCertify):  # the text models' LoFAST table
            # certify_table once per sentence length (attncert.text.evaluate._lofast_table):
            # up to ``tokens`` loops, each ending on a partial batch; counted without growth,
            # so no fewer batches than the run makes
            lc = layer_certificate_counts(ph.tokens, ph.dim, ph.heads, "lofast_M")
            batches = n_steps(ph.n, ph.batch) + min(ph.n, ph.tokens) - 1 if ph.n else 0
            out.append(grown_passes(s, ph.what, "fp64", lc, ph.variants * ph.depth, batches,
                                    ph.n))
        elif isinstance(ph, J.DouglasRachford):
            steps = ph.maps * ph.passes
            out.append(Work(s, ph.what, "fp64", steps * 2 * 2 * ph.pairs * ph.entries,
                            steps * 20))
        elif isinstance(ph, J.EncoderForward):
            enc = _encoder_forward(*ENCODERS[ph.source], ph.max_len)
            out.append(passes(s, ph.what, "bf16", enc, n_steps(ph.n, ph.batch), ph.batch))
        elif isinstance(ph, J.CrownBounds):
            out.append(Work(s, ph.what, "fp64", 0.0, 0.0, fixed_seconds=crown_seconds(ph)))
        elif isinstance(ph, J.LayerStudy):
            out.append(_layer_study(s, ph))
        elif isinstance(ph, J.Note):
            out.append(Work(s, ph.what, "fp32", 0.0, 0.0))
        else:
            raise TypeError(f"{job.stage} {job.name}: no price for a {type(ph).__name__}")
    for w in out:  # a training run at its step's kind, the rest at the model's forward's
        w.unit = job.unit
        w.model = w.graphs.split(", ")[0] if w.graphs else forward_kind(m)
    return out


def priced(jobs: Iterable[J.Job], share: float = 0.0) -> list[Work]:
    """Every job's work items, in order (``share``: :func:`job_work`'s)."""
    return [w for job in jobs for w in job_work(job, share)]


def _layer_study(stage: str, ph: J.LayerStudy) -> Work:
    setup, step = layer_pgd_counts(ph.tokens, ph.dim, ph.heads)
    lc = layer_certificate_counts(ph.tokens, ph.dim, ph.heads, "lofast_M")
    flops = sum(m * (setup.flops(b) + ph.steps * step.flops(ph.restarts * b) + lc.flops(b))
                for m, b in ph.calls)
    kernels = sum(m * (setup.kernels + ph.steps * step.kernels + lc.kernels)
                  for m, _ in ph.calls)
    return Work(stage, ph.what, "fp64", flops, kernels)


def _diagnostics(model: torch.nn.Module, inputs: Callable[[int], tuple]) -> Counts:
    """The attention diagnostics of ``model`` on b points as they run
    (:func:`attncert.diagnostics.attention_diagnostics`: the trained forward pass, whose hooks
    recompute each layer's attention matrix, its rows' entropy and its largest logit, read on
    the host; then one forward pass per ablation), counted at b = 1 and 2 (``inputs(b)``: the
    model's inputs, then the labels)."""
    from attncert.diagnostics import attention_diagnostics

    def make(b):
        *x, y = inputs(b)
        return lambda: attention_diagnostics(model, x[0] if len(x) == 1 else tuple(x), y, b)
    return fit(make)


@functools.cache
def _vit_diagnostics(cfg, fp64: bool) -> Counts:
    from attncert.models import build_vit

    dtype = torch.float64 if fp64 else torch.float32
    torch.manual_seed(0)
    return _diagnostics(build_vit(cfg).to(dtype),
                        functools.partial(random_images, cfg, dtype=dtype))


_DIAGNOSTICS: dict[tuple, Counts] = {}


def diagnostics_counts(model: J.Model, fp64: bool) -> Counts:
    """The attention diagnostics' call on ``model`` (:func:`_diagnostics`; cached per shape):
    a ViT in float64 (``fp64``, the certificates' copy) or float32, a text model or the
    frozen-encoder head on token ids or cached states of their ``max_len`` (float32)."""
    if model.kind == "vit":
        return _vit_diagnostics(dataclasses.replace(model.config, gamma_vo=1.0), fp64)
    if fp64 or model.kind not in ("text", "frozen_head"):
        raise ValueError(f"no attention diagnostics counted for a {model.kind!r} model"
                         + (" in float64" if fp64 else ""))
    torch.manual_seed(0)
    built = (model.build() if model.kind == "text"
             else model.build(encoder=StandInEncoder(model.width)))
    key = (model.kind, repr(built), model.max_len)
    if key not in _DIAGNOSTICS:
        width = model.width if model.kind == "frozen_head" else 0

        def inputs(b):
            mask = torch.ones(b, model.max_len, dtype=torch.bool)
            x = (torch.randn(b, model.max_len, width) if width
                 else torch.randint(1, VOCAB, (b, model.max_len)))
            return x, mask, torch.zeros(b, dtype=torch.long)
        _DIAGNOSTICS[key] = _diagnostics(built, inputs)
    return _DIAGNOSTICS[key]


_TEXT_COUNTS: dict[tuple, dict[str, Counts]] = {}


def _text_counts(model: torch.nn.Module, max_len: int, regulariser: bool = False
                 ) -> dict[str, Counts]:
    """A text model's train / forward / attack counts on token ids of ``max_len``; its step as
    the text runs take it (:func:`attncert.text.train_text.step_terms`: with OLSA's
    certificate ``regulariser``, then the orthogonal maps' re-projection)."""
    from attncert.text.train_text import step_terms

    def batch(b):
        return (torch.randint(1, VOCAB, (b, max_len)),
                torch.ones(b, max_len, dtype=torch.bool), torch.zeros(b, dtype=torch.long))

    def emb_batch(b):
        ids, mask, y = batch(b)
        with torch.no_grad():
            return model.embed(ids, mask), mask, y

    key = (repr(model), max_len, regulariser)
    if key not in _TEXT_COUNTS:
        loss, after = step_terms(model, 1.0 if regulariser else 0.0)
        _TEXT_COUNTS[key] = {"train": fit(train_step(model, batch, loss, after=after)),
                             "forward": fit(forward(model, batch)),
                             "attack": fit(attack_step(model, emb_batch))}
    return _TEXT_COUNTS[key]


def _frozen_head_counts(head, hidden: int, max_len: int, regulariser: bool = False
                        ) -> dict[str, Counts]:
    """The frozen head's train / forward / attack counts on cached (B, L, hidden) states (its
    step as :func:`_text_counts` counts a text model's)."""
    def states(b):
        return (torch.randn(b, max_len, hidden), torch.ones(b, max_len, dtype=torch.bool),
                torch.zeros(b, dtype=torch.long))
    from attncert.text.train_text import step_terms

    torch.manual_seed(0)
    loss, after = step_terms(head, 1.0 if regulariser else 0.0)
    return {"train": fit(train_step(head, states, loss, after=after)),
            "forward": fit(forward(head, states)),
            "attack": fit(attack_step(head, states))}


@functools.cache
def _encoder_forward(hidden: int, layers: int, heads: int, inter: int, max_len: int) -> Counts:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(hidden_size=hidden, num_hidden_layers=layers,
                                 num_attention_heads=heads, intermediate_size=inter)).eval()

    def make(b):
        ids = torch.randint(1, VOCAB, (b, max_len))
        return lambda: model(input_ids=ids, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        return fit(make)
