"""CROWN's bounds in batches (crown.batch_size): a batch's bounds are its points' bounds alone,
the stage's rows do not depend on the batch, and a batch that fails degrades to what single
points would record (out of memory: halved; another error: rerun one at a time; the time
limit: B times a bound's)."""

import json
import math
import time

import pandas as pd
import pytest
import torch
from test_crown import sample_ball, tiny_vit

from attncert.attacks import pgd_l2
from attncert.crown import CrownCertifier, certify_batch, certify_points, study
from attncert.crown.patches import DomainError

COLS = ["index", "eps", "method", "certified", "status"]


def _points(n: int = 6, seed: int = 3):
    model = tiny_vit()
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g, dtype=torch.float64)
    return model, x, model(x).argmax(1)


def test_a_batch_bounds_each_point_as_it_would_alone():
    """CROWN: the batch's margins are the single points' to rounding; alpha-CROWN optimises
    each point's relaxations (its bounds move by its optimiser's steps, not past 1e-4) and
    every margin holds against sampled and attacked points."""
    model, x, y = _points(4)
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    for method, tol in (("crown", 1e-12), ("alpha_crown", 1e-4)):
        batch = certify_batch(cert, x, y, 0.1, method, 0.0, 5)
        alone = certify_points(cert, x, y, [0.1], method, 0.0, 5)
        assert [r["index"] for r in batch] == list(range(4))
        assert {r["batch"] for r in batch} == {4} and {r["batch"] for r in alone} == {1}
        assert [r["status"] for r in batch] == ["ok"] * 4
        for b, a in zip(batch, alone, strict=True):
            assert b["margin_lower"] == pytest.approx(a["margin_lower"], abs=tol)
            assert b["certified"] == (b["margin_lower"] > 0)
        assert len({r["seconds"] for r in batch}) == 1  # the batch's seconds, shared
    assert any(r["certified"] for r in batch) and not all(r["certified"] for r in batch)
    lower = cert.margin_lower(x, y, 0.1, "alpha_crown", 5)
    g = torch.Generator().manual_seed(4)
    for i in range(len(y)):
        xa, _ = pgd_l2(model, x[i:i + 1].expand(4, -1, -1, -1), y[i:i + 1].expand(4), 0.1, 20,
                       2, generator=g)
        with torch.no_grad():
            logits = torch.cat([model(xa), model(sample_ball(x[i:i + 1], 0.1, 300, g))])
        gaps = logits[:, [int(y[i])]] - logits
        others = [j for j in range(3) if j != int(y[i])]
        assert (gaps[:, others] >= lower[i] - 1e-9).all()


def test_the_stage_s_rows_do_not_depend_on_the_batch(tmp_path):
    """With LoFAST's pairs, misclassified points and a journal, batches of 1, 2 and 4 give the
    same rows (statuses, certificates, margins to rounding); each batch's seconds are charged
    to the budget; a batch run resumes from a journal a run at batch 1 wrote, and the reverse."""
    model, x, y = _points(7)
    y = y.clone()
    y[2] = (y[2] + 1) % 3  # misclassified
    correct = model(x).argmax(1) == y
    eps = [0.02, 0.05, 0.1]
    lofast = torch.zeros(7, 3, dtype=torch.bool)
    lofast[4] = True  # as if LoFAST certified point 4 at every radius, point 5 at the first
    lofast[5, 0] = True
    runs = {}
    for b in (1, 2, 4):
        budget = study.Budget(1e6)
        rows, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, lofast=lofast,
                                    correct=correct, budget=budget, batch_size=b)
        assert 1e6 - budget.left == pytest.approx(rows["seconds"].sum(), rel=1e-9)
        runs[b] = rows
        assert rows["batch"].max() <= b
    for b in (2, 4):
        pd.testing.assert_frame_equal(runs[b][COLS], runs[1][COLS])
        ran = runs[1]["status"] == "ok"
        assert (runs[b]["margin_lower"][ran] - runs[1]["margin_lower"][ran]).abs().max() < 1e-12
    assert runs[4]["batch"].max() > 1, "some bounds ran together"
    assert set(runs[1].loc[runs[1]["index"] == 2, "status"]) == {"misclassified"}
    assert set(runs[1].loc[runs[1]["index"] == 4, "status"]) == {"lofast"}
    assert runs[1].loc[runs[1]["index"] == 5, "status"].iloc[0] == "lofast"
    path, key = tmp_path / "j.jsonl", {"unit": "u"}
    for first, second in ((1, 4), (4, 1)):
        path.unlink(missing_ok=True)
        journal = study.Journal(path, key)
        study.crown_frame(model, x[:3], y[:3], eps, "crown", 0.0, 5, correct=correct[:3],
                          journal=journal, batch_size=first, lofast=lofast[:3])
        resumed, _ = study.crown_frame(model, x, y, eps, "crown", 0.0, 5, correct=correct,
                                       journal=study.Journal(path, key), batch_size=second,
                                       lofast=lofast)
        pd.testing.assert_frame_equal(resumed[COLS], runs[1][COLS])


