"""The crown stage: LoFAST vs CROWN on the same points (LoFAST Table 1) and LoFAST first with
CROWN on what LoFAST left (Table 2), as read-outs of one row per point.

On each dataset of ``datasets`` (LoFAST Table 2: CIFAR-10 and SVHN; Table 1 is CIFAR-10's), one
Lipschitz ViT per depth is trained in the stage (stream blocks; the same settings and seed on
every dataset). Both methods certify the TRUE label (a misclassified point is never certified).
CROWN (:mod:`attncert.crown`) runs once per (point, eps), smallest eps first; a point it does
not certify at an eps is not run at the larger ones (recorded "skipped", 0 s: it cannot be
counted as certified there). With ``skip_lofast_certified`` CROWN does not run where LoFAST
certified ("lofast"), except on the first ``alone_points`` test points, its own sample, where
CROWN alone is measured (:func:`attncert.crown.tables.tables`); with ``alpha_after_crown``
alpha-CROWN runs after CROWN, only where CROWN did not certify ("crown": certified by CROWN's
bound; the cascade's seconds are both methods'); a point the model
misclassifies is not bounded ("misclassified"); past
``time_budget`` CROWN seconds of one method in a unit, that method runs no more bounds
("budget"; each method has its own); ``batch_size`` points are bounded by one call (on a GPU
the batch grows to ``base.batch_memory`` of its memory); each point's rows are appended to
``results_dir/ckpt/<dataset>/L<depth>/crown-<method>.jsonl`` as it finishes, and a rerun with the
same params takes the finished points from there (alpha-CROWN's after CROWN, with the same pairs
certified by CROWN); more than ``max_error_share`` errors among
the bounds that ran fail the stage (:func:`attncert.crown.study.require_few_errors`). Seconds
per sample: LoFAST's certificate with its radius (valid for every eps at once), CROWN's mean
time of one (point, eps) bound over the pairs it ran (a batch's seconds shared by its
points, as LoFAST's). Every certified point is then attacked
with L2 PGD: a broken certificate fails the stage.

Each (dataset, depth) is an independent unit (:func:`units`, one DVC stage each: several GPUs
share the stage); :func:`run` gathers their records. The study's code (training, one row per
point, Tables 1-2) is in :mod:`attncert.crown.study` and :mod:`attncert.crown.tables`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from attncert import certify, diagnostics, soundness
from attncert.crown import METHODS, plan
from attncert.crown.params import Params
from attncert.crown.study import (
    Budget,
    Journal,
    crown_certified,
    crown_frame,
    grid_radius,
    lofast_frame,
    require_few_errors,
    train_model,
)
from attncert.crown.tables import DatasetResult, gather_dataset, tables
from attncert.data import as_float, load_processed
from attncert.pipeline.context import Context
from attncert.pipeline.io import write_json
from attncert.pipeline.jobs import Job
from attncert.pipeline.params import (
    BaseParams,
    StudyParams,
)
from attncert.pipeline.records import SplitRun, gathered, read_record, unit_key
from attncert.report import paper
from attncert.report.headline import eps_match, numbers, row
from attncert.training.checkpoint import state_sha

#: this module's params.yaml section
SECTION = "crown"


def jobs(params: StudyParams) -> list[Job]:
    """The stage's plan as data, its jobs (:func:`attncert.crown.plan.jobs`), priced by
    :mod:`attncert.cost.pricing`."""
    return plan.jobs(params)


@dataclass
class Result:
    """What the notebook shows: the units' device(s) and each dataset's part, in ``datasets``
    order."""

    device: str
    datasets: dict[str, DatasetResult]


# ------------------------------------------------------------------ the stage
def units(p: Params) -> list[str]:
    """The stage's independent units, each one DVC stage (``crown_unit@<dataset>-<depth>``):
    one ViT of one depth on one dataset, trained, certified by LoFAST and CROWN, audited."""
    return [f"{d}-L{depth}" for d in p.datasets for depth in p.depths]


def unit_stage(p: Params, unit: str) -> str:
    """The DVC stage that runs ``unit`` of :func:`units` (dvc.yaml's matrix key:
    ``<dataset>-<depth>``)."""
    return f"crown_unit@{unit.replace('-L', '-')}"


def unit_file(p: Params, unit: str) -> Path:
    """Where :func:`_run_unit` writes the unit's record (JSON)."""
    return Path(p.results_dir) / "units" / f"{unit}.json"


def run(p: Params, ctx: Context) -> SplitRun[Result]:
    """``ctx.item``: one unit of :func:`units` (:func:`_run_unit`: its record); ``None``: the
    gathering stage (:func:`_gather`: what the notebook shows). Both return a
    :class:`attncert.pipeline.records.SplitRun` (the record or metrics as written; the gathering
    stage's :class:`Result`)."""
    if ctx.item is None:
        return gathered(p.metrics, _gather(p, ctx))
    return SplitRun(ctx.item, _run_unit(p, ctx, ctx.item))


