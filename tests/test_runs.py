"""Grid points: names, configs from params, checkpoint folders; the ViT report figures."""

import dataclasses

import matplotlib

matplotlib.use("Agg")

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from attncert import certify
from attncert.figures import vit as figs  # noqa: E402
from attncert.models.config import dataset_vit_config  # noqa: E402
from attncert.pipeline import runs  # noqa: E402
from attncert.pipeline.params import ParamsError, parse_section
from attncert.pipeline.runs import GridPoint  # noqa: E402
from attncert.pipeline.shapes import VitShape
from attncert.stages import train_vit  # noqa: E402
from attncert.stages.registry import load_params  # noqa: E402
from attncert.training.checkpoint import fingerprint, prepare_checkpoint_dir  # noqa: E402


def _data(channels=1, size=28, classes=10):
    x = torch.zeros(4, channels, size, size, dtype=torch.uint8)
    return {"train": {"x": x, "y": torch.zeros(4, dtype=torch.long)},
            "classes": [str(i) for i in range(classes)],
            "mean": [0.5] * channels, "std": [0.25] * channels, "source": "test"}


def _settings(**changes):
    return dataclasses.replace(load_params()["train_vit"], **changes)


def _point(depth=3, heads=4, gamma_vo=0.5, dataset="cifar10"):
    return GridPoint("runs/vit", dataset, depth, heads, gamma_vo)


def test_run_name_matches_the_dvc_template():
    assert runs.run_name("mnist", 3, 4, 0.5) == "mnist-L3-H4-vo0.5"
    assert runs.run_name("svhn", 6, 8, 1.0) == "svhn-L6-H8-vo1.0"


def test_setup_reads_the_grid_point_and_refuses_none():
    """A grid notebook's setup turns nbrun's item texts into the typed point; an empty point
    (the notebook run without one) is a one-line error, not a missing-key message."""
    from attncert.pipeline.context import setup

    grid = load_params()["vit_grid"]
    items = {"dataset": grid.dataset[0], "depth": str(grid.depth[0]),
             "heads": str(grid.heads[0]), "gamma_vo": str(grid.gamma_vo[0])}
    p, ctx = setup(train_vit, point=items, device=False)
    assert p == load_params()["train_vit"] and ctx.point.depth == grid.depth[0]
    assert ctx.processed_dir == load_params()["data"].processed_dir
    with pytest.raises(ParamsError, match="needs its grid point"):
        setup(train_vit, point={}, device=False)


def test_a_grid_point_parses_from_the_item_nbrun_passes():
    p = load_params()
    grid = p["vit_grid"]
    items = {"dataset": grid.dataset[0], "depth": str(grid.depth[0]),
             "heads": str(grid.heads[0]), "gamma_vo": str(grid.gamma_vo[0])}
    raw = p.grid_point(["vit_grid"], items)
    point = parse_section("vit_grid", raw, GridPoint)
    name = runs.run_name(grid.dataset[0], grid.depth[0], grid.heads[0], grid.gamma_vo[0])
    assert point.name == name and str(point.run_dir) == f"{grid.results_dir}/{name}"
    with pytest.raises(ParamsError, match="vit_grid.depth: must be > 0"):
        parse_section("vit_grid", raw | {"depth": 0}, GridPoint)
    with pytest.raises(ParamsError, match="vit_grid.dataset: unknown value 'sst2'"):
        parse_section("vit_grid", raw | {"dataset": "sst2"}, GridPoint)
    with pytest.raises(ParamsError, match="vit_grid.heads: expected int"):
        parse_section("vit_grid", raw | {"heads": [4]}, GridPoint)