def test_a_spent_budget_stops_before_the_next_batch():
    model, x, y = _points()
    rows, _ = study.crown_frame(model, x, y, [0.02], "crown", 0.0, 5, batch_size=3,
                                budget=study.Budget(1e-9))
    assert list(rows["status"]) == ["ok"] * 3 + ["budget"] * 3


def test_out_of_memory_halves_the_batch_and_keeps_every_point(monkeypatch, capsys):
    """A bounded graph that runs out of device memory above 3 points: the first batch, its 6
    points, halves to 3 (printed, kept), every point gets the row a run at batch 1 gives; the
    failed attempt's seconds are charged to the budget, which is checked again before the
    halves (spent after the first: the second's points are "budget")."""
    model, x, y = _points()
    want, _ = study.crown_frame(model, x, y, [0.02, 0.1], "crown", 0.0, 5)
    real = CrownCertifier.margin_lower

    def small(self, xb, *args, **kwargs):
        time.sleep(0.2)  # every call runs a while, an attempt that fails too
        if len(xb) > 3:
            raise torch.OutOfMemoryError("simulated: CUDA out of memory")
        return real(self, xb, *args, **kwargs)

    monkeypatch.setattr(CrownCertifier, "margin_lower", small)
    budget = study.Budget(1e6)
    got, _ = study.crown_frame(model, x, y, [0.02, 0.1], "crown", 0.0, 5, batch_size=8,
                               budget=budget)
    pd.testing.assert_frame_equal(got[COLS], want[COLS])
    assert got["batch"].max() == 3
    assert "out of device memory at batch 6; retrying with 3" in capsys.readouterr().out
    assert 1e6 - budget.left >= got["seconds"].sum() + 0.2  # the failed attempt counted
    short = study.Budget(0.3)  # the failed attempt (0.2 s), then one half (0.2 s): spent
    got, _ = study.crown_frame(model, x, y, [0.02], "crown", 0.0, 5, batch_size=8,
                               budget=short)
    assert list(got["status"]) == ["ok"] * 3 + ["budget"] * 3
    monkeypatch.setattr(CrownCertifier, "margin_lower",
                        lambda self, xb, *a, **k: small(self, xb.expand(4, -1, -1, -1)))
    (row,) = certify_batch(CrownCertifier.from_vit(model, (1, 8, 8)), x[:1], y[:1], 0.1)
    assert row["status"] == "out_of_memory"  # a single point: its row, not an exception


