"""The CUDA-graph speed-up in the cost model (attncert.cost.graphs): counted only when the
params train under graphs, per measured step kind, on the kernels of training runs only."""

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import params_with

from attncert.cost.counting import GPUS, Counts
from attncert.cost.graphs import (
    COMPILE_BENCH,
    FROZEN_HEAD,
    LIPSCHITZ_VIT,
    MSVP_VIT,
    OLSA_TEXT,
    STANDARD_TEXT,
    STANDARD_VIT,
    estimated_speedups,
    graphs_key,
    with_graphs,
)
from attncert.cost.table import _estimated_row
from attncert.cost.work import Work, training_work
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]


def test_the_committed_record_names_its_measurement():
    record = json.loads((ROOT / COMPILE_BENCH).read_text())
    assert record["device"] and record["date"] and record["batch"] > 0
    keys = {r["key"] for r in record["steps"]}
    assert graphs_key("lipschitz ViT (train_vit)", "lmt") in keys
    olsa = next(r for r in record["steps"] if r["key"] == "OLSA text")
    assert olsa["graphs_ms"] is None  # its capture fails: it trains eager, nothing counted


def test_speedups_are_counted_only_when_the_params_train_under_graphs(smoke, tmp_path):
    h100 = GPUS["h100"]
    for mode, counted in (("off", False), ("compile", False), ("auto", True),
                          ("graphs", True)):
        params = load_params(params_with(smoke, tmp_path, "base", "compile", mode))
        gpu = with_graphs(h100, params, ROOT / COMPILE_BENCH)
        assert bool(gpu.graphs_speedup) == counted, mode
    assert dict(gpu.graphs_speedup)["lipschitz ViT (train_vit)"] > 1
    assert "OLSA text" not in dict(gpu.graphs_speedup)
    assert gpu.graphs_speedup_for("OLSA text") == gpu.graphs_speedup_for("") == 1.0
    assert with_graphs(h100, params, tmp_path / "missing.json") is h100


def test_only_a_training_runs_kernels_get_faster():
    gpu = dataclasses.replace(GPUS["h100"], kernel_seconds=1e-5,
                              graphs_speedup=(("kind", 4.0),))
    kernel_bound = Work("s", "train", "bf16", flops=1.0, kernels=1e6, graphs="kind")
    assert kernel_bound.seconds(gpu, 0.3) == pytest.approx(10.0 / 4)
    assert dataclasses.replace(kernel_bound, graphs="").seconds(gpu, 0.3) == pytest.approx(10.0)
    flop_bound = Work("s", "train", "bf16", flops=1e18, kernels=1.0, graphs="kind")
    assert flop_bound.seconds(gpu, 0.3) == pytest.approx(1e18 / (gpu.bf16 * 0.3))
    c = {k: Counts(per_call=0.0, per_sample=1.0, kernels=10.0)
         for k in ("train", "forward", "attack")}
    plain = training_work("s", "w", c, 10, 10, 1, 5, 5, graphs="kind")
    adversarial = training_work("s", "w", c, 10, 10, 1, 5, 5, attack_steps=3, graphs="kind")
    assert [w.graphs for w in plain] == ["kind", ""]  # the evaluation runs eager
    # PGD training is a step kind of its own: eager until that kind is measured under graphs
    assert [w.graphs for w in adversarial] == ["kind, PGD training", ""]
    assert adversarial[0].seconds(gpu, 0.3) == pytest.approx(2 * 40 * 1e-5)  # 2 steps, eager


def test_audits_take_their_kinds_measured_step(smoke):
    """A PGD audit on a compiled attack copy is the audit step kind of its model's kind;
    SpecFormer's table attacks (the float32 model itself, eager) count eager; the frozen-encoder
    head's audits are its kind's (a bench kind since 2026-11-30)."""
    from attncert.cost.table import stage_work

    work = stage_work(load_params(smoke), ("certify_vit", "frontier", "specformer", "text"))[0]
    audits = {w.stage: set() for w in work}
    for w in work:
        if w.kind == "tf32":
            audits[w.stage].add(w.graphs)
    assert audits["certify_vit"] == {"lipschitz ViT (train_vit), PGD audit"}
    assert audits["frontier"] == {"lipschitz ViT (train_vit), PGD audit",
                                  "standard ViT (specformer vanilla), PGD audit", ""}  # linear
    assert "" in audits["specformer"]
    assert audits["text"] == {"OLSA text, PGD audit", "LoFAST text, PGD audit",
                              "standard text, PGD audit", f"{FROZEN_HEAD}, PGD audit"}
    gpu = dataclasses.replace(GPUS["h100"], kernel_seconds=1e-5, graphs_speedup=(
        ("lipschitz ViT (train_vit), PGD audit", 4.0),))
    audit = next(w for w in work if w.stage == "certify_vit" and w.kind == "tf32")
    assert audit.kernel_seconds(gpu) == pytest.approx(audit.kernels * 1e-5 / 4)