@pytest.mark.parametrize(("normalize", "mean", "std"),
                         [("mean", (0.5, 0.5, 0.5), (1.0, 1.0, 1.0)),
                          ("std", (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
                          ("none", (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))])
def test_vit_config_takes_the_dataset_and_the_grid_point(normalize, mean, std):
    s = _settings(normalize=normalize)
    cfg = train_vit.model_config(s, _point(depth=4, heads=8, gamma_vo=0.75), _data(3, 32))
    assert (cfg.channels, cfg.image_size, cfg.num_classes) == (3, 32, 10)
    assert (cfg.depth, cfg.heads, cfg.gamma_vo, cfg.dim) == (4, 8, 0.75, s.vit.dim)
    assert cfg.mean == mean and cfg.std == std


_SHAPES = [pytest.param(1, 28, id="mnist"), pytest.param(3, 32, id="cifar10")]


@pytest.mark.parametrize(("channels", "size"), _SHAPES)
@pytest.mark.parametrize("normalize", ["mean", "std", "none"])
def test_dataset_vit_config_sizes_the_vit_by_the_data(channels, size, normalize):
    data = _data(channels, size, classes=7)
    cfg = dataset_vit_config(data, normalize, patch=4, dim=16, depth=2, heads=2,
                                  mlp_hidden=32, kind="standard", pool="cls")
    assert (cfg.image_size, cfg.channels, cfg.num_classes) == (size, channels, 7)
    assert (cfg.patch, cfg.dim, cfg.depth, cfg.heads, cfg.mlp_hidden) == (4, 16, 2, 2, 32)
    assert (cfg.kind, cfg.pool) == ("standard", "cls")
    assert cfg.mean == ((0.5,) * channels if normalize != "none" else (0.0,) * channels)
    assert cfg.std == ((0.25,) * channels if normalize == "std" else (1.0,) * channels)


def test_dataset_vit_config_rejects_an_unknown_normalize():
    with pytest.raises(ValueError, match="normalize must be one of mean, std, none, got 'z'"):
        dataset_vit_config(_data(), "z", patch=4)


@pytest.mark.parametrize(("channels", "size"), _SHAPES)
def test_every_dataset_builder_gives_the_config_it_built_before(channels, size):
    """The grid, CROWN, SpecFormer and CertViT builders against the ViTConfig each of them
    wrote out by hand before they shared :func:`attncert.models.config.dataset_vit_config`."""
    import dataclasses

    from attncert.certvit import methods as stage
    from attncert.crown.study import vit_config
    from attncert.models import ViTConfig
    from attncert.specformer import methods as sf

    data = _data(channels, size) | {"mean": [0.1 + c / 10 for c in range(channels)],
                                    "std": [0.3 - c / 50 for c in range(channels)]}
    mean, std = tuple(data["mean"]), tuple(data["std"])
    shape = {"image_size": size, "channels": channels, "num_classes": 10}
    s = _settings(vit=dataclasses.replace(load_params()["train_vit"].vit, patch=4))
    grid = {k: getattr(s, k) for k in ("kind", "block", "pool", "radius_attn", "radius_stream",
                                       "gamma_qk", "head_norm")}
    grid |= {k: getattr(s.vit, k) for k in ("patch", "dim", "mlp_hidden")}
    crown_vit = VitShape(patch=4, dim=16, depth=None, heads=2, mlp_hidden=32)
    crown = {"pool": "mean", "radius_attn": 1.5, "gamma_qk": 0.25, "gamma_vo": 0.5}
    arch = {"patch": 4, "dim": 16, "depth": 2, "heads": 2, "mlp_hidden": 32}
    for norm, m, sd in (("mean", mean, None), ("std", mean, std), ("none", None, None)):
        assert train_vit.model_config(dataclasses.replace(s, normalize=norm), _point(),
                                      data) == ViTConfig(
            **shape, depth=3, heads=4, gamma_vo=0.5, mean=m, std=sd, **grid)
        crown_p = dataclasses.replace(load_params()["crown"], vit=crown_vit, **crown,
                                      normalize=norm)
        assert vit_config(data, crown_p, 4) == ViTConfig(
            **shape, depth=4, kind="lipschitz", block="stream", mean=m, std=sd, patch=4, dim=16,
            heads=2, mlp_hidden=32, **crown)
    assert sf.data_config(data, **arch) == ViTConfig(**shape, mean=mean, std=std, **arch)
    assert sf.data_config(data, "mean", **arch) == ViTConfig(**shape, mean=mean, **arch)
    assert sf.base_model_config(data, block="prenorm", **arch) == ViTConfig(
        **shape, kind="standard", block="prenorm", pool="cls", attn_bias=True, mean=mean,
        std=std, **arch)
    assert stage.pretrain_config(data, **arch) == ViTConfig(
        **shape, kind="standard", block="prenorm", pool="cls", attn_bias=True, mean=mean,
        std=std, **arch)


def test_train_config_takes_the_training_group_whole():
    """train_vit.train holds every TrainConfig field but the seed (adv_eps in units of 1/255):
    a field added to TrainConfig without a key here fails, never takes its default."""
    from attncert.training.train import TrainConfig

    s = _settings()
    t = dataclasses.replace(s.train, epochs=3, lr=0.5, warmup_steps=7, margin="olsa",
                            olsa_gamma=0.1, msvp_lambda=[1e-3, 2e-3, 3e-3],
                            adversarial="pgd_linf", adv_steps=3, optimizer="sgd", momentum=0.8,
                            mix_switch_prob=0.25, mixup_alpha=0.4)
    tc = t.config(seed=7)
    assert tc.seed == 7
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"seed", "adv_eps"}
    assert names | {"adv_eps_255"} == {f.name for f in dataclasses.fields(t)}
    for name in names:
        want = getattr(t, name)
        assert getattr(tc, name) == (tuple(want) if isinstance(want, list) else want), name
    assert tc.adv_eps == t.adv_eps_255 / 255  # params.yaml: units of 1/255


def test_checkpoint_dir_resumes_same_run_and_clears_another(tmp_path):
    s = _settings()
    cfg = train_vit.model_config(s, _point(), _data(3, 32))
    fp = fingerprint(cfg, s.train.config(0), "mnist", "test")
    ckpt = tmp_path / "ckpt"
    assert prepare_checkpoint_dir(ckpt, fp) == "fresh"
    (ckpt / "last.pt").write_text("state")
    assert prepare_checkpoint_dir(ckpt, fp) == "resume"
    assert (ckpt / "last.pt").exists()
    other = fingerprint(train_vit.model_config(s, _point(gamma_vo=0.25), _data(3, 32)),
                             s.train.config(0), "mnist", "test")
    status = prepare_checkpoint_dir(ckpt, other)
    assert status == "cleared: model changed" and not (ckpt / "last.pt").exists()


def test_vit_figures_draw_from_saved_results():
    rows = [{"epoch": e, "train_loss": 1.0 / e, "test_loss": 1.1 / e, "train_acc": 0.5 + e / 10,
             "test_acc": 0.4 + e / 10, "sigma/blocks.0.attn.q": 0.25, "sigma/head": 3.0}
            for e in (1, 2)]
    assert isinstance(figs.plot_training(rows), Figure)
    assert isinstance(figs.plot_spectral_norms(rows[-1], {"gamma_qk": 0.25}), Figure)
    table = pd.DataFrame({"correct": [True, True, False], "forward_seconds": [1e-3] * 3,
                          "radius_lofast_M_pairwise": [0.3, 0.05, 0.0],
                          "seconds_lofast_M_pairwise": [2e-2] * 3})
    audit_rows = [{"eps": 0.1, "robust_acc": 0.6, "broken_lofast_M_pairwise": 0}]
    summary = certify.summarize(table, audit_rows, [0.1], ["lofast_M"], ["pairwise"])
    assert summary["certified_acc"]["lofast_M_pairwise"]["0.1"] == pytest.approx(1 / 3)
    assert summary["cost_vs_forward"]["lofast_M_pairwise"] == pytest.approx(20.0)
    long = certify.long_certified_accuracy(summary)
    ref = {"eps": 1.58, "certified": 54.5, "label": "paper"}
    assert isinstance(figs.plot_certified(long, "t", ref), Figure)
    assert isinstance(figs.plot_radius_cost(summary), Figure)