def _run_unit(p: Params, ctx: Context, unit: str) -> dict[str, Any]:
    """One unit of :func:`units` (``<dataset>-L<depth>``): train its ViT on ``ctx.device``
    (checkpoint in ``results_dir/ckpt/<dataset>/L<depth>``), certify the first ``n_test`` test
    points by LoFAST and every CROWN method (its own ``time_budget``), audit them with PGD;
    write the record to :func:`unit_file` (before the checks, so a failure can be inspected)
    and return it. Raises :class:`attncert.soundness.UnsoundCertificateError` on a broken
    certificate, RuntimeError on too many failed bounds
    (:func:`~attncert.crown.study.require_few_errors`) or a combination that certifies less
    than one of its methods."""
    if unit not in units(p):
        raise ValueError(f"crown unit {unit!r}: not one of {units(p)}")
    dataset, depth = unit.rsplit("-L", 1)
    depth = int(depth)
    t0 = time.perf_counter()
    base, dev = ctx.require_base(), ctx.device
    data = load_processed(dataset, ctx.processed_dir)
    n = min(p.n_test, len(data["test"]["y"]))
    x = as_float(data["test"]["x"][:n]).to(dev, torch.float64)
    y = data["test"]["y"][:n].to(dev)
    ckpt = Path(p.results_dir) / "ckpt" / dataset / f"L{depth}"  # the model and CROWN's rows
    model, acc, secs = train_model(data, p, depth, base.seed, ckpt, dev, ctx.precision)
    lo = lofast_frame(model.double(), x, y, p.lofast_variant, p.cert_eps)
    weights = state_sha(model)  # the float64 model every method certifies
    certified = {e: torch.tensor(lo[f"certified_{e}"].to_numpy()) for e in p.cert_eps}
    radii = {"lofast": grid_radius(certified)}
    lofast_done = (torch.stack([certified[e] for e in sorted(p.cert_eps)], 1)
                   if p.skip_lofast_certified else None)
    alone = n if lofast_done is None else min(p.alone_points, n)  # CROWN's own sample
    if lofast_done is not None:
        lofast_done[:alone] = False
    correct = torch.tensor(lo["correct"].to_numpy(), dtype=torch.bool)
    crown_rows, t1, t2, first = [], [], [], {}
    for method in p.methods:  # each method its own budget; rows journaled as they finish
        prior = first.get("crown") if method == "alpha_crown" and p.cascade else None
        proven = None if prior is None else torch.stack(
            [crown_certified(prior, n, e) for e in sorted(p.cert_eps)], 1)
        # after CROWN, the pairs it certified are part of the key: other CROWN rows (a CROWN
        # journal cleared and rerun) start alpha-CROWN's rows afresh
        after = {} if proven is None else {"crown_certified": proven.to(torch.uint8).tolist()}
        # the weights are part of the key: rows of another model (retrained, or a checkpoint
        # replaced by hand) are never taken for this one's
        journal = Journal(ckpt / f"crown-{method}.jsonl",
                          {"unit": unit, "method": method, **unit_key("crown", p, base),
                           "weights": weights, **after})
        rows, _ = crown_frame(model, x, y, p.cert_eps, method, p.time_limit,
                              p.alpha_iterations, getattr(torch, p.bound_dtype),
                              progress=True, lofast=lofast_done, budget=Budget(p.time_budget),
                              correct=correct, journal=journal, batch_size=p.batch_size,
                              proven=proven)
        crown_rows.append(rows)
        first[method] = rows
        label = METHODS[method] + (" after CROWN" if prior is not None else "")
        a, b = tables(lo, rows, p.cert_eps, depth, label, alone, prior=prior)
        t1 += a if method == p.methods[0] else a[1:]
        t2 += b
        cr = {e: crown_certified(rows, n, e) for e in p.cert_eps}
        radii[method] = grid_radius(cr)
        radii[f"lofast+{method}"] = grid_radius({e: certified[e] | cr[e] for e in p.cert_eps})
    m = p.audit.count(n)
    audit, _ = certify.audit(model.double(), x[:m], y[:m], {k: r[:m] for k, r in radii.items()},
                             p.cert_eps, p.audit.steps, p.audit.restarts, base.seed,
                             p.audit.batch_size)
    # does the attention do anything: on the whole test split (forward passes only)
    attention = diagnostics.attention_diagnostics(
        model, as_float(data["test"]["x"]).to(dev, torch.float64), data["test"]["y"].to(dev))
    crown_df = pd.concat(crown_rows)
    record = {"unit": unit, "key": unit_key("crown", p, base), "device": str(dev), "n": n,
              "trained": {"depth": depth, "test_acc": 100 * acc, "train_seconds": secs},
              "lofast": lo.assign(depth=depth).to_dict("records"),
              "crown": crown_df.assign(depth=depth).to_dict("records"),
              "audit": [dict(r, depth=depth) for r in audit], "table1": t1, "table2": t2,
              "attention": attention, "seconds": time.perf_counter() - t0}
    write_json(unit_file(p, unit), record)
    check_unit(record, p.max_error_share, str(unit_file(p, unit)))
    return record


