"""Tightness study frames and figures on tiny sizes: every bound >= PGD, figures draw."""

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from attncert.figures.tightness import plot_figure1, plot_figure3, plot_figure4, plot_table3  # noqa: E402
from attncert.tightness import (  # noqa: E402
    PAPER_TABLE3,
    figure1_multi_head,
    figure1_single_head,
    figure3_weight_perturbation,
    figure4_input_norm,
    layer_project,
    paper_table3_frame,
    random_attention_layer,
    study_layer,
    summary_metrics,
    table3,
)

EPS = (0.01, 0.1)
PGD = dict(attack_steps=40, attack_restarts=2)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def layer():
    return random_attention_layer(n=5, d=8, h=2, seed=0, weight_scale=(1.0, 1.0), samples=3)


def _bounds_above_pgd(df, key):
    for k, sub in df.groupby(key):
        pgd = sub[sub.method == "PGD"].value.item()
        bounds = sub[sub.method != "PGD"]
        assert (bounds.value >= pgd).all(), (k, sub)
        assert (bounds.ratio_max >= 1.0).all()


def test_random_layer_is_seeded_projected_and_scaled():
    w, x = random_attention_layer(n=6, d=12, h=3, seed=1, weight_scale=(0.5, 0.25), samples=4)
    w2, x2 = random_attention_layer(n=6, d=12, h=3, seed=1, weight_scale=(0.5, 0.25), samples=4)
    assert torch.equal(x, x2) and torch.equal(w.wq, w2.wq)
    assert x.shape == (4, 6, 12) and (w.h, w.d, w.d_h) == (3, 12, 4)
    assert torch.all(x.norm(dim=-1) <= 1 + 1e-12)
    torch.testing.assert_close(
        torch.linalg.matrix_norm(w.wq, 2), torch.full((3,), 0.5, dtype=x.dtype)
    )
    torch.testing.assert_close(
        torch.linalg.matrix_norm(w.wo, 2), torch.full((3,), 0.25, dtype=x.dtype)
    )
    y = torch.tensor([[3.0, 4.0], [0.3, 0.4]])
    torch.testing.assert_close(layer_project(y), torch.tensor([[0.6, 0.8], [0.3, 0.4]]))
    torch.testing.assert_close(layer_project(y, 2.0), torch.tensor([[1.2, 1.6], [0.3, 0.4]]))


def test_table3_and_figures(layer):
    w, x = layer
    df = table3(w, x, eps_list=EPS, **PGD)
    assert set(df.method) == {"PGD", "LoFAST(M)", "LoFAST(xi)", "naive", "SpecFormer"}
    assert len(df) == 5 * len(EPS)
    _bounds_above_pgd(df, "eps")
    piv = df.pivot(index="eps", columns="method", values="value")
    assert (piv["LoFAST(M)"] <= piv["LoFAST(xi)"]).all()
    assert (piv["LoFAST(xi)"] <= piv["naive"]).all()
    assert isinstance(plot_table3(df), Figure)


def test_paper_table3_constant():
    df = paper_table3_frame()
    assert len(df) == 3 * len(PAPER_TABLE3["eps"]) and set(df.source) == {"paper"}
    lofast = df[df.method == "LoFAST(xi)"].ratio_to_pgd  # its LoFAST row: the xi form
    assert lofast.between(1.0, 1.05).all()  # the paper's own claim
    assert PAPER_TABLE3["SpecFormer"][-1] == 197.036  # as printed, not rounded


def test_figure1(layer):
    w, x = layer
    single = figure1_single_head(w, x, eps_list=EPS, head=1, **PGD)
    for _, sub in single.groupby("quantity"):
        _bounds_above_pgd(sub, "eps")
    multi = figure1_multi_head(w, x, eps_list=EPS, **PGD)
    _bounds_above_pgd(multi, "eps")
    assert "SpecFormer" not in set(multi.method)
    assert isinstance(plot_figure1(single, multi), Figure)


def test_figure3(layer):
    w, x = layer
    df = figure3_weight_perturbation(w, x[:2], sizes=(0.1, 1.0), eps=0.05, samples=2, **PGD)
    assert len(df) == 5 * 2 * 2
    assert set(df.target) == {"W^Q", "W^K", "W^V", "W^O", "X"}
    assert (df.ratio >= 1.0).all() and (df.lofast >= df.pgd).all()
    assert isinstance(plot_figure3(df), Figure)


def test_figure4(layer):
    w, x = layer
    df = figure4_input_norm(w, x, scales=(0.5, 2.0), eps=0.05, **PGD)
    _bounds_above_pgd(df, "scale")
    norms = df.groupby("scale").input_norm.first()
    assert norms.loc[2.0] == pytest.approx(4 * norms.loc[0.5])
    assert isinstance(plot_figure4(df), Figure)
    assert isinstance(df, pd.DataFrame)


