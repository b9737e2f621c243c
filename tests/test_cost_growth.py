"""The grown batches in the cost model: the PGD audits, the certificate passes and the
attention diagnostics counted at the batches base.batch_memory grows them to
(attncert.cost.work.grown_batches, from the bytes their kernels output per point), an audit's
one size for all radii as the audits run them."""

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


def _grows(what: str) -> bool:
    """A work item whose loop grows its batches on a GPU: a PGD audit, a certificate pass
    (certify_table) or the attention diagnostics."""
    return any(k in what.lower() for k in ("audit", "certificates", "attention diagnostics"))


def test_audits_certificates_and_diagnostics_grow_and_nothing_else_moves(smoke, tmp_path):
    """At the smoke params with certificate batches of 5 and 1 (the grid's and the text models'
    audit batches: 50 and 5 points): every audit, certificate pass and diagnostics pass runs in
    at most the launches of its section's batch (fewer for the grid's audits, certificates and
    diagnostics, and the text models' audits and diagnostics; the text models' LoFAST
    certificates run one loop per sentence length and are priced without growth), at most the
    same FLOPs; nothing else moves."""
    path = params_with(smoke, tmp_path, "certify_vit", "cert_batch_size", 5)
    p = load_params(params_with(path, tmp_path, "text", "cert_batch_size", 1))
    jobs = list(stage_jobs(p, ("certify_vit", "crown", "text")))
    fixed, grown = priced(jobs, 0.0), priced(jobs, 0.5)
    assert [w.what for w in fixed] == [w.what for w in grown]
    growing = [(a, b) for a, b in zip(fixed, grown, strict=True) if _grows(a.what)]
    assert all(b.kernels <= a.kernels and b.flops <= a.flops * (1 + 1e-9) for a, b in growing)
    for stage, kind in (("certify_vit", "audit"), ("certify_vit", "certificates"),
                        ("certify_vit", "attention diagnostics"), ("text", "audit"),
                        ("text", "attention diagnostics")):
        assert any(b.kernels < a.kernels for a, b in growing
                   if a.stage == stage and kind in a.what.lower()), (stage, kind)
    others = [(a, b) for a, b in zip(fixed, grown, strict=True) if not _grows(a.what)]
    assert others and all((a.kernels, a.flops) == (b.kernels, b.flops) for a, b in others)
    assert p["base"].batch_memory == pytest.approx(0.5)


def test_the_peak_counts_the_storages_held_at_once():
    """count_call's peak: tensors freed along the way leave it; a view holds its storage; an
    allocation (empty) and the call's inputs count."""
    from attncert.cost.counting import count_call

    def peak(fn):
        return count_call(fn, peak=True)[3]

    # one (100, 1000) float32 at a time, and the ten sums the list keeps
    assert peak(lambda: [torch.ones(100, 1000).sum() for _ in range(10)]) == 400_000 + 40
    assert count_call(lambda: [torch.ones(100, 1000).sum() for _ in range(10)])[2:] == (
        10 * (400_000 + 4), 0)  # the outputs' total, as fit counts bytes; no peak unasked

    def view_outlives_its_base():
        x = torch.ones(100, 1000)
        v = x[:, :10]
        del x
        return torch.ones(100, 1000) + v.sum()  # x's storage still held: both at once

    assert peak(view_outlives_its_base) >= 2 * 400_000
    held = torch.zeros(50, 1000)
    assert peak(lambda: torch.empty(100, 1000).copy_(held.repeat(2, 1))) >= 3 * 200_000


def test_the_certificate_terms_bytes_bound_what_a_point_adds():
    """layer_certificate_counts' bytes per point are at least the slope of the terms' peak
    between batches of 8 and 16 (what a point adds at larger batches) and far below the
    total the Lanczos steps output per point; at a layer of 5 tokens of 32-d (160 dimensions,
    more than the KW steps: the iterations stop on convergence, not at the space's size)."""
    from attncert.bounds.bench import bench_layer
    from attncert.bounds.variants import Layer, variant
    from attncert.cost.counting import count_call
    from attncert.cost.layer_counts import layer_certificate_counts

    def run(b):
        w, x = bench_layer(5, 32, 2, b, torch.float64)
        layer = Layer(x, w, True, 1.0, 1.0)
        return count_call(lambda: variant("lofast_M").terms(layer), peak=True)

    (_, _, out8, peak8), (_, _, _, peak16) = run(8), run(16)
    per_point = layer_certificate_counts(5, 32, 2, "lofast_M").bytes_per_sample
    assert (peak16 - peak8) / 8 <= per_point < out8 / 8 / 4
