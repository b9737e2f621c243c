"""The CertViT stage's section and the methods it plans with (attncert.certvit.methods), the
record of its steps (attncert.certvit.steps) and its figures (its modes and runs:
test_certvit_modes.py)."""

import dataclasses
import math

import matplotlib
import pandas as pd
import pytest
import torch
from helpers import PRESETS, tiny_vit
from helpers import processed_images as dataset
from matplotlib.figure import Figure

from attncert.certvit import (
    DRConfig,
    adapt,
    constrain,
    global_bound,
    lipschitz_table,
    load_model,
    steps,
)
from attncert.certvit import methods as stage
from attncert.certvit import tables as cv_tables
from attncert.figures import certvit as figs
from attncert.models.vit import save_vit
from attncert.pipeline import params
from attncert.pipeline.shapes import VitShape
from attncert.report.paper import CERTVIT_CIFAR10, CERTVIT_MNIST, certvit_table1
from attncert.stages import certvit as certvit_stage
from attncert.stages import registry
from attncert.training.checkpoint import prepare_checkpoint_dir
from attncert.training.train import TrainConfig, train

matplotlib.use("Agg")


def p_dr(raw):
    """The Douglas-Rachford config the section's ``dr`` group builds (seed 3)."""
    return params.parse_section("certvit", raw, certvit_stage.Params, PRESETS).dr.config(3)


def test_the_section_takes_the_library_s_choices():
    raw = params.read_yaml(params.PARAMS_FILE)["certvit"]
    params.parse_section("certvit", raw, certvit_stage.Params, PRESETS)
    assert registry.section_class("certvit") is certvit_stage.Params
    with pytest.raises(params.ParamsError, match="0.4867"):  # CertViT's MNIST 1.58 in pixels
        params.parse_section("certvit", {**raw, "cert_eps": [0.1]}, certvit_stage.Params, PRESETS)
    for key, bad in (("norm", "layernorm"), ("finetune_scope", "all"),
                     ("finetune", {**raw["finetune"], "margin": "radius"}),
                     ("spectral", {**raw["spectral"], "margin": "lmt"}),
                     ("radius_quantile", 1.0),
                     ("dr", {**raw["dr"], "relaxation": 2.0}), ("heads", 3),
                     ("budget", {**raw["budget"], "q": 0.0}),
                     ("table1", {**raw["table1"], "heads": {"mnist": 3, "cifar10": 3,
                                                            "cifar100": 3}}),
                     ("table1", {**raw["table1"], "depth": {"mnist": 6}}),
                     ("table1", {**raw["table1"], "datasets": ["imagenet"]})):
        with pytest.raises(params.ParamsError, match=f"certvit.{key}"):
            params.parse_section("certvit", {**raw, key: bad}, certvit_stage.Params, PRESETS)
    # a group is one config object, taken whole; a key of the flat layout names its new place
    assert p_dr(raw) == DRConfig(**{k: v for k, v in raw["dr"].items() if k != "images"},
                                 seed=3)
    with pytest.raises(params.ParamsError, match="certvit.dr.eta: missing"):
        params.parse_section("certvit", {**raw, "dr": {k: v for k, v in raw["dr"].items()
                                                      if k != "eta"}},
                             certvit_stage.Params, PRESETS)
    with pytest.raises(params.ParamsError, match="certvit.dr_eta: renamed: the key is now "
                                                 "certvit.dr.eta"):
        params.parse_section("certvit", {**raw, "dr_eta": 0.01}, certvit_stage.Params, PRESETS)
    # Table 1's datasets need their CertViT eps on the grid; the grid must split the image
    with pytest.raises(params.ParamsError, match="0.0361.*cifar100"):
        params.parse_section("certvit", {**raw, "cert_eps": [0.4867], "table1": {
            **raw["table1"], "datasets": ["mnist", "cifar100"]}}, certvit_stage.Params, PRESETS)
    p = params.parse_section("certvit", raw, certvit_stage.Params, PRESETS)
    # CertViT Table 4's shapes per dataset: patch 7 on MNIST, patch 4 and d 192 on CIFAR
    assert p.table1_run("cifar10", 32).vit.patch == 4 and p.table1_run("mnist", 28).vit.patch == 7
    assert (p.table1_run("cifar100", 32).vit.depth, p.table1_run("cifar10", 32).vit.dim) == (
        12, 192)
    # Douglas-Rachford's relaxation per dataset (its Table 9: MNIST 1.1, CIFAR 1.2)
    assert (p.table1_run("mnist", 28).dr.relaxation, p.table1_run("cifar10", 32).dr.relaxation,
            p.dr.relaxation) == (1.1, 1.2, 1.2)
    with pytest.raises(params.ParamsError, match="relaxation must map to numbers in"):
        params.parse_section("certvit", {**raw, "table1": {**raw["table1"], "relaxation": {
            "mnist": 2.5, "cifar10": 1.2, "cifar100": 1.2}}}, certvit_stage.Params, PRESETS)
    with pytest.raises(params.ParamsError, match="table1.vit: cifar10's 32-pixel images do not "
                                                 "split into patches of 5"):
        dataclasses.replace(p, table1=dataclasses.replace(p.table1, vit={
            **p.table1.vit, "cifar10": VitShape(5, 192, 6, 3, 576)})).table1_run(
                "cifar10", 32)
    # its eps (normalised input) as the pixel radius it covers: eps x min(std), rounded down
    assert cv_tables.table1_eps("mnist") == 0.4867 == pytest.approx(1.58 * 0.3081, abs=1e-4)
    assert (cv_tables.table1_eps("cifar10"), cv_tables.table1_eps("cifar100")) == (
        0.0281, 0.0361)


