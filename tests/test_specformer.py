"""The SpecFormer study's library: method configs, attacks table, step timing, figures."""

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
import torch
from matplotlib.figure import Figure

from attncert import specformer as sf
from attncert.data import DataUnavailable, load_sample
from attncert.figures import specformer as figs
from attncert.models import ViTConfig, build_vit
from attncert.msvp import exact_head_sigma
from attncert.paper import SPECFORMER_TABLE1
from attncert.params import load_params
from attncert.train import TrainConfig, evaluate

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
    assert set(SPECFORMER_TABLE1["vanilla"]) <= {"clean", "FGSM 2/255", "PGD-2 2/255"}
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
    table = sf.comparison_table(tagged, SPECFORMER_TABLE1, "cifar10")
    assert list(table.index) == [("standard", "vanilla"), ("standard", "specformer"),
                                 ("adversarial", "vanilla")]
    assert table.loc[("standard", "specformer"), ("cifar10", "PGD-2 2/255", "paper")] == 29.53
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


# -- the paper-scale CIFAR grid, on the mirror's 20 CIFAR-10 images --------------------------

#: The only knobs shrunk: model size, epochs, batch size, attack steps, attacked images.
TINY = {"dim": 8, "depth": 1, "heads": 2, "mlp_hidden": 8, "epochs": 1, "adv_epochs": 1,
        "batch_size": 10, "eval_batch_size": 10, "adv_steps": 1, "attack_steps": 2,
        "n_eval": 20}


@pytest.mark.parametrize("dataset,num_classes", [("cifar10", 10), ("cifar100", 100)])
def test_paper_scale_cifar_grid_code_path(dataset, num_classes, mirror, tmp_path):
    """The paper-scale ``specformer`` params (CIFAR-10 and CIFAR-100: 3 x 32 x 32, patch 4,
    crop_flip, 2/255 and 8/255 attacks, L2 PGD, MSVP, PGD adversarial training) through the
    notebook's own calls, with only the size knobs of :data:`TINY` shrunk.

    A code-path check, not a measurement: the mirror's 20 real CIFAR-10 test images stand in
    for both splits (train = test = the 20 images), labelled with CIFAR-10's 10 classes or
    CIFAR-100's 100 (the labels 0-9 are valid in both). On a GPU box the same calls run on the
    torchvision downloads of the full datasets.
    """
    paper = load_params(ROOT / "params.yaml")["specformer"]
    assert paper.datasets == ["cifar10", "cifar100"] and dataset in paper.datasets
    p = dataclasses.replace(paper, **TINY)
    try:
        sample = load_sample("cifar10_sample", mirror, tmp_path / "raw")
    except DataUnavailable as exc:
        pytest.skip(str(exc))
    classes = sample["classes"] if num_classes == 10 else [f"c{i}" for i in range(100)]
    data = sf.subset_train({"train": sample["test"], "test": sample["test"],
                            "mean": sample["mean"], "std": sample["std"], "classes": classes,
                            "source": f"{dataset}-shaped {sample['source']}"},
                           p.max_train, 0)

    # the notebook's calls, in its order (notebooks/05_specformer.py)
    specs = sf.attack_specs(p.std_eps_255, p.adv_eval_eps_255, p.attack_steps, p.l2_eps)
    standard, adversarial = sf.train_configs(
        epochs=p.epochs, adv_epochs=p.adv_epochs, batch_size=p.batch_size, lr=p.lr,
        weight_decay=p.weight_decay, warmup_steps=p.warmup_steps, augment=p.augment,
        eval_batch_size=p.eval_batch_size, adv_eps_255=p.adv_eps_255, adv_steps=p.adv_steps,
        seed=0)
    plan = sf.run_plan(p.methods, p.adv_methods, standard, adversarial)
    base = sf.base_model_config(data, p.patch, p.dim, p.depth, p.heads, p.mlp_hidden, p.block)
    x, y = sf.eval_split(data, p.n_eval)
    rows = []
    for training, method, cfg in plan:
        model_cfg = sf.method_model_config(method, base, p.lipsformer_alpha)
        train_cfg = sf.method_train_config(method, cfg, p.msvp_lambda)
        assert (model_cfg.channels, model_cfg.image_size, model_cfg.patch) == (3, 32, 4)
        assert model_cfg.num_classes == num_classes
        assert train_cfg.augment == "crop_flip"
        assert train_cfg.msvp_enabled == (method == "specformer")
        assert train_cfg.adversarial == ("pgd_linf" if training == "adversarial" else "none")
        model, curves, status = sf.train_run(model_cfg, train_cfg, data, dataset,
                                             tmp_path / f"{dataset}-{training}-{method}")
        assert status == "fresh" and len(curves) == 1
        with torch.no_grad():
            assert model(x[:2]).shape == (2, num_classes)
        got = sf.robust_accuracy(model, x, y, specs, p.eval_batch_size, 0)
        assert [r["attack"] for r in got] == [s.label for s in specs]
        rows += [{"dataset": dataset, "training": training, "method": method, **r} for r in got]

    assert len(plan) == 2 * 5 and len(x) == 20
    assert [s.label for s in specs] == [
        "clean", "FGSM 2/255", "PGD-2 2/255", "CW-2 8/255", "PGD-2 8/255",
        *[f"L2-PGD-2 {e:g}" for e in paper.l2_eps]]
    df = pd.DataFrame(rows)
    assert len(df) == len(plan) * len(specs)
    assert not df.duplicated(["training", "method", "attack"]).any()
    assert df["accuracy"].between(0, 1).all()
    for _, run in df.groupby(["training", "method"]):
        clean = run.loc[run["kind"] == "clean", "accuracy"].item()
        assert (run["accuracy"] <= clean + 1e-12).all()
    table = sf.comparison_table(rows, SPECFORMER_TABLE1, "cifar10")
    assert len(table) == len(plan)
    if dataset == "cifar10":  # the labels meet SpecFormer Table 1's columns
        assert (dataset, "PGD-2 2/255", "paper") in table.columns