def check_unit(record: Mapping[str, Any], max_error_share: float, where: str) -> None:
    """A unit's checks: no broken certificate, few failed bounds, a combination that certifies
    at least what each of its methods does."""
    soundness.require_sound({record["unit"]: record["audit"]}, by=("depth",), see=where)
    require_few_errors(pd.DataFrame(record["crown"]), max_error_share, where)
    for r in record["table2"]:
        if r["combined_acc"] < max(r["crown_acc"] or 0.0, r["lofast_acc"]):
            raise RuntimeError(f"the combination certifies fewer points than one method: {r}")


def read_unit(p: Params, base: BaseParams, unit: str) -> dict[str, Any]:
    """The record :func:`_run_unit` wrote for ``unit``; ValueError when it is missing or was
    computed from other params (run the unit's DVC stage first)."""
    return read_record(unit_file(p, unit), unit_key("crown", p, base),
                       f"the crown unit {unit!r}", unit_stage(p, unit))


def _gather(p: Params, ctx: Context) -> Result:
    """Gather every unit's record (:func:`read_unit`), dataset by dataset: write lofast.csv
    and crown.csv (one ``dataset`` column), each dataset's tables as PNGs under ``results_dir``
    and the metrics file: ``{"datasets": {name: ...}, "eps", "depths", "broken",
    "stage_seconds"}``. Reads records only (no device); the units' checks run again."""
    base = ctx.require_base()
    t0 = time.perf_counter()
    out = Path(p.results_dir)
    records = {u: read_unit(p, base, u) for u in units(p)}
    for u, rec in records.items():
        check_unit(rec, p.max_error_share, str(unit_file(p, u)))
    parts, frames = {}, {"lofast.csv": [], "crown.csv": []}
    for name in p.datasets:
        parts[name] = gather_dataset(p, name, [records[f"{name}-L{d}"] for d in p.depths],
                                     out, frames)
    devices = {rec["device"] for rec in records.values()}
    write_json(p.metrics, {
        "datasets": {name: r.metrics for name, r in parts.items()},
        "eps": p.cert_eps, "depths": p.depths, "units": sorted(records),
        "broken": sum(r.metrics["broken"] for r in parts.values()),
        "stage_seconds": sum(rec["seconds"] for rec in records.values())
        + time.perf_counter() - t0})
    return Result(", ".join(sorted(devices)), parts)


# ------------------------------------------------------------------ headline
def headline_rows(m: Mapping, item: Mapping) -> list[dict]:
    """LoFAST Tables 1-2 as the stage writes them (accuracies in %), per dataset and depth:
    certified accuracy and seconds per sample of LoFAST and CROWN, LoFAST first with CROWN on
    the rest, the CROWN / LoFAST speed ratio; LoFAST's numbers beside where the dataset is the
    paper's (Table 1: CIFAR-10; Table 2: CIFAR-10 and SVHN). Keys follow the metrics file
    (``datasets/<name>/...``)."""
    rows = []
    for name, part in m.get("datasets", {}).items():
        rows += dataset_rows(name, part)
    if "broken" in m:
        rows.append(row("broken", "broken certificates", m["broken"], "count"))
    return rows


