"""The kernel count as CUDA launches it (an optimiser step multi-tensor) and the GPU calibration
that divides measured step times by it: its version, the refusal of a stale record, recount."""

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from attncert import cost
from attncert.cost import calibrate, counting
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]


def _mlp(layers: int) -> torch.nn.Module:
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])


def _optimiser_kernels(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    model(torch.randn(4, 16)).sum().backward()
    opt.step()  # the first step creates the state
    model(torch.randn(4, 16)).sum().backward()
    return counting.count(opt.step)[1]


def test_multi_tensor_launches_follow_cudas_loop():
    """A launch holds up to 210 tensors and 2240 chunks of 65536 elements; the next starts when
    either is full (meta tensors: the sizes without the memory)."""
    def sizes(*n):
        return [torch.empty(k, device="meta") for k in n]

    launches = counting.multi_tensor_launches
    assert launches(sizes(*[10] * 200)) == 1 and launches(sizes(*[10] * 210)) == 1
    assert launches(sizes(*[10] * 211)) == 2 and launches(sizes(*[10] * 420)) == 2
    assert launches(sizes(2240 * 65536)) == 1 and launches(sizes(2240 * 65536 + 1)) == 2
    assert launches(sizes(65537, 65537, 65537)) == 1  # 6 chunks
    assert launches(sizes(0, 10, 0)) == 1 and launches([]) == 0  # empty tensors skipped


def test_the_counted_optimiser_step_launches_as_on_cuda_not_per_parameter():
    """The cost model's AdamW step is multi-tensor, as torch runs it for parameters on CUDA:
    its count does not grow with the parameters; the CPU's default loop does (the count
    before version 2)."""
    counts = {n: _optimiser_kernels(m, counting.counted_optimizer(m.parameters()))
              for n, m in ((2, _mlp(2)), (20, _mlp(20)))}
    assert counts[2] == counts[20] <= 20, counts
    m = _mlp(20)
    looped = _optimiser_kernels(m, torch.optim.AdamW(m.parameters(), lr=1e-4, foreach=False))
    assert looped > 10 * counts[20], (looped, counts)
    # a training step's count holds the multi-tensor step: a model of 10x the parameters
    # adds its forward and backward kernels, not ten times AdamW's
    step = {n: counting.count(counting.train_step(
        _mlp(n), lambda b: (torch.randn(b, 16), torch.zeros(b, dtype=torch.long)))(4))[1]
        for n in (2, 20)}
    fwd_bwd = {n: counting.count(lambda n=n: _mlp(n)(torch.randn(4, 16)).sum().backward())[1]
               for n in (2, 20)}
    assert step[20] - step[2] <= fwd_bwd[20] - fwd_bwd[2] + 2, (step, fwd_bwd)


def test_a_gpu_calibration_sets_the_per_kernel_constant(smoke, tmp_path):
    """make gpu-check's file replaces the default per-kernel constant; the cost table says
    where it was measured; the measurement refuses a CPU."""
    GPUS = counting.GPUS
    p = load_params(smoke)
    with pytest.raises(ValueError, match="measures a GPU"):
        calibrate.measure(p, "cpu", path=tmp_path / "never.json")
    rows = [{"model": "OLSA text", "ms_per_step": 2.0}, {"model": "LoFAST text",
                                                          "ms_per_step": 50.0}]
    per = calibrate.kernel_seconds(rows, p, batch=8)
    assert set(per) == {"OLSA text", "LoFAST text"} and all(v > 0 for v in per.values())
    gpu = GPUS["h100"]
    assert calibrate.calibrated(gpu, tmp_path / "missing.json") is gpu
    (tmp_path / "c.json").write_text(json.dumps({"kernel_seconds": 2e-5, "device": "NVIDIA X",
                                                 "date": "2026-11-25", "from": "OLSA text",
                                                 "counting": calibrate.COUNTING}))
    measured = calibrate.calibrated(gpu, tmp_path / "c.json")
    assert measured.kernel_seconds == 2e-5 and "NVIDIA X" in measured.calibration
    table = cost.cost_table(p, measured)
    assert "20 us per kernel (measured: NVIDIA X, 2026-11-25" in table
    assert "(not measured)" in cost.cost_table(p, gpu)
    # a record with every kind's step: each stage costed with its own kind's constant (text:
    # the largest of its kinds), anything else with the largest measured
    steps = [{"model": m, "seconds_per_kernel": v} for m, v in (
        ("lipschitz ViT (train_vit)", 29e-6), ("standard ViT (specformer vanilla)", 17e-6),
        ("SpecFormer (MSVP)", 26e-6), ("OLSA text", 21e-6), ("LoFAST text", 25e-6),
        ("standard text", 19e-6))]
    (tmp_path / "k.json").write_text(json.dumps({"kernel_seconds": 17e-6, "device": "NVIDIA X",
                                                 "date": "2026-11-26", "steps": steps,
                                                 "counting": calibrate.COUNTING}))
    kinds = calibrate.calibrated(gpu, tmp_path / "k.json")
    assert kinds.kernel_seconds == 29e-6  # not the smallest kind's 17 us
    assert kinds.kernel_seconds_for("certify_vit") == 29e-6
    assert kinds.kernel_seconds_for("certvit") == 17e-6
    assert kinds.kernel_seconds_for("text") == 25e-6 and kinds.kernel_seconds_for("data") == 29e-6
    assert "certvit 17, " in cost.cost_table(p, kinds)
    # a measured kind prices the work on its models before its stage's constant
    assert kinds.kernel_seconds_for("specformer", "standard ViT (specformer vanilla)") == 17e-6
    assert kinds.kernel_seconds_for("specformer", "") == 26e-6
    assert kinds.kernel_seconds_for("text", "OLSA text") == 21e-6
    # without make gpu-check's own file, the committed GPU measurement gives the constants
    committed = json.loads((ROOT / calibrate.COMMITTED_CALIBRATION).read_text())
    assert committed["kernel_seconds"] > 0 and committed["steps"][0]["device"].startswith("cuda")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(ROOT)
        if not Path(calibrate.CALIBRATION_FILE).is_file():
            assert calibrate.calibrated(gpu).kernel_seconds == max(
                r["seconds_per_kernel"] for r in committed["steps"] if "seconds_per_kernel" in r)


def test_a_calibration_of_another_kernel_count_is_refused_until_recounted(smoke, tmp_path,
                                                                          capsys):
    """A record's constants divide its step times by the count of its version: one of another
    version is refused (the cost CLI and the pilot say so in a line, before any work), and
    recount divides the measured step times by the current count, for the steps that still
    count the record's way as the record did (the code it measured); the others lose their
    constant and are named."""
    from attncert.cost.cli import main

    p = load_params(smoke)
    rows = [{"model": "OLSA text", "ms_per_step": 2.0, "status": "ok"},
            {"model": "LoFAST text", "ms_per_step": 50.0, "status": "ok"},
            {"model": "standard text", "ms_per_step": 9.0, "status": "ok"}]
    then = calibrate.step_kernels(rows, p, 8, version=1)
    assert all(then[m] > calibrate.step_kernels(rows, p, 8)[m] for m in then)  # per parameter
    then["standard text"] = round(then["standard text"] * 1.1)  # its code changed since
    old = {"date": "2026-11-28", "device": "NVIDIA X", "batch": 8, "kernel_seconds": 1e-5,
           "from": "LoFAST text", "steps": [
               dict(r, seconds_per_kernel=r["ms_per_step"] / 1e3 / then[r["model"]])
               for r in rows]}
    path = tmp_path / "gpu_check.json"
    path.write_text(json.dumps(old))
    gpu = counting.GPUS["h100"]
    with pytest.raises(ValueError, match="kernel count version 1.*recount"):
        calibrate.calibrated(gpu, path)
    with pytest.raises(SystemExit):
        main(["table", "--params", str(smoke), "--calibration", str(path)])
    assert "measure again (make gpu-check)" in capsys.readouterr().err
    assert main(["recount", "--params", str(smoke), "--calibration", str(path)]) == 0
    assert "not recounted, measure again (make gpu-check): standard text" in (
        capsys.readouterr().out)
    record = json.loads(path.read_text())
    per = calibrate.kernel_seconds(rows[:2], p, 8)
    assert record["counting"] == counting.COUNTING and record["recounted"]
    assert {r["model"]: r.get("seconds_per_kernel") for r in record["steps"]} == per | {
        "standard text": None}
    assert set(record["recount_refused"]) == {"standard text"}
    assert record["kernel_seconds"] == max(per.values()) and record["from"] == max(per, key=per.get)
    kinds = calibrate.calibrated(gpu, path)  # the text stage lacks a kind: the largest
    assert kinds.kernel_seconds == max(per.values()) == kinds.kernel_seconds_for("text")
    # recounted under other params (other shapes), no step counts as it was measured
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match="no step counts as it was measured"):
        calibrate.recount(load_params(ROOT / "params.yaml"), path)
    # a record of one constant (no step times) cannot be recounted
    path.write_text(json.dumps({"kernel_seconds": 2e-5, "device": "X", "date": "d", "from": "m"}))
    with pytest.raises(ValueError, match="no measured step times"):
        calibrate.recount(p, path)
    # the pilot refuses a stale calibration of its machine before it runs anything
    from attncert.pipeline import pilot

    repo = tmp_path / "repo"
    (repo / "reports").mkdir(parents=True)
    shutil.copy(smoke, repo / "params.yaml")
    (repo / "dvc.yaml").write_text("stages: {}\n")
    (repo / "reports" / "gpu_check.json").write_text(json.dumps(old))
    capsys.readouterr()
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(repo)
        with pytest.raises(SystemExit) as exc:
            pilot.main([])
    assert exc.value.code == 2 and not (repo / ".pilot").exists()
    assert "reports/gpu_check.json: its constants divide by kernel count version 1" in (
        capsys.readouterr().err)


