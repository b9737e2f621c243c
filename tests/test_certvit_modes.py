"""The CertViT stage's constraining modes side by side, a whole run of the stage with its files,
and Table 3's ImageNet route on a tiny HF ViT."""

import dataclasses

import matplotlib
import pandas as pd
import pytest
import torch
from helpers import PRESETS, tiny_vit
from helpers import processed_images as dataset
from matplotlib.figure import Figure

from attncert import soundness
from attncert.certvit import (
    NORMS,
    Adaptation,
    DRConfig,
    adapt,
    global_bound,
    steps,
)
from attncert.certvit import methods as stage
from attncert.certvit import params as cv_params
from attncert.certvit import tables as cv_tables
from attncert.figures import certvit as figs
from attncert.pipeline import params
from attncert.pipeline.audit import Audit
from attncert.pipeline.context import make_context
from attncert.pipeline.shapes import VitShape
from attncert.stages import certvit as certvit_stage
from attncert.training.train import TrainConfig, train

matplotlib.use("Agg")


def test_adaptation_norms_listed_in_the_stage_are_the_adapt_norms():
    for norm in NORMS:
        Adaptation(norm=norm)


def test_modes_match_the_schema():
    with pytest.raises(ValueError, match="mode"):
        stage.adaptation("l2", "project")
    raw = params.read_yaml(params.PARAMS_FILE)["certvit"]
    with pytest.raises(params.ParamsError, match="constrain"):
        params.parse_section("certvit", {**raw, "constrain": []}, certvit_stage.Params, PRESETS)
    with pytest.raises(params.ParamsError, match="constrain"):
        params.parse_section("certvit", {**raw, "constrain": ["sparse"]}, certvit_stage.Params,
                             PRESETS)


@pytest.mark.parametrize("mode", stage.MODES)
def test_each_mode_constrains_and_fine_tunes(tmp_path, mode):
    """Both modes run the stage's steps on a tiny ViT; the spectral mode's fine-tune keeps the
    features' bound within the sets' bound and the LMT offset is sqrt(2) L eps."""
    from attncert.certvit import MeanPooledViT
    from attncert.certvit.spectral import Budgets, budget_bound

    data = dataset()
    budgets = Budgets(embed=0.9, q=0.4, v=0.5, o=0.8, fc1=0.9, fc2=0.7, gain=1.0)
    model = adapt(tiny_vit(), stage.adaptation(mode, "project"))
    assert isinstance(model, MeanPooledViT) == (mode == "spectral")
    assert model.config.head_norm == (mode == "spectral")
    cfg = DRConfig(threshold=0.5, eta=0.2, iterations=2, max_pairs=128, batch_size=32)
    constrained, result = stage.constrain_mode(mode, model, data["train"]["x"][:16], cfg,
                                               budgets)
    assert constrained is not model
    before = global_bound(constrained).features
    offset = stage.margin_offset(constrained, budgets, 0.5)
    assert offset == pytest.approx(0.5 * budget_bound(constrained, budgets))
    margin = "radius" if mode == "spectral" else "lmt"
    tc = TrainConfig(epochs=1, batch_size=8, lr=0.05, margin=margin, lmt_offset=offset)
    with stage.finetune_context(mode, constrained, "bound_free", result.masks, budgets):
        train(constrained, data["train"], data["test"], tc, tmp_path, "cpu", progress=False)
    after = global_bound(constrained).features
    if mode == "spectral":
        assert before <= budget_bound(constrained, budgets) * (1 + 1e-5)
        assert after <= budget_bound(constrained, budgets) * (1 + 1e-5)
    else:
        assert after == before  # bound_free
    with pytest.raises(ValueError, match="budgets"):
        stage.constrain_mode("spectral", model, data["train"]["x"][:16], cfg)


def test_mode_steps_and_certified_modes_figure():
    data = dataset()
    logs = {}
    for mode in stage.MODES:
        model = adapt(tiny_vit(), stage.adaptation(mode, "project"))
        logs[mode] = steps.StepLog()
        logs[mode].add("pretrained", model, data["test"], 1.0, None)
        logs[mode].add("adapted", model, data["test"], 1.0, global_bound(model))
    table = steps.mode_steps(logs)
    assert list(table.index) == ["pretrained", "adapted"]
    b = global_bound(model)
    assert table.loc["adapted", ("spectral", "bound (pairwise)")] == pytest.approx(b.pairwise)
    assert b.pairwise <= 2 * b.features * (1 + 1e-12)  # unit head rows
    fig = figs.plot_certified_modes({"paper": {0.1: 0.0, 1.58: 0.0},
                                     "spectral": {0.1: 0.8, 1.58: 0.1}},
                                    {"paper": {0.1: 0.5, 1.58: 0.0},
                                     "spectral": {0.1: 0.9, 1.58: 0.3}})
    assert isinstance(fig, Figure)
    matplotlib.pyplot.close(fig)


