"""The train_vit and certify_vit stage modules: their sections' checks, the CertViT comparison
and the headline rows beside the papers' numbers."""

from pathlib import Path

import pytest

from attncert import paper
from attncert.params import ParamsError, read_yaml, validate
from attncert.stages import certify_vit, train_vit

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "section,key,value,match",
    [
        ("train_vit", "margin", "radius", r"^train_vit\.margin: unknown value 'radius'"),
        ("train_vit", "kind", "deep", r"^train_vit\.kind: unknown value 'deep'"),
        ("train_vit", "adversarial", "pgd_l2", r"^train_vit\.adversarial: unknown value"),
        ("train_vit", "msvp_lambda", [0.0, 0.0], r"^train_vit\.msvp_lambda: needs 3 values"),
        ("train_vit", "radius_stream", -1.0, r"^train_vit\.radius_stream: must be > 0 or null"),
        ("train_vit", "epochs", 0, r"^train_vit\.epochs: must be > 0"),
        ("certify_vit", "variants", ["lofast_M", "crown"],
         r"^certify_vit\.variants: unknown value 'crown'"),
        ("certify_vit", "tests", ["pairwise", "pairwise"], r"^certify_vit\.tests: .*duplicate"),
        ("certify_vit", "cert_softmax_lipschitz", 0.25,
         r"^certify_vit\.cert_softmax_lipschitz: must be one of 0.5, 1.0"),
    ])
def test_the_sections_refuse_bad_values(section, key, value, match):
    raw = read_yaml(ROOT / "params.yaml")
    raw[section][key] = value
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