def test_the_committed_calibration_is_counted_with_the_current_count():
    """docs/gpu_check.json loads: its constants divide by the kernel count this code makes."""
    committed = json.loads((ROOT / calibrate.COMMITTED_CALIBRATION).read_text())
    assert committed["counting"] == counting.COUNTING
    for r in committed["steps"]:  # each constant its step time over the kernels it names
        assert ("seconds_per_kernel" in r) != (r["model"] in committed["recount_refused"])
        if "seconds_per_kernel" in r:
            assert r["seconds_per_kernel"] == pytest.approx(r["ms_per_step"] / 1e3 / r["kernels"])
    calibrate.calibrated(counting.GPUS["h100"], ROOT / calibrate.COMMITTED_CALIBRATION)


def test_a_calibration_keeps_a_failed_step_without_a_constant(smoke, tmp_path, monkeypatch):
    """A kind whose step failed on the GPU keeps its status and no constant (not a NaN that
    would reach the cost table); a calibration where no step ran is refused."""
    from attncert.cost import bench
    from attncert.pipeline import device

    monkeypatch.setattr(device, "resolve_device", lambda d: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA X")
    rows = [{"model": "OLSA text", "ms_per_step": 2.0, "status": "ok"},
            {"model": "LoFAST text", "ms_per_step": float("nan"), "status": "RuntimeError: x"}]
    monkeypatch.setattr(bench, "bench_training", lambda params, **kw: rows)
    p, path = load_params(smoke), tmp_path / "c.json"
    record = calibrate.measure(p, "cuda", path=path)
    assert record["from"] == "OLSA text" and record["counting"] == counting.COUNTING
    assert "seconds_per_kernel" not in record["steps"][1]
    assert record["steps"][0]["seconds_per_kernel"] == pytest.approx(
        2e-3 / record["steps"][0]["kernels"])
    assert calibrate.calibrated(counting.GPUS["h100"], path).kernel_seconds == (
        record["kernel_seconds"])
    rows[0] |= {"ms_per_step": float("nan"), "status": "RuntimeError: y"}
    with pytest.raises(ValueError, match="no model kind's training step ran"):
        calibrate.measure(p, "cuda", path=path)


def test_work_takes_the_measured_constant_of_the_model_it_runs(smoke):
    """Each work item names the bench kind of the model it runs: a training run its step's,
    the rest the model's forward's (an MSVP model's is the standard ViT's), so the cost model
    prices it at that kind's measured constant; a model of no bench kind (the frozen-encoder
    head) takes its stage's."""
    work, _ = cost.stage_work(load_params(smoke))
    kinds = {(w.stage, w.model) for w in work}
    assert ("specformer", "SpecFormer (MSVP)") in kinds
    assert ("specformer", "standard ViT (specformer vanilla)") in kinds
    assert {m for s, m in kinds if s == "text"} >= {"OLSA text", "LoFAST text", "standard text"}
    assert {m for s, m in kinds if s in ("train_vit", "crown")} == {"lipschitz ViT (train_vit)"}
    # the MSVP models train as MSVP and are evaluated and attacked as the standard ViT
    assert all(w.kind == "bf16" and w.graphs for w in work if w.model == "SpecFormer (MSVP)")
    gpu = dataclasses.replace(counting.GPUS["h100"], kernel_seconds=9e-5,
                              kernel_seconds_by_stage=(("text", 5e-5),),
                              kernel_seconds_by_kind=(("OLSA text", 1e-5),))
    for w in work:
        if w.stage == "text" and w.kernels:
            per = w.kernel_seconds(gpu) / w.kernels
            assert per == pytest.approx(1e-5 if w.model == "OLSA text" else 5e-5)


def test_the_fused_attention_counts_the_flops_of_its_products():
    """The CPU's fused attention kernel (which the count runs) has no FLOP formula in torch:
    it is counted as torch counts the CUDA kernels, the forward as the two products it
    replaces, so the FLOP-bound stages do not lose their attention."""
    from attncert.layers import MultiHeadAttention

    torch.manual_seed(0)
    att = MultiHeadAttention(16, 4, lipschitz=False)
    x = torch.randn(3, 9, 16)

    def explicit():
        heads = att.compute_probs(x) @ att._split(att.v(x))
        return att.o(heads.transpose(1, 2).reshape(3, 9, 16))

    with torch.no_grad():
        fused, plain = counting.count(lambda: att(x)), counting.count(explicit)
    assert fused[0] == plain[0] > 4 * 3 * 9 * 16 * 16  # the projections and both products
    assert fused[1] < plain[1]
    y = x.clone().requires_grad_(True)
    flops, _ = counting.count(lambda: att(y).sum().backward())
    assert flops >= 3 * plain[0]  # the backward's products counted too


def test_the_msvp_weights_change_no_count_so_one_count_serves_every_lambda():
    """The MSVP penalty launches the same kernels and FLOPs whatever its weights (a zero weight
    included), so the counts are cached per whether it runs: SpecFormer's Table 5 sweep counts
    its model once. Without the penalty the step counts less."""
    from attncert.cost.counting import _vit_counts, vit_counts
    from attncert.models import ViTConfig

    cfg = ViTConfig(image_size=16, channels=3, patch=8, dim=32, depth=2, heads=2,
                    mlp_hidden=32, num_classes=10, kind="standard", pool="cls")
    sweep = _vit_counts(cfg, msvp_lambda=(5e-5, 3e-5, 0.0))["train"]
    assert _vit_counts(cfg, msvp_lambda=(1.0, 1.0, 1.0))["train"] == sweep
    plain = _vit_counts(cfg)["train"]
    assert plain.kernels < sweep.kernels
    assert vit_counts(cfg, (5e-5, 3e-5, 3e-5)) is vit_counts(cfg, (1e-3, 1e-3, 1e-3))
    assert vit_counts(cfg, (0.0, 0.0, 0.0))["train"] == vit_counts(cfg)["train"] == plain


def test_the_diagnostics_are_counted_as_they_run_their_hooks_included(smoke):
    """The attention diagnostics are priced at their own call, not as three forward passes: in
    the trained pass each layer's hook recomputes its attention matrix, entropy and largest
    logit, and the ablations skip the scores (a ViT in float64 and float32: more kernels than
    three forwards, no fewer FLOPs; a text model of the smoke plan: the call's own kernels);
    a model without attention is refused."""
    from attncert.cost.pricing import counts, diagnostics_counts
    from attncert.diagnostics import attention_diagnostics
    from attncert.pipeline import jobs as J
    from attncert.stages.registry import stage_jobs
    from attncert.text.tokenize import VOCAB

    params = load_params(smoke)
    diagnosed = {j.model.kind: j.model for j in stage_jobs(params)
                 if any(isinstance(ph, J.Diagnostics) for ph in j.phases)}
    assert {"vit", "text"} <= set(diagnosed)
    vit = diagnosed["vit"]
    for fp64, fwd in ((True, counting.vit_forward64(vit.config)),
                      (False, counting.vit_counts(vit.config)["forward"])):
        d = diagnostics_counts(vit, fp64)
        assert d.kernels > 3 * fwd.kernels and d.per_sample >= 3 * fwd.per_sample
    text = diagnosed["text"]
    model, n = text.build(), text.max_len
    ids, mask = torch.randint(1, VOCAB, (1, n)), torch.ones(1, n, dtype=torch.bool)
    y = torch.zeros(1, dtype=torch.long)
    call = counting.count(lambda: attention_diagnostics(model, (ids, mask), y, 1))
    d = diagnostics_counts(text, False)
    assert d.kernels == call[1] != 3 * counts(text)["forward"].kernels
    assert d.per_call + d.per_sample == pytest.approx(call[0])
    with pytest.raises(ValueError, match="no attention diagnostics"):
        diagnostics_counts(J.Model("linear", (1, 28, 10)), False)