def test_the_stage_runs_every_mode_and_writes_its_files(tmp_path):
    """The stage end to end on a tiny dataset: every phase checkpointed in its own folder,
    dr/lipschitz/samples csv and the metrics file written, no broken certificate, the
    ImageNet path skipped with the data stage's reason, and the headline rows read back."""
    import json

    processed = tmp_path / "processed"
    processed.mkdir()
    torch.save(dataset(n=48, classes=3), processed / "mnist.pt")
    torch.save({"skipped": "no route"}, processed / "imagenet_sample.pt")
    torch.save({"skipped": "no images"}, processed / "imagenet_val.pt")
    raw = params.read_yaml(params.PARAMS_FILE)
    base = params.parse_section("base", {**raw["base"], "device": "cpu"}, params.BaseParams)
    paper = params.parse_section("certvit", raw["certvit"], certvit_stage.Params, PRESETS)
    phase = dict(epochs=1, batch_size=16, eval_batch_size=64)
    p = dataclasses.replace(
        paper, source=stage.PIPELINE, dataset="mnist", vit=VitShape(4, 16, 1, 2, 16),
        train=dataclasses.replace(paper.train, warmup_steps=2, **phase),
        adapt_epochs=1, dr=dataclasses.replace(
            paper.dr, iterations=1, projection_steps=2, max_pairs=64, batch_size=32, images=16),
        finetune=dataclasses.replace(paper.finetune, **phase),
        spectral=dataclasses.replace(paper.spectral, warmup_steps=2, **phase), n_test=0,
        eval_batch_size=64, cert_eps=[0.1, 0.4867],
        audit=Audit(n=5, steps=2, restarts=1, batch_size=64), table1=cv_params.Table1Params(
            datasets=["mnist"], vit={"mnist": VitShape(4, 8, 1, 2, 8)},
            pretrain_epochs={"mnist": 1}, relaxation={"mnist": 1.1},
            batch_size=16, lr=1e-3),
        results_dir=str(tmp_path / "work"), metrics=str(tmp_path / "metrics.json"))
    assert certvit_stage.units(p) == ["main", "table1-mnist", "imagenet"]
    with pytest.raises(ValueError, match="certvit unit 'main' has not run"):
        certvit_stage.run(p, make_context(base, device=False))   # the gather reads records only
    main = certvit_stage.run(p, make_context(base, item="main", processed_dir=str(processed)))
    res = main.result
    assert main.unit == "main" and main.record == json.loads(
        (tmp_path / "work" / "units" / "main.json").read_text())
    work = tmp_path / "work"
    assert sorted(d.name for d in (work / "ckpt").iterdir()) == [
        "adapt", "finetune", "linear", "pretrain", "spectral_adapt", "spectral_finetune"]
    for name in ("dr.csv", "lipschitz.csv", "samples.csv"):
        assert (work / name).is_file()
    n_test = len(res.test["y"])  # n_test 0: the whole test split, attacked on the first 5
    assert len(pd.read_csv(work / "samples.csv")) == 3 * n_test  # two modes, the baseline
    sub = certvit_stage.run(p, make_context(base, item="table1-mnist",
                                            processed_dir=str(processed))).result
    imagenet = certvit_stage.run(p, make_context(base, item="imagenet",
                                                 processed_dir=str(processed)))
    net = imagenet.record
    assert imagenet.result is None and (work / "imagenet").is_dir()  # a DVC output, even skipped
    gathered = certvit_stage.run(p, make_context(base, device=False))
    m = gathered.record
    assert gathered.unit is None and m == json.loads((tmp_path / "metrics.json").read_text())
    assert m["n_test"] == n_test > 5 and m["n_attacked"] == m["linear_baseline"]["n_attacked"] == 5
    assert m["headline_mode"] == res.headline == "spectral" and set(m["modes"]) == set(res.modes)
    assert m["broken"] == 0 and m["linear_baseline"]["broken"] == 0
    assert m["imagenet"] == "skipped: imagenet_val: no images; imagenet_sample: no route"
    assert m["lipschitz_pairwise"]["final"] == pytest.approx(
        res.bounds["spectral"]["final"].pairwise)
    assert list(res.logs["paper"].frame()["step"]) == [
        "pretrained", "adapted", "adapt_finetuned", "constrained", "finetuned"]
    rows = {r["key"]: r for r in certvit_stage.headline_rows(m, {})}
    # the section's own run is not CertViT Table 1's setting: no paper number beside it
    assert all(r["paper"] is None for k, r in rows.items() if not k.startswith("table1/"))
    assert rows["certified_acc/0.4867"]["brief"]
    assert "first 5 test images" in rows["pgd_acc/0.4867"]["label"]
    # CertViT Table 1: the same steps on a small ViT trained here, in its own folder
    assert sub.pretrained.config.dim == 8 and sub.pretrained.config.patch == 4
    t1 = work / "table1" / "mnist"
    assert (t1 / "ckpt" / "spectral_finetune").is_dir() and (t1 / "samples.csv").is_file()
    entry = m["table1"]["mnist"]
    assert entry["source"] == stage.PIPELINE and set(entry["modes"]) == set(res.modes)
    assert entry["modes"]["spectral"]["lipschitz_pairwise"] == pytest.approx(
        sub.bounds["spectral"]["final"].pairwise)
    frame = cv_tables.table1_frame(m["table1"])
    assert list(frame["model"]) == [*res.modes, "linear baseline (pixels)"]
    assert set(frame["eps"]) == {0.4867} and frame["paper clean (%)"].iloc[0] == 97.8
    assert rows["table1/mnist/modes/spectral/certified_acc/0.4867"]["paper"] == 0.545
    assert m["total_seconds"] > entry["total_seconds"] > 0
    # a record computed from other params is stale; a broken certificate fails the gather
    other = dataclasses.replace(p, audit=dataclasses.replace(p.audit, steps=3))
    with pytest.raises(ValueError, match="ran with other params"):
        certvit_stage.run(other, make_context(base, device=False))
    record = json.loads((work / "units" / "table1-mnist.json").read_text())
    record["modes"]["paper"]["broken"] = 1
    (work / "units" / "table1-mnist.json").write_text(json.dumps(record))
    with pytest.raises(soundness.UnsoundCertificateError, match="table1-mnist"):
        certvit_stage.run(p, make_context(base, device=False))
    record["modes"]["paper"]["broken"] = 0
    (work / "units" / "table1-mnist.json").write_text(json.dumps(record))
    net = json.loads((work / "units" / "imagenet.json").read_text())
    net["imagenet"] = {"images": "imagenet_sample", "skipped_images": {},
                       "models": {"tiny": {"paper_model": None, "modes": {"paper": {"broken": 2}}}}}
    (work / "units" / "imagenet.json").write_text(json.dumps(net))
    with pytest.raises(soundness.UnsoundCertificateError, match="imagenet"):
        certvit_stage.run(p, make_context(base, device=False))
    assert certvit_stage.unit_params(p, "table1-mnist", str(processed)).vit.dim == 8
    with pytest.raises(ValueError, match="not one of"):
        certvit_stage.run(p, make_context(base, item="table1-cifar10"))