def test_study_layer_from_checkpoint_projects_the_trained_inputs(tmp_path):
    from attncert.models.vit import ViTConfig, build_vit, save_vit

    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, channels=1, patch=4, dim=16, depth=2, heads=2, mlp_hidden=16,
                    num_classes=3, pool="mean", radius_attn=3.0)
    model = build_vit(cfg)
    save_vit(model, tmp_path / "m.pt")
    x = torch.randint(0, 256, (5, 1, 8, 8), dtype=torch.uint8)
    torch.save({"test": {"x": x, "y": torch.zeros(5, dtype=torch.long)}}, tmp_path / "toy.pt")
    w, inputs, label = study_layer(str(tmp_path / "m.pt"), str(tmp_path / "toy.pt"),
                                   0, 0, 0, 4, 0.0, 0.0, 0, layer=1, input_radius=1.0)
    assert inputs.shape == (4, 4, 16) and w.h == 2
    assert float(inputs.norm(dim=-1).max()) <= 1.0 + 1e-9
    assert "blocks.1.attn" in label and "projected to ||x_i|| <= 1" in label
    with pytest.raises(ValueError, match="no attention layer"):
        study_layer(str(tmp_path / "m.pt"), str(tmp_path / "toy.pt"), 0, 0, 0, 4,
                    0.0, 0.0, 0, layer=5)


def test_summary_metrics_keep_the_series_of_figures_3_and_4(layer):
    """The figures stage draws Figures 3-4 from the metrics: the series are there, as the
    frames' means."""
    from attncert.figures.summary import ablation_frames, plot_ablations

    w, x = layer
    t3 = table3(w, x[:2], eps_list=EPS, attack_steps=5, attack_restarts=1)
    f1 = figure1_single_head(w, x[:2], eps_list=EPS, attack_steps=5, attack_restarts=1)
    f3 = figure3_weight_perturbation(w, x[:2], sizes=(0.1, 1.0), eps=0.05, samples=2,
                                     attack_steps=5, attack_restarts=1)
    f4 = figure4_input_norm(w, x[:2], scales=(0.5, 2.0), eps=0.05, attack_steps=5,
                            attack_restarts=1)
    m = summary_metrics(t3, f1, f3, f4, "tiny")
    assert m["fig3_eps"] == 0.05 and set(m["fig3_ratio"]) == set(f3.target)
    assert m["fig3_ratio"]["W^V"]["1"] == pytest.approx(
        f3[(f3.target == "W^V") & (f3["size"] == 1.0)].ratio.mean())
    assert set(m["fig4_ratio_to_pgd"]) == {"LoFAST(M)", "LoFAST(xi)", "naive"}
    assert m["fig4_input_norm"]["2"] == pytest.approx(4 * m["fig4_input_norm"]["0.5"])
    fig3, fig4 = ablation_frames(m)
    assert len(fig3) == 5 * 2 and len(fig4) == 3 * 2 and fig4.input_norm.notna().all()
    assert isinstance(plot_ablations(fig3, fig4, m["fig3_eps"]), Figure)


def test_attention_sharpening_bounds_stay_above_pgd_as_the_pattern_sharpens():
    """Raising the logit cap sharpens the rows (entropy falls, the largest logit grows); at
    every cap LoFAST(M), LoFAST(xi) and the global bound on the ball of radius R + eps lie above
    the PGD sensitivity, and the global bound above LoFAST(M); bad caps are refused."""
    from attncert.tightness.layer import random_attention_layer
    from attncert.tightness.studies import attention_sharpening

    w, x = random_attention_layer(6, 16, 2, 0, (1.0, 0.5), 3, token_norm=4.0)
    caps = (0.5, 8.0, 64.0)
    df = attention_sharpening(w, x, caps, eps=0.3, attack_steps=20, attack_restarts=2)
    pgd = df[df.method == "PGD"].set_index("cap")
    assert pgd["entropy"].is_monotonic_decreasing and pgd["entropy"].iloc[-1] < 0.9
    assert pgd["logit_max"].is_monotonic_increasing
    for method in ("LoFAST(M)", "LoFAST(xi)", "global"):
        sub = df[df.method == method].set_index("cap")
        assert (sub["value"] >= pgd["value"] * (1 - 1e-9)).all(), method
    m = df[df.method == "LoFAST(M)"].set_index("cap")["value"]
    assert (df[df.method == "global"].set_index("cap")["value"] >= m).all()
    with pytest.raises(ValueError, match="caps"):
        attention_sharpening(w, x, (0.0, 1.0))