def test_the_imagenet_vits_audits_are_standard_vit_audit_steps(smoke, tmp_path):
    """Table 3's hub ViTs (loaded and adapted) are standard ViTs: their PGD audits, on the
    compiled attack copy as every audit, are the standard ViT's audit step kind, so the
    estimate row can price them; they train nothing."""
    from attncert.certvit.plan import jobs
    from attncert.cost.pricing import audit_graphs, graphs

    hub = params_with(smoke, tmp_path, "certvit", "imagenet",
                      {"sources": ["facebook/deit-tiny-patch16-224"], "calibration": 10})
    imagenet = [j for j in jobs(load_params(hub)) if j.unit == "certvit_imagenet"]
    assert len(imagenet) == 1 + len(load_params(hub)["certvit"].constrain)
    assert {audit_graphs(j.model) for j in imagenet} == {graphs_key(STANDARD_VIT, audit=True)}
    assert {graphs(j.model) for j in imagenet} == {STANDARD_VIT}  # were one trained
    assert not any(type(ph).__name__ == "Train" for j in imagenet for ph in j.phases)


def test_graphs_keys():
    assert graphs_key("lipschitz ViT (train_vit)") == "lipschitz ViT (train_vit)"
    assert graphs_key("lipschitz ViT (train_vit)", "lofast", True) == \
        "lipschitz ViT (train_vit), margin lofast, MSVP"
    assert graphs_key("SpecFormer (MSVP)", msvp=True) == "SpecFormer (MSVP)"
    assert graphs_key("SpecFormer (MSVP)", adversarial=True) == "SpecFormer (MSVP), PGD training"
    assert graphs_key("lipschitz ViT (train_vit)", "lmt", audit=True) == \
        "lipschitz ViT (train_vit), PGD audit"


def test_the_pilot_calibrates_the_stages_of_each_finished_unit_kind(tmp_path):
    from attncert.cost.graphs import with_pilot

    h100 = GPUS["h100"]
    assert with_pilot(h100, tmp_path / "none.json") is h100
    record = {"date": "2026-12-01", "units": {
        "grid point": {"status": "ok", "calibration": 2.0},
        "crown": {"status": "ok", "calibration": 0.5},
        "text": {"status": "failed in text_unit@yelp_polarity"},
        "certvit": {"status": "ok", "calibration": float("nan")}}}
    path = tmp_path / "pilot.json"
    path.write_text(json.dumps(record))
    gpu = with_pilot(h100, path)
    assert dict(gpu.pilot_by_stage) == {"train_vit": 2.0, "certify_vit": 2.0, "crown": 0.5}
    work = Work("certify_vit", "x", "fp64", flops=0.0, kernels=1e6)
    assert work.seconds(gpu, 0.3) == pytest.approx(2 * work.seconds(h100, 0.3))
    assert Work("text", "x", "fp64", 0.0, 1e6).seconds(gpu, 0.3) == \
        Work("text", "x", "fp64", 0.0, 1e6).seconds(h100, 0.3)


def test_a_graphs_bench_is_merged_into_the_record(tmp_path):
    """bench --write-compile: each step kind's eager and CUDA-graph times replace its row; a
    kind whose graphs failed keeps no speed-up (None, the failure as its note); rows measured
    before keep their device and date."""
    from attncert.cost import graphs

    def row(model, ms, status="ok"):
        return {"model": model, "ms_per_step": ms, "status": status}

    training = {"eager": [row("OLSA text", 36.0), row("standard text", 10.0)],
                "graphs": [row("OLSA text", 4.0), row("standard text", float("nan"), "Err: x")]}
    margins = {"eager": [{"margin": "none", "ms_per_step": 30.0, "status": "ok"},
                         {"margin": "lmt", "ms_per_step": 31.0, "status": "ok"}],
               "graphs": [{"margin": "lmt", "ms_per_step": 5.0, "status": "ok"}]}
    rows = graphs.compile_rows(training, margins)
    assert [r["key"] for r in rows] == ["OLSA text", "standard text",
                                        "lipschitz ViT (train_vit), margin lmt"]
    assert rows[0]["graphs_ms"] == 4.0 and rows[1]["graphs_ms"] is None
    assert rows[1]["note"] == "Err: x" and rows[2]["graphs_ms"] == 5.0
    path = tmp_path / "compile.json"
    path.write_text(json.dumps({"date": "2026-11-28", "device": "H200", "steps": [
        {"key": "OLSA text", "eager_ms": 35.7, "graphs_ms": None, "note": "capture fails"},
        {"key": "LoFAST text", "eager_ms": 40.3, "graphs_ms": 3.6, "note": ""}]}))
    record = graphs.merge_compile_bench(path, rows, "H100", "2026-11-30", "2.13", 128, "bf16")
    by_key = {r["key"]: r for r in json.loads(path.read_text())["steps"]}
    assert record["date"] == "2026-11-30" and len(by_key) == 4
    assert by_key["OLSA text"]["graphs_ms"] == 4.0 and by_key["OLSA text"]["device"] == "H100"
    assert by_key["LoFAST text"]["date"] == "2026-11-28"  # not re-measured: kept as it was