def test_the_imagenet_route_certifies_a_tiny_hf_vit_in_every_mode(tmp_path):
    """CertViT Table 2's route with the tiny random HF ViT: calibration and certification on
    disjoint images, the loaded model's accuracy beside, audited; a saved folder loads the
    same way as a hub id."""
    from attncert.certvit import imagenet
    from attncert.certvit.spectral import Budgets

    g = torch.Generator().manual_seed(0)
    sample = {"test": {"x": torch.randint(0, 256, (5, 3, 224, 224), generator=g,
                                          dtype=torch.uint8), "y": torch.tensor([1, 2, 0, 3, 0])}}
    budgets = Budgets(embed=0.9, q=0.4, v=0.5, o=0.8, fc1=0.9, fc2=0.7, gain=1.0)
    dr = DRConfig(threshold=0.5, eta=0.2, iterations=3, projection_steps=2, max_pairs=64,
                  batch_size=32)
    args = (stage.MODES, "project", 0.1, dr, budgets)
    out, what = imagenet.table3(sample, imagenet.TINY, tmp_path / "hf", *args, 10, [0.1], 2, 1,
                                8, 0, "cpu", n_attack=2)
    assert set(out) == set(stage.MODES) and str(tmp_path / "hf") in what
    for m in stage.MODES:
        # one image per class of the 3 left after calibration: classes 0 and 3
        assert (out[m]["images"], out[m]["classes"], out[m]["calibration_images"],
                out[m]["n_attacked"]) == (2, 2, 2, 2)
        assert out[m]["broken"] == 0 and set(out[m]["certified_acc"]) == {"0.1"}
        assert out[m]["lipschitz_constrained"] > 0
        assert 0 <= out[m]["pretrained_clean_acc"] <= 1
        for key in ("pretrained_attention", "attention"):  # diagnosed on the certified images
            a = out[m][key]
            assert 0 < a["entropy_mean"] <= 1 + 1e-9 and abs(a["uniform_gap"]) <= 100
    from attncert.certvit.tables import imagenet_frame, imagenet_rows

    net = {"images": "sample", "models": {imagenet.TINY: {"paper_model": None, "modes": out}}}
    assert imagenet_frame(net)["constrained uniform gap"].notna().all()
    gaps = [r for r in imagenet_rows(net) if r["key"].endswith("attention/uniform_gap")]
    assert len(gaps) == 2 * len(stage.MODES)
    again, _ = imagenet.table3(sample, str(tmp_path / "hf"), tmp_path / "unused", *args, 1,
                               [0.1], 2, 1, 8, 0, "cpu")
    assert again["paper"]["images"] == 3 and again["paper"]["calibration_images"] == 1
    assert imagenet.one_per_class(torch.tensor([5, 1, 1, 2, 1, 2]), 1, seed=0).tolist() in (
        [1, 3], [1, 5], [2, 3], [2, 5], [3, 4], [4, 5])
    assert imagenet.folder_name("google/vit-base-patch16-224") == "google_vit-base-patch16-224"
    with pytest.raises(ValueError, match="at least 2 images"):
        imagenet.table3({"test": {"x": sample["test"]["x"][:1], "y": torch.tensor([1])}},
                        imagenet.TINY, tmp_path / "hf", *args, 1, [0.1], 2, 1, 8, 0, "cpu")
