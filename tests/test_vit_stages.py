"""The train_vit and certify_vit stage modules: their sections' checks, the CertViT comparison
and the headline rows beside the papers' numbers."""

from pathlib import Path

import pytest
from helpers import set_key

from attncert.pipeline.audit import Audit
from attncert.pipeline.context import make_context
from attncert.pipeline.params import ParamsError, read_yaml
from attncert.report import paper
from attncert.stages import certify_vit, train_vit
from attncert.stages.registry import validate

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "section,key,value,match",
    [
        ("train_vit", "train.margin", "radius",
         r"^train_vit\.train\.margin: 'radius' does not train this model"),
        ("train_vit", "kind", "deep", r"^train_vit\.kind: unknown value 'deep'"),
        ("train_vit", "train.adversarial", "pgd_l2",
         r"^train_vit\.train\.adversarial: unknown value"),
        ("train_vit", "train.msvp_lambda", [0.0, 0.0],
         r"^train_vit\.train: msvp_lambda: needs 3 values"),
        ("train_vit", "radius_stream", -1.0, r"^train_vit\.radius_stream: must be > 0 or null"),
        ("train_vit", "train.epochs", 0, r"^train_vit\.train\.epochs: must be > 0"),
        ("train_vit", "train.optimizer", "adam", r"^train_vit\.train\.optimizer: unknown value"),
        ("train_vit", "epochs", 3, r"^train_vit\.epochs: renamed: the key is now "
                                   r"train_vit\.train\.epochs"),
        ("certify_vit", "variants", ["lofast_M", "crown"],
         r"^certify_vit\.variants: unknown value 'crown'"),
        ("certify_vit", "tests", ["pairwise", "pairwise"], r"^certify_vit\.tests: .*duplicate"),
        ("certify_vit", "softmax_lipschitz", 0.25,
         r"^certify_vit\.softmax_lipschitz: must be one of 0.5, 1.0"),
    ])
def test_the_sections_refuse_bad_values(section, key, value, match):
    raw = read_yaml(ROOT / "params.yaml")
    set_key(raw, section, key, value)
    with pytest.raises(ParamsError, match=match):
        validate(raw)


def test_the_sections_are_the_stage_modules():
    p = validate(read_yaml(ROOT / "params.yaml"))
    assert isinstance(p["train_vit"], train_vit.Params)
    assert isinstance(p["certify_vit"], certify_vit.Params)


def _summary(eps: str, certified: float) -> dict:
    return {"clean_acc": 0.9, "pgd_acc": {eps: 0.7},
            "certified_acc": {"lofast_M_pairwise": {eps: certified}}}


def test_the_grid_carries_no_paper_number():
    """The grid is LoFAST Figure 2's 384-d ViTs (no numbers printed): LoFAST Table 1 (128-d
    models, the crown stage) and CertViT Table 1 (its own ViTs) never stand beside it."""
    t1 = paper.LOFAST_TABLE1
    eps, depth = t1["eps"][0], next(iter(t1["lofast"]))
    for dataset, e in (("cifar10", str(eps)), ("mnist", str(paper.certvit_pixel_eps("mnist"))),
                       ("mnist", str(paper.CERTVIT_MNIST["eps"]))):
        rows = certify_vit.headline_rows(_summary(e, 0.3), {"dataset": dataset, "depth": depth})
        assert all(r["paper"] is None for r in rows), dataset
        brief = {r["key"]: r for r in rows}[f"certified_acc/lofast_M_pairwise/{e}"]
        assert brief["brief"] and brief["ours"] == 0.3
def test_train_rows():
    rows = train_vit.headline_rows({"clean_acc": 0.8, "train_seconds": 3.0, "epochs": 2}, {})
    assert [(r["key"], r["brief"]) for r in rows] == [
        ("clean_acc", True), ("epochs", False), ("train_seconds", True)]


def test_certify_vit_certifies_the_whole_split_and_audits_the_first_n_attack(tmp_path):
    """n_test 0 certifies every test image; the PGD audit attacks the first n_attack, and its
    soundness comparison (certified vs PGD accuracy) is on those same points."""
    import dataclasses

    import pandas as pd
    import torch

    from attncert.models import ViTConfig, build_vit
    from attncert.models.vit import save_vit
    from attncert.pipeline.io import torch_save
    from attncert.pipeline.params import BaseParams, parse_section
    from attncert.pipeline.runs import GridPoint

    g = torch.Generator().manual_seed(0)
    data = {"name": "mnist", "kind": "image", "source": "stand-in", "classes": ["0", "1"],
            "mean": [0.5], "std": [0.25], "shape": [1, 8, 8],
            "train": {"x": torch.randint(0, 256, (4, 1, 8, 8), dtype=torch.uint8, generator=g),
                      "y": torch.tensor([0, 1, 0, 1])},
            "test": {"x": torch.randint(0, 256, (9, 1, 8, 8), dtype=torch.uint8, generator=g),
                     "y": torch.randint(0, 2, (9,), generator=g)}}
    processed = tmp_path / "processed"
    processed.mkdir()
    torch_save(data, processed / "mnist.pt")
    point = GridPoint(results_dir=str(tmp_path / "runs"), dataset="mnist", depth=1, heads=2,
                      gamma_vo=0.5)
    point.run_dir.mkdir(parents=True)
    torch.manual_seed(0)
    save_vit(build_vit(ViTConfig(image_size=8, channels=1, patch=4, dim=16, depth=1, heads=2,
                                 mlp_hidden=32, num_classes=2, kind="lipschitz", pool="mean",
                                 mean=(0.5,))), point.run_dir / "model.pt")
    raw = read_yaml(ROOT / "params.yaml")
    p = dataclasses.replace(parse_section("certify_vit", raw["certify_vit"], certify_vit.Params),
                            n_test=0, variants=["lofast_M"], tests=["pairwise"],
                            cert_eps=[0.05, 0.5], audit=Audit(n=4, steps=3, restarts=1,
                                                              batch_size=0),
                            results_dir=str(tmp_path / "results"))
    base = parse_section("base", {**raw["base"], "device": "cpu"}, BaseParams)
    out = certify_vit.run(p, make_context(base, point=point, processed_dir=str(processed)))
    assert out.n == 9 and out.summary["n"] == 9 and out.summary["n_attacked"] == 4
    samples = pd.read_csv(out.samples)
    assert len(samples) == 9
    assert samples["pgd_adversarial_at_0.5"].notna().sum() == 4  # the first four only
    assert samples["pgd_adversarial_at_0.5"][4:].isna().all()
    assert out.audit["certified_lofast_M_pairwise"].le(out.audit["robust_acc"]).all()
