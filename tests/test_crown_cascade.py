"""alpha-CROWN after CROWN (crown.alpha_after_crown): alpha-CROWN bounds only the pairs CROWN
did not certify; the cascade certifies what either method alone does, runs fewer alpha-CROWN
bounds, and its seconds are both methods'."""

import dataclasses
import json

import pandas as pd
import pytest
import torch
from test_crown import small_unit, tiny_vit

from attncert.crown import study
from attncert.crown.tables import tables
from attncert.pipeline.context import make_context
from attncert.pipeline.params import ParamsError
from attncert.stages import crown as stage
from attncert.stages.registry import load_params

EPS = [0.02, 0.05, 0.1]


def _points(n: int = 8, seed: int = 3):
    model = tiny_vit()
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, 8, 8, generator=g, dtype=torch.float64)
    return model, x, model(x).argmax(1)


def _certified(rows: pd.DataFrame, n: int) -> torch.Tensor:
    return torch.stack([study.crown_certified(rows, n, e) for e in EPS], 1)


def test_the_cascade_certifies_what_either_method_does_with_fewer_alpha_bounds():
    """A pair CROWN certified is not bounded again (status "crown", certified, 0 s, batch 0);
    alpha-CROWN runs on the others, as alone (one point a call: its bounds do not move with a
    batch); the cascade certifies every pair CROWN or alpha-CROWN alone certifies."""
    model, x, y = _points()
    n = len(y)
    crown, _ = study.crown_frame(model, x, y, EPS, "crown", 0.0, 5)
    alone, _ = study.crown_frame(model, x, y, EPS, "alpha_crown", 0.0, 5)
    proven = _certified(crown, n)
    assert proven.any() and not proven.all(), "the tiny model certifies some pairs, not all"
    cascade, _ = study.crown_frame(model, x, y, EPS, "alpha_crown", 0.0, 5, proven=proven)
    by_crown = cascade[cascade["status"] == study.PROVEN]
    assert len(by_crown) == int(proven.sum())
    assert by_crown["certified"].all() and (by_crown["seconds"] == 0).all()
    assert (by_crown["batch"] == 0).all() and set(by_crown["method"]) == {"alpha_crown"}
    ran = cascade[~cascade["status"].isin(study.NOT_RUN)]
    assert 0 < len(ran) < int((~alone["status"].isin(study.NOT_RUN)).sum())
    both = _certified(cascade, n)
    assert (both >= (proven | _certified(alone, n))).all()
    # where alpha-CROWN ran in both runs, its bound is the one it gives alone
    key = ["index", "eps"]
    pair = ran.merge(alone[~alone["status"].isin(study.NOT_RUN)], on=key, suffixes=("", "_a"))
    assert len(pair) == len(ran)
    assert (pair["margin_lower"] - pair["margin_lower_a"]).abs().max() < 1e-9
    with pytest.raises(ValueError, match="proven: expected shape"):
        study.crown_frame(model, x, y, EPS, "alpha_crown", 0.0, 5, proven=proven[:, :1])


def test_every_pair_proven_runs_no_alpha_bound(monkeypatch):
    """When CROWN certified every pair of every point, alpha-CROWN builds nothing and runs
    nothing; misclassified points stay "misclassified"."""
    from attncert.crown import CrownCertifier

    model, x, y = _points(4)
    y = y.clone()
    y[1] = (y[1] + 1) % 3
    correct = model(x).argmax(1) == y
    monkeypatch.setattr(CrownCertifier, "from_vit", lambda *a, **k: pytest.fail("built"))
    rows, build = study.crown_frame(model, x, y, EPS, "alpha_crown", 0.0, 5, correct=correct,
                                    proven=torch.ones(4, 3, dtype=torch.bool), batch_size=2)
    assert build == 0.0
    assert set(rows.loc[rows["index"] == 1, "status"]) == {"misclassified"}
    assert set(rows.loc[rows["index"] != 1, "status"]) == {study.PROVEN}


def test_the_cascade_s_tables_count_both_methods_seconds():
    """With ``prior`` (CROWN's rows) a pair's seconds are CROWN's plus alpha-CROWN's, a pair
    CROWN certified counts as a bound (CROWN's seconds), and the accuracy is the cascade's."""
    idx = [0, 0, 1, 1]
    eps = [0.02, 0.1]
    crown = pd.DataFrame({"index": idx, "eps": eps * 2, "method": "crown",
                          "certified": [True, False, False, False], "margin_lower": 0.0,
                          "seconds": [1.0, 2.0, 4.0, 0.0],
                          "status": ["ok", "ok", "ok", "skipped"], "batch": [1, 1, 1, 0]})
    alpha = pd.DataFrame({"index": idx, "eps": eps * 2, "method": "alpha_crown",
                          "certified": [True, True, True, False], "margin_lower": 0.0,
                          "seconds": [0.0, 10.0, 20.0, 30.0],
                          "status": [study.PROVEN, "ok", "ok", "ok"], "batch": [0, 1, 1, 1]})
    lofast = pd.DataFrame({"index": [0, 1], "correct": True, "radius": 0.0, "seconds": 0.5,
                           "certified_0.02": False, "certified_0.1": False})
    t1, t2 = tables(lofast, alpha, eps, 1, "CROWN-Optimized after CROWN", prior=crown)
    # per pair: (0, .02) 1 + 0, (0, .1) 2 + 10, (1, .02) 4 + 20, (1, .1) 0 + 30
    assert t1[1]["seconds_per_sample"] == pytest.approx((1 + 12 + 24 + 30) / 4)
    assert [r["crown_seconds"] for r in t2] == pytest.approx([(1 + 24) / 2, (12 + 30) / 2])
    assert [r["combined_seconds"] for r in t2] == pytest.approx([0.5 + 25 / 2, 0.5 + 42 / 2])
    assert [r["crown_acc"] for r in t2] == [100.0, 50.0]
    assert t1[1]["method"] == "CROWN-Optimized after CROWN"
    t1, _ = tables(lofast, alpha, eps, 1, "x")  # no prior: alpha-CROWN's own seconds
    assert t1[1]["seconds_per_sample"] == pytest.approx(60 / 3)