def test_a_failing_point_fails_alone_and_a_slow_batch_times_out(monkeypatch):
    """A domain error of one point reruns its batch point by point: only that point's row is
    "domain", the others are bounded (the failed call's seconds shared among them). The time
    limit is a bound's times the batch: past it every row is "time_limit"."""
    model, x, y = _points(4)
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    want = certify_batch(cert, x, y, 0.05)
    real = CrownCertifier.margin_lower

    def fails_on_point_1(self, xb, *args, **kwargs):
        if any(torch.equal(p, x[1]) for p in xb):
            raise DomainError("simulated: sqrt of a negative lower bound")
        return real(self, xb, *args, **kwargs)

    monkeypatch.setattr(CrownCertifier, "margin_lower", fails_on_point_1)
    rows = certify_batch(cert, x, y, 0.05)
    assert [r["status"] for r in rows] == ["ok", "domain", "ok", "ok"]
    assert [r["index"] for r in rows] == [0, 1, 2, 3] and {r["batch"] for r in rows} == {1}
    assert "DomainError" in rows[1]["error"] and math.isnan(rows[1]["margin_lower"])
    for r, w in zip(rows, want, strict=True):
        if r["status"] == "ok":
            assert r["margin_lower"] == pytest.approx(w["margin_lower"], abs=1e-12)

    def slow(self, xb, *args, **kwargs):
        time.sleep(0.1 * len(xb) + 0.5)
        return real(self, xb, *args, **kwargs)

    monkeypatch.setattr(CrownCertifier, "margin_lower", slow)
    rows = certify_batch(cert, x, y, 0.05, time_limit_s=0.1)
    assert {r["status"] for r in rows} == {"time_limit"} and not any(r["certified"] for r in rows)
    assert all(0.1 <= r["seconds"] < 0.5 for r in rows)  # 0.4 s of limit, shared by 4

    bounds = real(cert, x, y, 0.05)  # the batch's CROWN bounds, computed untimed

    def per_point(self, xb, *args, **kwargs):  # 0.15 s a point, whatever the machine's speed
        time.sleep(0.15 * len(xb))
        return bounds

    monkeypatch.setattr(CrownCertifier, "margin_lower", per_point)
    rows = certify_batch(cert, x, y, 0.05, time_limit_s=0.3)  # 0.6 s of a 1.2 s limit
    assert {r["status"] for r in rows} == {"ok"}, "the batch's limit is 4 bounds' limits"


def test_the_bench_times_batches_and_the_cost_model_takes_the_params_batch(tmp_path):
    """`python -m attncert.cost crown --bound-batch B` rows carry their batch and are merged
    apart from batch 1's; the cost model prices crown.batch_size at the largest batch measured
    on CUDA up to it (none larger: batch 1's seconds, no gain assumed)."""
    from test_crown_heads import small_crown_params

    from attncert.cost import crown_bench, pricing

    params = small_crown_params(methods=["crown"])
    rows = [next(crown_bench.bench_crown(params, "cpu", points=3, batch=b)) for b in (1, 2)]
    assert [r["batch"] for r in rows] == [1, 2] and {r["status"] for r in rows} == {"ok"}
    assert all(r["seconds_per_bound"] > 0 for r in rows)
    with pytest.raises(ValueError, match="batch"):
        next(crown_bench.bench_crown(params, "cpu", points=2, batch=0))
    path = tmp_path / "crown.json"
    cuda = [{"device": "cuda:0", "depth": 3, "method": "crown", "seconds_per_bound": s,
             "machine": "NVIDIA X", "date": "2026-11-29", "graph": crown_bench.GRAPH,
             **({"batch": b} if b else {})}
            for b, s in ((0, 8.0), (4, 2.5), (16, 1.0))]  # 0: a row from before batches
    crown_bench.merge_crown_bench(path, rows)
    crown_bench.merge_crown_bench(path, cuda)
    assert len(json.loads(path.read_text())["rows"]) == 5
    assert pricing.crown_bound_seconds(3, "crown", path) == (8.0, "measured on CUDA")
    assert pricing.crown_bound_seconds(3, "crown", path, batch=2) == (
        8.0, "measured on CUDA, one point a call (no batch measured)")
    assert pricing.crown_bound_seconds(3, "crown", path, batch=8) == (
        2.5, "measured on CUDA at batch 4")
    assert pricing.crown_bound_seconds(3, "crown", path, batch=16)[0] == 1.0


def test_the_rehearsal_bounds_the_stage_s_batch_in_one_call(monkeypatch):
    """The true-size rehearsal's crown kinds bound crown.batch_size points in one call (the
    batch the stage starts at), which its watchdog halves while it does not fit."""
    import dataclasses

    from attncert.pipeline import rehearse as rh
    from attncert.pipeline.shapes import VitShape
    from attncert.stages.registry import load_params

    c = dataclasses.replace(load_params()["crown"], batch_size=3,
                            vit=VitShape(patch=16, dim=8, depth=None, heads=2, mlp_hidden=8))
    prep = rh.crown_kind(1, rh.Setup({"crown": c}, torch.device("cpu")))
    assert prep.batch == 3 and prep.input_shape == [3, 32, 32]
    seen = []
    real = CrownCertifier.margin_lower
    monkeypatch.setattr(CrownCertifier, "margin_lower",
                        lambda self, xb, *a, **k: seen.append(len(xb)) or real(self, xb, *a, **k))
    prep.make(3)()
    prep.make(1)()
    assert seen == [3, 1]