def test_pipeline_source_is_a_seeded_standard_vit():
    data = dataset(size=28, classes=10)
    arch = dict(patch=7, dim=16, depth=1, heads=2, mlp_hidden=32)
    a, what = stage.source_model(stage.PIPELINE, data, arch, seed=3)
    b, _ = stage.source_model(stage.PIPELINE, data, arch, seed=3)
    cfg = a.config
    assert (cfg.kind, cfg.block, cfg.pool, cfg.num_classes, cfg.image_size) == \
        ("standard", "prenorm", "cls", 10, 28)
    assert cfg.std == (0.25,) and "trained by this stage" in what
    assert stage.state_sha(a) == stage.state_sha(b)
    adapt(a)  # a standard ViT: CertViT adapts it


def test_loaded_source_gets_a_new_head_and_counted_upsampling(tmp_path):
    save_vit(tiny_vit(image_size=16), tmp_path / "m.pt")
    model, what = stage.source_model(str(tmp_path / "m.pt"), dataset(size=8, classes=3), {})
    assert "upsampled x2" in what and "4 -> 3 classes" in what
    assert model.config.num_classes == 3 and model.head.out_features == 3
    assert isinstance(model.normalize, stage.UpsampleNormalize)
    x = torch.rand(5, 1, 8, 8)
    with torch.no_grad():
        assert model(x).shape == (5, 3)
        # nearest upsampling by 2 scales every perturbation's norm by exactly 2
        d = 1e-3 * torch.randn(5, 1, 8, 8)
        up = model.normalize(x + d) - model.normalize(x)
    torch.testing.assert_close(up.flatten(1).norm(dim=1), 2 * d.flatten(1).norm(dim=1) / 0.4)
    bound = global_bound(adapt(model))
    assert bound.rows[0]["lipschitz"] == pytest.approx(2 / 0.4)
    assert load_model(tmp_path / "m.pt").config.num_classes == 4  # the file is untouched


def test_fit_to_dataset_refuses_what_it_cannot_map():
    with pytest.raises(ValueError, match="channel"):
        stage.fit_to_dataset(tiny_vit(), dataset(channels=3))
    with pytest.raises(ValueError, match="integer factor"):
        stage.fit_to_dataset(tiny_vit(image_size=12), dataset(size=8))
    model, notes = stage.fit_to_dataset(tiny_vit(), dataset())
    assert notes == [] and type(model.normalize).__name__ == "Normalize"


def test_bound_parameters_are_all_the_bound_depends_on():
    model = adapt(tiny_vit())
    names = stage.bound_parameters(model)
    assert "blocks.0.attn.q.weight" in names and "embed.proj.weight" in names
    assert "blocks.1.norm_mlp.weight" in names and "norm.weight" in names
    assert "head.weight" not in names and not any(n.endswith(".bias") for n in names)
    before = global_bound(model).features
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in names:
                p.add_(torch.randn_like(p))
    assert global_bound(model).features == before
    with torch.no_grad():
        dict(model.named_parameters())["blocks.0.mlp.fc1.weight"].mul_(2.0)
    assert global_bound(model).features > before