def test_the_gpu_bench_commands_write_their_records(smoke, tmp_path, monkeypatch, capsys):
    """make gpu-bench's two commands, with the timings stubbed: --write-compile merges the
    graphs speed-ups, --concurrent-only --write-concurrency the K-process rows (every kind),
    and a flag without what it needs stops with one line."""
    from attncert.cost import cli, plan

    def training(params, batch, steps, device, mode="eager", only=(), adversarial=False):
        timed.append((only, mode))
        return [{"model": m, "ms_per_step": 10.0 if mode == "eager" else 2.0, "status": "ok",
                 "first_step_s": 0.0, "parameters": 1, "shape": "", "device": "cpu",
                 "precision": "fp32"} for m in ("OLSA text", "standard text") if m in only]

    def margins(params, batch, steps, device, mode="eager"):
        return [{"margin": "lmt", "ms_per_step": 8.0 if mode == "eager" else 4.0, "first_step_s": 0,
                 "status": "ok", "vs_lmt": 1.0}]

    def concurrent(params, batch, ks, steps, device, mode, kind):
        return [{"kind": kind, "k": k, "mode": mode, "batch": batch, "ms_per_step": 1.0 + k,
                 "steps_per_s": 1.0, "speedup": 1.0} for k in ks]

    def audits(params, batch, steps, device, mode="eager", only=()):
        key = "lipschitz ViT (train_vit), PGD audit"
        return [{"model": key, "status": "ok", "ms_per_step": 6.0 if mode == "eager" else 1.5,
                 "first_step_s": 0.0, "parameters": 1, "shape": "", "device": "cpu",
                 "precision": "fp32"}] if key in only else []

    timed = []

    monkeypatch.setattr(cli, "bench_training", training)
    monkeypatch.setattr(cli, "bench_audits", audits)
    monkeypatch.setattr(cli, "bench_margins", margins)
    monkeypatch.setattr(cli, "bench_concurrency", concurrent)
    monkeypatch.setattr(cli, "cuda_name", lambda device: "a GPU")
    compile_path, conc_path = tmp_path / "compile.json", tmp_path / "concurrency.json"
    cli.main(["bench", "--params", str(smoke), "--device", "cpu", "--modes", "eager", "graphs",
              "--write-compile", str(compile_path)])
    steps = {r["key"]: r for r in json.loads(compile_path.read_text())["steps"]}
    assert steps["OLSA text"]["graphs_ms"] == 2.0
    assert timed[:2] == [(("lipschitz ViT (train_vit)",), "eager"),
                         (("lipschitz ViT (train_vit)",), "graphs")]  # kind by kind
    assert steps["lipschitz ViT (train_vit), margin lmt"]["graphs_ms"] == 4.0
    assert steps["lipschitz ViT (train_vit), PGD audit"]["graphs_ms"] == 1.5
    cli.main(["bench", "--params", str(smoke), "--device", "cpu", "--modes", "graphs",
              "--concurrent", "1", "4", "--kinds", "all", "--concurrent-only",
              "--write-concurrency", str(conc_path)])
    table = plan.concurrency(conc_path)
    assert len(table) == 7 and all(by_k[4] == pytest.approx(5 / 2) for by_k in table.values())
    assert {r["device"] for r in json.loads(conc_path.read_text())["rows"]} == {"a GPU"}
    for argv, match in ((["--modes", "eager", "--write-compile", str(compile_path)],
                         "needs --modes eager graphs"),
                        (["--concurrent-only"], "needs --concurrent"),
                        (["--write-concurrency"], "needs --concurrent"),
                        (["--kinds", "a ViT"], "--kinds"),
                        (["--concurrent", "1", "--kinds", "margins"], "no model kind"),
                        (["--concurrent", "1", "--kinds", "a ViT"], "--kinds")):
        with pytest.raises(SystemExit):
            cli.main(["bench", "--params", str(smoke), "--device", "cpu", *argv])
        assert match in capsys.readouterr().err
    monkeypatch.setattr(cli, "cuda_name", lambda device: None)  # a CPU: no CUDA record
    with pytest.raises(SystemExit):
        cli.main(["bench", "--params", str(smoke), "--device", "cpu", "--modes", "eager",
                  "graphs", "--write-compile", str(compile_path)])
    assert "not a GPU" in capsys.readouterr().err


