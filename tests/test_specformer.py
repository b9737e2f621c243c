"""The SpecFormer study's library: method configs, attacks table, step timing, figures (its
paper-scale code paths and the stage: test_specformer_stage.py)."""

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from attncert.figures import specformer as figs
from attncert.models import ViTConfig, build_vit
from attncert.msvp import exact_head_sigma
from attncert.report import paper as paper_module
from attncert.specformer import methods as sf
from attncert.stages import specformer as stage
from attncert.training.train import TrainConfig, evaluate

ROOT = Path(__file__).resolve().parents[1]

BASE = ViTConfig(image_size=8, channels=1, patch=4, dim=8, depth=2, heads=2, mlp_hidden=8,
                 num_classes=3, kind="standard", block="prenorm", attn_bias=True,
                 mean=(0.5,), std=(0.3,))


def toy(n=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.rand(n, 1, 8, 8, generator=g) * 0.3 + 0.3 * y[:, None, None, None]
    return x, y


def model_of(method, seed=0):
    torch.manual_seed(seed)
    return build_vit(sf.method_model_config(method, BASE, 0.5))


def test_method_configs_and_msvp_only_for_specformer():
    cfgs = {m: sf.method_model_config(m, BASE, 0.5) for m in sf.METHODS}
    assert cfgs["vanilla"] == BASE == cfgs["specformer"]
    assert cfgs["l2former"].attention == "l2" and cfgs["lnformer"].attention == "lnformer"
    lips = cfgs["lipsformer"]
    assert (lips.attention, lips.norm, lips.residual_scale, lips.spectral_init) == (
        "cosine", "center", 0.5, True)
    for m in sf.METHODS:
        cfg = sf.method_train_config(m, TrainConfig(), (1e-3, 2e-3, 3e-3))
        assert cfg.msvp_enabled == (m == "specformer")
    with pytest.raises(ValueError, match="unknown method"):
        sf.method_model_config("vit", BASE, 0.5)


def test_attack_specs_labels_and_validation():
    assert sf.AttackSpec("clean").label == "clean"
    assert sf.AttackSpec("fgsm", 2 / 255, 1).label == "FGSM 2/255"
    assert sf.AttackSpec("pgd_linf", 2 / 255, 2).label == "PGD-2 2/255"
    assert sf.AttackSpec("cw_linf", 8 / 255, 20).label == "CW-20 8/255"
    assert sf.AttackSpec("pgd_l2", 0.5, 20).label == "L2-PGD-20 0.5"
    assert set(paper_module.SPECFORMER_ATTACKS["standard"]) == {"clean", "FGSM 2/255",
                                                                 "PGD-2 2/255"}
    with pytest.raises(ValueError, match="unknown attack"):
        sf.AttackSpec("autoattack", 0.1, 1)
    with pytest.raises(ValueError, match="eps > 0"):
        sf.AttackSpec("fgsm", 0.0, 1)


def test_robust_accuracy_rows_and_table():
    x, y = toy()
    model = model_of("vanilla").eval()
    specs = [sf.AttackSpec("clean"), sf.AttackSpec("fgsm", 0.1, 1),
             sf.AttackSpec("pgd_linf", 0.1, 5), sf.AttackSpec("pgd_l2", 1.0, 5)]
    rows = sf.robust_accuracy(model, x, y, specs, batch_size=10, seed=0)
    acc = {r["attack"]: r["accuracy"] for r in rows}
    assert acc["clean"] == pytest.approx(evaluate(model, (x, y))["acc"])
    assert acc["PGD-5 0.1"] <= acc["clean"] and acc["FGSM 0.1"] <= acc["clean"]
    assert rows == sf.robust_accuracy(model, x, y, specs, batch_size=10, seed=0)  # seeded
    tagged = [{**r, "dataset": "toy", "training": t, "method": m}
              for t, m in (("adversarial", "vanilla"), ("standard", "specformer"),
                           ("standard", "vanilla")) for r in rows]
    table = sf.comparison_table(tagged, paper_module.specformer_rows([stage.TABLE1_RUN]))
    assert list(table.index) == [("standard", "vanilla"), ("standard", "specformer"),
                                 ("adversarial", "vanilla"), ("adversarial", "specformer")]
    assert table.loc[("standard", "specformer"),
                     (stage.TABLE1_RUN, "PGD-2 2/255", "paper")] == 29.53
    assert table.loc[("adversarial", "vanilla"),
                     (stage.TABLE1_RUN, "CW-20 8/255", "paper")] == 34.34
    assert table.loc[("standard", "vanilla"), ("toy", "clean", "ours")] == pytest.approx(
        100 * acc["clean"])


def test_step_times_interleaved_and_originals_untouched():
    x, y = toy(16)
    models = {m: (model_of(m), sf.method_train_config(m, TrainConfig(lr=1e-2), (1e-3,) * 3))
              for m in ("vanilla", "specformer", "lipsformer")}
    before = {k: v.clone() for k, v in models["vanilla"][0].state_dict().items()}
    times = sf.step_times(models, x, y, steps=2, rounds=3, warmup=1)
    assert len(times) == 9 and (times["seconds_per_step"] > 0).all()
    assert list(times[times["round"] == 1]["method"]) == ["specformer", "lipsformer", "vanilla"]
    for k, v in models["vanilla"][0].state_dict().items():
        torch.testing.assert_close(v, before[k])
    ratios = sf.step_time_ratios(times)
    assert ratios.loc["vanilla", "ratio"] == 1.0
    assert list(ratios.index) == ["vanilla", "specformer", "lipsformer"]
    with pytest.raises(ValueError, match="reference"):
        sf.step_time_ratios(times, "l2former")


def test_max_sigma_frame_is_the_max_over_heads():
    models = {m: model_of(m) for m in ("vanilla", "l2former")}
    frame = sf.max_sigma_frame(models)
    assert len(frame) == 2 * 2 * 3
    exact = exact_head_sigma(models["vanilla"])["blocks.1.attn"]["v"].max()
    got = frame.query("method == 'vanilla' and depth == 1 and map == 'v'")["sigma"].item()
    assert got == pytest.approx(float(exact))
    l2 = frame[frame["method"] == "l2former"].pivot(index="depth", columns="map", values="sigma")
    assert (l2["q"] == l2["k"]).all()  # tied keys


def test_train_run_resumes_and_clears(tmp_path):
    x, y = toy(32)
    data = {"train": {"x": x, "y": y}, "test": {"x": x, "y": y}, "source": "toy",
            "mean": [0.5], "std": [0.3], "classes": ["a", "b", "c"]}
    cfg = sf.data_config(data, patch=4, dim=8, depth=1, heads=2, mlp_hidden=8,
                         kind="standard", block="prenorm")
    assert cfg.std == (0.3,) and sf.data_config(data, "mean", patch=4, dim=8, depth=1, heads=2,
                                                mlp_hidden=8).std == (1.0,)
    tcfg = TrainConfig(epochs=1, batch_size=16, msvp_lambda=1e-3)
    _, curves, status = sf.train_run(cfg, tcfg, data, "toy", tmp_path / "ck")
    assert status == "fresh" and len(curves) == 1
    assert sf.train_run(cfg, tcfg, data, "toy", tmp_path / "ck")[2] == "resume"
    other = dataclasses.replace(tcfg, lr=1e-2)
    assert sf.train_run(cfg, other, data, "toy", tmp_path / "ck")[2].startswith("cleared")


def test_figures_return_figures():
    rows = pd.DataFrame([
        {"dataset": "toy", "training": t, "method": m, "attack": a, "kind": k, "eps": e,
         "steps": 1, "accuracy": 0.5}
        for t in ("standard", "adversarial") for m in ("vanilla", "specformer")
        for a, k, e in (("clean", "clean", 0.0), ("FGSM 2/255", "fgsm", 2 / 255),
                        ("L2-PGD-1 0.5", "pgd_l2", 0.5))])
    frame = sf.max_sigma_frame({m: model_of(m) for m in ("vanilla", "specformer")})
    ratios = pd.DataFrame({"seconds_per_step": [1.0, 1.2], "ratio": [1.0, 1.2],
                           "ratio_min": [1.0, 1.1], "ratio_max": [1.0, 1.3]},
                          index=["vanilla", "specformer"])
    for fig in (figs.plot_robustness(rows, "toy"), figs.plot_l2_curves(rows, "toy"),
                figs.plot_max_sigma(frame, "t"), figs.plot_step_ratios(ratios, 1.5, 1.5)):
        assert isinstance(fig, Figure)


def test_subset_train_is_seeded_and_named():
    x, y = toy(32)
    data = {"train": {"x": x, "y": y}, "test": {"x": x, "y": y}, "source": "toy"}
    assert sf.subset_train(data, 0, 0) == data and sf.subset_train(data, 40, 0) == data
    sub = sf.subset_train(data, 10, 1)
    assert len(sub["train"]["y"]) == 10 and "10 of 32" in sub["source"]
    torch.testing.assert_close(sub["train"]["x"], sf.subset_train(data, 10, 1)["train"]["x"])
    assert sub["test"] is data["test"]
