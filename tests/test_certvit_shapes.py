"""CertViT Table 1's parameter counts against the shapes params.yaml gives its small ViTs
(``vit.certvit_*``, from its Table 4): the count settles the MLP width that Table 4 leaves open,
so a shape that drifts from the paper's fails here."""

from pathlib import Path

import pytest
import torch

from attncert.certvit.adapt import adapt
from attncert.certvit.methods import pretrain_config
from attncert.models import build_vit
from attncert.pipeline.params import read_yaml
from attncert.report.paper import CERTVIT_TABLE1_PARAMS

ROOT = Path(__file__).resolve().parents[1]
IMAGES = {"mnist": (28, 1, 10), "cifar10": (32, 3, 10), "cifar100": (32, 3, 100)}


def _data(dataset: str) -> dict:
    size, channels, classes = IMAGES[dataset]
    x = torch.zeros(2, channels, size, size, dtype=torch.uint8)
    split = {"x": x, "y": torch.zeros(2, dtype=torch.long)}
    return {"train": split, "test": split, "num_classes": classes,
            "classes": [str(c) for c in range(classes)], "mean": [0.5] * channels,
            "std": [0.5] * channels}


def paper_count(dataset: str, shape: dict) -> int:
    """Parameters of the L2-attention ViT CertViT trains (W^Q = W^K) of ``shape``, without the
    biases of its linear layers (the paper's count has none; ours adapts a biased ViT)."""
    model = adapt(build_vit(pretrain_config(_data(dataset), **shape)))
    return sum(p.numel() for name, p in model.named_parameters()
               if not (name.endswith(".bias") and "norm" not in name))


@pytest.fixture(scope="module")
def shapes():
    params = read_yaml(ROOT / "params.yaml")
    return {d: params["vit"][params["certvit"]["table1"]["vit"][d]] for d in IMAGES}


@pytest.mark.parametrize("dataset", ["mnist", "cifar100"])
def test_table1_shapes_have_the_papers_parameter_count(shapes, dataset):
    assert paper_count(dataset, shapes[dataset]) == CERTVIT_TABLE1_PARAMS[dataset]


def test_cifar10_count_fits_ten_layers_not_the_stated_six(shapes):
    """Table 4 and sec. 4.1 give CIFAR-10's ViT 6 layers; Table 1's count fits 10 (recorded in
    fidelity.yaml; the paper scale keeps the stated 6)."""
    shape = shapes["cifar10"]
    assert shape["depth"] == 6
    assert paper_count("cifar10", shape) != CERTVIT_TABLE1_PARAMS["cifar10"]
    assert paper_count("cifar10", {**shape, "depth": 10}) == CERTVIT_TABLE1_PARAMS["cifar10"]


def test_the_count_sees_the_mlp_width(shapes):
    """Table 4's 'MLP ratio' 3 read as a ratio (width 576) misses the count: the test can fail."""
    shape = dict(shapes["cifar100"], mlp_hidden=576)
    assert paper_count("cifar100", shape) != CERTVIT_TABLE1_PARAMS["cifar100"]
