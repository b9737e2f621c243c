"""The rehearsal's machinery (attncert.pipeline.rehearse) on stand-in kinds of a few hundred MB:
each kind alone in a spawned process, the batch halved while it does not fit the memory cap,
a kind that never fits or raises recorded with its status, bad input refused before any work.
The true-size run itself is `make rehearse` (docs/rehearsal.md)."""

from __future__ import annotations

import json
import time

import pytest
import torch

from attncert.pipeline import rehearse as rh
from attncert.pipeline.params import ParamsError

MB = 2**20
#: the stand-ins' cap: a child with torch imported holds about 0.25 GB before any work
CAP_GB = 0.7


def _holding(mb: int, batch: int) -> rh.Prepared:
    """A kind whose step at batch b holds b x ``mb`` MB for a moment (pages written); above
    batch 2 it fails as PyTorch's CPU allocator does."""
    def make(b: int):
        def step() -> None:
            if b > 2:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to "
                                   "allocate 99 GB")
            held = b"\x01" * (b * mb * MB)
            time.sleep(0.3)  # the watchdog samples while it is held
            del held
        return step
    return rh.Prepared(7, [mb], batch, make, once=lambda b: f"once at batch {b}")


def halves_to_fit(s: rh.Setup) -> rh.Prepared:
    """Batch 4 fails to allocate, batch 2 (500 MB) passes the cap, batch 1 fits."""
    return _holding(250, 4)


def never_fits(s: rh.Setup) -> rh.Prepared:
    """1.2 GB at batch 1."""
    return _holding(1200, 1)


def raises(s: rh.Setup) -> rh.Prepared:
    raise ValueError("no such config\nsecond line")


FAKES = {"halves_to_fit": halves_to_fit, "never_fits": never_fits, "raises": raises}


def test_every_kind_is_recorded_with_its_status(tmp_path, capsys):
    out = tmp_path / "rehearsal.json"
    record = rh.rehearse(FAKES, rh.Setup(None, torch.device("cpu")), out, steps=1,
                         max_gb=CAP_GB, timeout_s=60)
    rows = {r["kind"]: r for r in record["rows"]}
    assert json.loads(out.read_text())["rows"] == record["rows"]
    assert list(rows) == list(FAKES)
    assert all(set(r) == set(rh.COLUMNS) for r in rows.values())

    fit = rows["halves_to_fit"]
    assert (fit["status"], fit["batch_requested"], fit["batch_used"]) == ("ok", 4, 1)
    assert fit["note"].startswith("batch 4 does not fit (RuntimeError: DefaultCPUAllocator")
    assert "; batch 2 does not fit (resident memory passed 0.7 GB); once at batch 1" in fit["note"]
    assert 0.25 < fit["host_peak_gb"] < CAP_GB and fit["seconds_per_step"] >= 0.3
    assert (fit["parameters"], fit["input_shape"], fit["steps"]) == (7, [250], 1)

    big = rows["never_fits"]
    assert big["status"] == "does not fit 0.7 GB" and big["batch_used"] == 1
    assert big["seconds_per_step"] is None and big["host_peak_gb"] > CAP_GB

    assert rows["raises"]["status"] == "error: ValueError: no such config"
    assert rows["raises"]["batch_used"] is None
    printed = capsys.readouterr().out
    assert "[1/3] halves_to_fit: starting" in printed
    assert "[1/3] halves_to_fit: ok, batch 1, " in printed
    assert "[3/3] raises: error: ValueError: no such config, peak " in printed


def test_an_unknown_kind_is_refused_before_any_work(capsys, monkeypatch):
    monkeypatch.setattr(rh, "rehearse", lambda *a, **k: pytest.fail("work started"))
    assert rh.main(["--kinds", "grid_vit,crown_L9", "--params", "missing.yaml"]) == 2
    err = capsys.readouterr().err
    assert "unknown kind(s) crown_L9; known: certvit_vit_b16, specformer_vit_s16" in err
    assert "crown_L5" in err


def test_the_paper_kinds_are_all_there():
    assert {"certvit_vit_b16", "specformer_vit_s16", "specformer_deit_ti", "text_bert_base",
            "grid_vit", "crown_L3", "crown_L4", "crown_L5"} <= set(rh.KINDS)


def test_only_the_paper_scale_is_rehearsed(tmp_path, capsys):
    params = tmp_path / "params.yaml"
    params.write_text("base: {scale: cpu}\n")
    with pytest.raises(ParamsError, match="base.scale is 'cpu'; the rehearsal needs the paper"):
        rh.load_paper_params(params)
    assert rh.main(["--params", str(params), "--steps", "0"]) == 2
    assert "--steps, --max-gb and --timeout must be positive" in capsys.readouterr().err


def test_peaks_round_up_so_a_stopped_kind_reads_past_its_cap():
    assert rh._peak(0.7 + 2**-20) == 0.71  # 1 kB past 0.7 GB: killed, recorded past the cap
    assert rh._peak(0.7) == 0.7 and rh._peak(12.111) == 12.12 and rh._peak(0.0) == 0.0
