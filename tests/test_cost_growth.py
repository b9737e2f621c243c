"""The audits' batches in the cost model: the PGD audits counted at the batches
base.batch_memory grows them to (attncert.cost.work.grown_batches, from the bytes their
attack step's kernels output per point), one size for all radii as the audits run them."""

import pytest
import torch
from helpers import params_with

from attncert.cost.counting import fit
from attncert.cost.pricing import priced
from attncert.cost.work import GPU_MEMORY, GROWTH_MARGIN, LOOP_BASE_BYTES, grown_batches
from attncert.stages.registry import load_params, stage_jobs


def test_the_batches_follow_the_growth_rule_of_the_audit():
    """1000 points at 7 radii from batch 100: without growth 70 batches; grown (small points)
    100, 200, 400, 300 at the first radius, 800, 200 at the second, then one a radius; points
    whose bytes stop the growth at 200 keep it there, for every radius."""
    assert grown_batches(1000, 100, 7, 1e6, 0.0) == 70
    assert grown_batches(1000, 100, 7, 1e6, 0.5) == 4 + 2 + 5
    assert grown_batches(1000, 100, 7, 1e12, 0.5) == 70  # no point fits twice over
    room = 0.5 * GPU_MEMORY - LOOP_BASE_BYTES
    per = room / (GROWTH_MARGIN * 150)  # 100 points fit, 200 do not
    assert grown_batches(1000, 100, 7, per, 0.5) == 6 + 5 * 6
    assert grown_batches(0, 100, 7, 1e6, 0.5) == 0


def test_the_bytes_per_sample_are_what_a_point_adds_to_the_outputs():
    counts = fit(lambda b: lambda: torch.ones(b, 1000) * 2.0)  # two float32 (b, 1000) outputs
    assert counts.bytes_per_sample == 2 * 4000


def test_audits_grow_and_nothing_else_moves(smoke, tmp_path):
    """At the smoke params with certificate batches of 5 and 1 (the grid's and the text models'
    audit batches: 50 and 5 points): every audit runs in at most the launches of its
    section's batch (fewer for the grid's and the text models'), the same FLOPs to its
    per-call part; nothing else moves."""
    path = params_with(smoke, tmp_path, "certify_vit", "cert_batch_size", 5)
    p = load_params(params_with(path, tmp_path, "text", "cert_batch_size", 1))
    jobs = list(stage_jobs(p, ("certify_vit", "crown", "text")))
    fixed, grown = priced(jobs, 0.0), priced(jobs, 0.5)
    assert [w.what for w in fixed] == [w.what for w in grown]
    audits = [(a, b) for a, b in zip(fixed, grown, strict=True) if "audit" in a.what.lower()]
    assert {a.stage for a, _ in audits} >= {"certify_vit", "text"}
    assert all(b.kernels <= a.kernels and b.flops <= a.flops * (1 + 1e-9) for a, b in audits)
    for stage in ("certify_vit", "text"):
        assert any(b.kernels < a.kernels for a, b in audits if a.stage == stage), stage
    others = [(a, b) for a, b in zip(fixed, grown, strict=True) if (a, b) not in audits]
    assert all((a.kernels, a.flops) == (b.kernels, b.flops) for a, b in others)
    assert p["base"].batch_memory == pytest.approx(0.5)