def test_a_failed_eager_time_counts_no_speed_up():
    from attncert.cost import graphs

    nan = float("nan")
    rows = graphs.compile_rows(
        {"eager": [{"model": "OLSA text", "ms_per_step": nan, "status": "Err: x"}],
         "graphs": [{"model": "OLSA text", "ms_per_step": 4.0, "status": "ok"}]}, {})
    assert rows == []



def test_an_isolated_bench_run_returns_its_rows_or_why_it_failed(smoke):
    """On CUDA each kind is timed in a process of its own (a failed capture breaks its
    process's CUDA state for the kinds after it): per mode its rows come back, or the
    failure."""
    from attncert.cost.cli import isolated

    out = isolated(str(smoke), "bench_training", (2, 1, "cpu"), ["eager", "fast"],
                   only=("LoFAST text",))
    rows, why = out["eager"]
    assert why == "" and [(r["model"], r["status"]) for r in rows] == [("LoFAST text", "ok")]
    rows, why = out["fast"]
    assert rows is None and why.startswith("ValueError: mode 'fast'")


def test_unmeasured_kinds_are_estimated_from_the_kind_they_extend():
    """A PGD or MSVP variant takes its measured prefix's ratio (MSVP's at most where it adds the
    penalty), OLSA and the frozen head the slowest measured text kind's; a kind of nothing
    measured, none; the
    estimate is a row beside the total, which stays eager for those kinds."""
    gpu = dataclasses.replace(GPUS["h100"], kernel_seconds=1e-5, graphs_speedup=(
        (STANDARD_VIT, 5.0), (MSVP_VIT, 2.0), (graphs_key(LIPSCHITZ_VIT, "lmt"), 6.0),
        (STANDARD_TEXT, 3.0), ("LoFAST text", 11.0)))
    keys = [graphs_key(STANDARD_VIT, adversarial=True), graphs_key(STANDARD_VIT, audit=True),
            graphs_key(MSVP_VIT, adversarial=True), graphs_key(LIPSCHITZ_VIT, "lmt", msvp=True),
            OLSA_TEXT, graphs_key(OLSA_TEXT, audit=True), FROZEN_HEAD,
            graphs_key(FROZEN_HEAD, audit=True), graphs_key(LIPSCHITZ_VIT), STANDARD_VIT, "",
            graphs_key(STANDARD_VIT, adversarial=True)]
    assert dict(estimated_speedups(gpu, keys)) == {
        graphs_key(STANDARD_VIT, adversarial=True): 5.0,
        graphs_key(STANDARD_VIT, audit=True): 5.0,
        graphs_key(MSVP_VIT, adversarial=True): 2.0,
        graphs_key(LIPSCHITZ_VIT, "lmt", msvp=True): 2.0,
        OLSA_TEXT: 3.0, graphs_key(OLSA_TEXT, audit=True): 3.0, FROZEN_HEAD: 3.0,
        graphs_key(FROZEN_HEAD, audit=True): 3.0}  # nothing for the plain ViT
    assert estimated_speedups(dataclasses.replace(gpu, graphs_speedup=()), keys) == ()
    work = [Work("s", "a", "bf16", flops=1.0, kernels=1e6, graphs=OLSA_TEXT),
            Work("s", "b", "bf16", flops=1.0, kernels=1e6, graphs=STANDARD_TEXT)]
    total = sum(w.seconds(gpu, 0.3) for w in work) / 3600
    assert total == pytest.approx((10.0 + 10.0 / 3) / 3600)  # OLSA counted eager
    (row,) = _estimated_row(work, gpu, 0.3, total)
    assert row.startswith(f"| total, the unmeasured kinds estimated | - | "
                          f"{(10.0 / 3 + 10.0 / 3) / 3600:.3g} |")
    assert f"{OLSA_TEXT} 3x" in row
    assert _estimated_row(work[1:], gpu, 0.3, total) == []  # every kind measured: no row