def test_alpha_after_crown_needs_crown_first():
    p = load_params()["crown"]
    assert p.alpha_after_crown and p.methods.index("crown") < p.methods.index("alpha_crown")
    with pytest.raises(ParamsError, match="crown before alpha_crown"):
        dataclasses.replace(p, methods=["alpha_crown", "crown"])
    dataclasses.replace(p, methods=["alpha_crown"])  # nothing to run first: alpha-CROWN alone
    dataclasses.replace(p, methods=["alpha_crown", "crown"], alpha_after_crown=False)


def test_a_unit_runs_the_cascade(tmp_path):
    """A unit with both methods: alpha-CROWN's rows name the pairs CROWN certified, its table
    rows say "after CROWN", and its certificates are audited with the others."""
    p, base = small_unit(tmp_path, n_test=6, cert_eps=[0.001, 0.1],
                         methods=["crown", "alpha_crown"], alpha_iterations=3,
                         skip_lofast_certified=False)
    rec = stage.run(p, make_context(base, item="mnist-L1",
                                    processed_dir=str(tmp_path / "processed"))).record
    rows = pd.DataFrame(rec["crown"])
    crown, alpha = (rows[rows["method"] == m] for m in ("crown", "alpha_crown"))
    want = crown.loc[crown["certified"], ["index", "eps"]].to_numpy().tolist()
    got = alpha.loc[alpha["status"] == study.PROVEN, ["index", "eps"]].to_numpy().tolist()
    assert got == want and want, "CROWN certifies some pair at eps 0.001"
    methods = [r["method"] for r in rec["table1"]]
    assert methods == ["LoFAST", "CROWN", "CROWN-Optimized after CROWN"]
    assert any(k == "broken_alpha_crown" for r in rec["audit"] for k in r)
    # CROWN's rows change (its journal rewritten as if a pair had not certified): the rerun
    # takes CROWN's rows from its journal and alpha-CROWN's afresh, none on a stale proof
    path = tmp_path / "w" / "ckpt" / "mnist" / "L1" / "crown-crown.jsonl"
    lines = path.read_text().splitlines()
    i, e = want[0]
    for k, line in enumerate(lines[1:], 1):
        rows_ = json.loads(line)
        if rows_[0]["index"] == i:
            lines[k] = json.dumps([dict(r, certified=False) if r["eps"] == e else r
                                   for r in rows_])
    path.write_text("".join(f"{line}\n" for line in lines))
    rec = stage.run(p, make_context(base, item="mnist-L1",
                                    processed_dir=str(tmp_path / "processed"))).record
    rows = pd.DataFrame(rec["crown"])
    alpha = rows[(rows["method"] == "alpha_crown") & (rows["index"] == i) & (rows["eps"] == e)]
    assert list(alpha["status"]) == ["ok"]  # bounded by alpha-CROWN itself this time
    # the journal is keyed by the certified weights too: rows of another model are not reused
    key = json.loads(path.read_text().splitlines()[0])["key"]
    assert len(key["weights"]) == 16 and key["method"] == "crown"


def test_alpha_crown_stops_once_every_point_of_a_call_is_certified(monkeypatch, capsys):
    """With ``stop_certified`` (the stage's) alpha-CROWN ends when all the call's points are
    certified: at a radius CROWN's relaxation already certifies them it takes no optimiser
    step; the points it certifies are those of the full run or more, each bound below the
    margins of sampled points, and auto_LiRPA's message stays out of the output."""
    from test_crown import sample_ball

    from attncert.crown import CrownCertifier

    steps = []
    real = torch.optim.Adam.step
    monkeypatch.setattr(torch.optim.Adam, "step",
                        lambda self, *a, **k: (steps.append(1), real(self, *a, **k))[1])
    model, x, y = _points(8)
    cert = CrownCertifier.from_vit(model, (1, 8, 8))
    for eps in (1e-4, 0.05, 0.1):
        steps.clear()
        full = cert.margin_lower(x, y, eps, "alpha_crown", 10, stop_certified=False)
        n_full = len(steps)
        steps.clear()
        stop = cert.margin_lower(x, y, eps, "alpha_crown", 10)
        assert n_full == 9 and len(steps) <= n_full  # no step after the last iteration
        assert ((stop.min(1).values > 0) >= (full.min(1).values > 0)).all()
        if (full.min(1).values > 0).all():
            assert len(steps) < n_full
        if eps == 1e-4:
            assert (stop.min(1).values > 0).all() and len(steps) == 0
        g = torch.Generator().manual_seed(1)
        for i in range(len(y)):
            with torch.no_grad():
                logits = model(sample_ball(x[i:i + 1], eps, 200, g))
            gaps = logits[:, y[i]:y[i] + 1] - logits
            others = [j for j in range(3) if j != int(y[i])]
            assert (gaps[:, others] >= stop[i] - 1e-9).all()
    assert "verified" not in capsys.readouterr().out