@pytest.mark.parametrize("scope", stage.FINETUNE_SCOPES)
def test_finetune_scopes(tmp_path, scope):
    model = adapt(tiny_vit())
    data = dataset()
    result = constrain(model, data["train"]["x"][:16],
                       DRConfig(threshold=0.5, eta=0.2, iterations=2, max_pairs=128,
                                batch_size=32))
    result.apply(model)
    bound = global_bound(model).features
    bias = model.blocks[0].mlp.fc1.bias.detach().clone()
    with stage.finetune_scope(model, scope, result.masks):
        train(model, data["train"], data["test"], TrainConfig(epochs=1, batch_size=8, lr=0.01),
              tmp_path, device="cpu", progress=False)
    assert not torch.equal(bias, model.blocks[0].mlp.fc1.bias)
    params_ = dict(model.named_parameters())
    for name, mask in result.masks.items():
        assert torch.all(params_[name][~mask] == 0), name
    if scope == "bound_free":
        assert global_bound(model).features == bound
    assert all(p.requires_grad for p in model.parameters())  # restored after the block
    with pytest.raises(ValueError, match="scope"):
        stage.finetune_scope(model, "everything", result.masks)


def test_phase_fingerprint_resumes_only_the_same_start(tmp_path):
    model, cfg = tiny_vit(), TrainConfig(epochs=1)

    def prepare(note="", precision="fp32"):
        fp = stage.phase_fingerprint(model, cfg, "mnist", "src", note, precision)
        return prepare_checkpoint_dir(tmp_path / "c", fp)

    assert prepare() == "fresh"
    (tmp_path / "c" / "last.pt").write_bytes(b"x")
    assert prepare() == "resume"
    assert prepare(precision="bf16").startswith("cleared"), "a phase trained at another precision"
    (tmp_path / "c" / "last.pt").write_bytes(b"x")
    assert prepare("", "bf16") == "resume"
    assert prepare("scope masked").startswith("cleared")
    (tmp_path / "c" / "last.pt").write_bytes(b"x")
    with torch.no_grad():
        model.head.bias.add_(1.0)
    assert prepare("scope masked").startswith("cleared: data")
    assert not (tmp_path / "c" / "last.pt").exists()


def test_step_log_metrics_table1_and_figures():
    data = dataset()
    model = adapt(tiny_vit())
    log = steps.StepLog()
    log.add("pretrained", model, data["test"], 1.5, None)
    b0 = global_bound(model)
    log.add("adapt_finetuned", model, data["test"], 2.0, b0)
    with pytest.raises(ValueError, match="twice"):
        log.add("pretrained", model, data["test"], 0.0)
    with torch.no_grad():
        model.blocks[0].mlp.fc1.weight.mul_(0.5)
    b1 = global_bound(model)
    log.add("constrained", model, data["test"], 0.5, b1)
    frame = log.frame()
    assert list(frame["step"]) == ["pretrained", "adapt_finetuned", "constrained"]
    assert math.isnan(frame["lipschitz"].astype(float)[0])

    report = {"correct": torch.ones(4, dtype=torch.bool), "clean_acc": 1.0,
              "certified_acc": {0.1: 0.5, 1.58: 0.0}, "pgd_acc": {0.1: 0.75, 1.58: 0.25},
              "broken": 0, "radius": torch.tensor([0.0, 0.05, 0.2, 0.3]), "n_attacked": 4,
              "attacked_certified_acc": {0.1: 0.5, 1.58: 0.0},
              "seconds_per_sample": 1e-3}
    m = steps.stage_metrics(log, {"adapt_finetuned": b0, "constrained": b1}, report,
                            {"certify": 3.0})
    assert m["lipschitz_reduction"]["constrained"] == pytest.approx(b0.logits / b1.logits)
    assert m["lipschitz_features_reduction"]["constrained"] > 1
    assert m["total_seconds"] == pytest.approx(7.0) and m["seconds"]["certify"] == 3.0
    assert m["certified_acc"] == {"0.1": 0.5, "1.58": 0.0} and m["broken"] == 0
    with pytest.raises(ValueError, match="no bound"):
        steps.stage_metrics(log, {"constrained": b1}, report)

    row, name = certvit_table1("mnist")
    assert row is CERTVIT_MNIST and "1.58 normalised = 0.4867 pixel" in name
    assert "L2 attention from scratch" in name and "GELU as 1.12" in name  # what differs
    assert certvit_table1("cifar10")[0] is CERTVIT_CIFAR10
    assert certvit_table1("svhn") is None  # a dataset CertViT does not report: no row
    with pytest.raises(ValueError, match="CertViT Table 1 reports no eps for svhn"):
        cv_tables.table1_eps("svhn")

    table = lipschitz_table(adapt_finetuned=b0, constrained=b1)
    diag = [{"site": "a", "sigma_before": 2.0, "sigma_after": 1.0, "sparsity": 0.5},
            {"site": "b", "sigma_before": 1.5, "sigma_after": 1.2, "sparsity": 0.7}]
    for fig in (figs.plot_lipschitz_components(table), figs.plot_steps(frame, 1.2),
                figs.plot_dr_sites(pd.DataFrame(diag))):
        assert isinstance(fig, Figure)
        matplotlib.pyplot.close(fig)