def dataset_rows(dataset: str, m: Mapping) -> list[dict]:
    """One dataset's headline rows (see :func:`headline_rows`)."""
    t1, t2 = paper.LOFAST_TABLE1, paper.LOFAST_TABLE2.get(dataset, {})
    cifar = dataset == "cifar10"
    # not quite like for like (fidelity.yaml): its LoFAST column uses Proposition 1's logit
    # test where ours is pairwise, its verifier is alpha,beta-CROWN where ours is (alpha-)CROWN
    lofast_src = "LoFAST Table 1 (its logit test; ours pairwise)"
    crown_src = "LoFAST Table 1 (alpha,beta-CROWN; ours CROWN / alpha-CROWN)"
    key, lab = f"datasets/{dataset}/", f"{dataset} "
    rows = [row(f"{key}trained/L{t['depth']}/test_acc", f"{lab}L{t['depth']} clean accuracy",
                t["test_acc"], "percent") for t in m.get("trained", [])]
    n_all = m.get("n")

    def own(k: int | None) -> str:
        """CROWN's own sample, named when it is not every certified point."""
        return "" if k is None or n_all is None or k >= n_all else f" (its first {k} points)"

    for rec in m.get("table1", []):
        d, method = rec["depth"], rec["method"]
        lofast = method == "LoFAST"
        sample = "" if lofast else own(rec.get("n"))
        for k in (k for k in rec if k.startswith("acc_")):
            i = eps_match(k[4:], t1["eps"])
            per_depth = t1["lofast" if lofast else "crown"].get(d) if cifar else None
            ref = per_depth[i] if per_depth and i is not None else None
            rows.append(row(f"{key}table1/L{d}/{method}/{k}", f"{lab}L{d} {method} certified "
                            f"at eps {k[4:]}{sample}", rec[k], "percent", ref,
                            lofast_src if lofast else crown_src, brief=True))
        secs = t1["lofast_seconds" if lofast else "crown_seconds"].get(d) if cifar else None
        per = ("sample" if lofast else f"bound{sample}" if rec.get("n") else
               "bound where LoFAST did not certify")
        rows.append(row(f"{key}table1/L{d}/{method}/seconds_per_sample",
                        f"{lab}L{d} {method} seconds per {per}", rec["seconds_per_sample"],
                        "seconds", secs, lofast_src if lofast else crown_src, brief=True))
    for rec in m.get("table2", []):
        d, eps = rec["depth"], f"{rec['eps']:g}"
        i = eps_match(eps, paper.LOFAST_TABLE_EPS[:2]) if d == 3 else None
        whole = rec["crown_acc"] is not None  # CROWN alone measured (on its own sample)
        sample = own(rec.get("crown_n"))
        for k, label, ref_key, unit, j in (
                ("crown_acc", f"{rec['method']} alone{sample}", "CROWN", "percent", 0),
                ("crown_seconds", f"{rec['method']} alone seconds per "
                 f"{f'bound{sample}' if whole else 'bound where LoFAST did not certify'}",
                 "CROWN", "seconds", 1),
                ("combined_acc", f"LoFAST + {rec['method']}", "CROWN+LoFAST", "percent", 0),
                ("combined_seconds", f"LoFAST + {rec['method']} seconds", "CROWN+LoFAST",
                 "seconds", 1)):
            alone = ref_key == "CROWN"
            ref = t2[ref_key][i][j] if t2 and i is not None and (whole or not alone) else None
            rows.append(row(f"{key}table2/L{d}/{rec['method']}/{eps}/{k}",
                            f"{lab}L{d} {label} at eps {eps}", rec[k], unit, ref,
                            "LoFAST Table 2", brief=k == "combined_acc"))
    for d, ratio in m.get("crown_over_lofast_seconds", {}).items():
        lo, cr = t1["lofast_seconds"].get(int(d)), t1["crown_seconds"].get(int(d))
        rows.append(row(f"{key}crown_over_lofast_seconds/{d}",
                        f"{lab}L{d} CROWN seconds per bound{own(m.get('n'))} / LoFAST seconds per "
                        "point", ratio, "ratio", cr / lo if lo and cr and cifar else None,
                        "LoFAST Table 1 (alpha,beta-CROWN / LoFAST seconds per sample, "
                        "CIFAR-10, every point)", brief=True))
    for k, label in (("n", "certified test points"), ("broken", "broken certificates")):
        if k in m:
            rows.append(row(f"{key}{k}", f"{lab}{label}", m[k], "count"))
    for depth, a in m.get("attention", {}).items():
        rows.append(row(f"{key}attention/{depth}/uniform_gap", f"{lab}{depth} points lost with "
                        "uniform attention (whole test split)", a["uniform_gap"], "value",
                        brief=True))
        rows.append(row(f"{key}attention/{depth}/entropy_mean", f"{lab}{depth} attention "
                        "entropy / log n", a["entropy_mean"], "ratio"))
    return rows


def headline_numbers(m: Mapping, item: Mapping) -> dict[str, float]:
    """The DVC headline: LoFAST with CROWN on the rest (Table 2), certified accuracy of the
    first dataset's shallowest model at the middle eps and the points that model loses with
    uniform attention; broken certificates."""
    rows = next(iter(m.get("datasets", {}).values()), {}).get("table2", [])
    cert = eps = None
    if rows:
        depth = min(r["depth"] for r in rows)
        at = sorted((r for r in rows if r["depth"] == depth), key=lambda r: r["eps"])
        mid = at[len(at) // 2]
        cert, eps = mid["combined_acc"] / 100, mid["eps"]  # Table 2's rows are in %
    attention = next(iter(m.get("datasets", {}).values()), {}).get("attention", {})
    first = min(attention, key=lambda k: int(k[1:]), default=None)
    return numbers(cert=cert, eps=eps, broken=m.get("broken"),
                   attn_uniform_gap=attention[first]["uniform_gap"] if first else None)
