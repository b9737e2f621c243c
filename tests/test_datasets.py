"""The dataset table (:mod:`attncert.pipeline.datasets`) is the one place a dataset's facts
live: the params checks, the cost model and the data package's routes all agree with it."""

import pytest

from attncert.cost import counting
from attncert.data import HUB_TEXT_DATASETS, IMAGE_DATASETS
from attncert.data.common import TEXT_FOLDER
from attncert.pipeline import datasets, params
from attncert.pipeline.datasets import TABLE, Dataset


def test_every_dataset_has_a_route_and_every_route_a_row():
    assert set(IMAGE_DATASETS) == set(datasets.IMAGE_DATASETS)
    assert set(TEXT_FOLDER) == set(datasets.TEXT_DATASETS)  # SST-2 has its own route
    assert set(HUB_TEXT_DATASETS) == set(datasets.TEXT_DATASETS) - {"sst2"}
    for name, spec in HUB_TEXT_DATASETS.items():
        assert len(spec.classes) == TABLE[name].classes, name
        assert set(spec.hub_splits) == set(TABLE[name].splits), name  # the labelled splits


def test_the_params_checks_and_the_cost_model_read_the_table():
    assert params.IMAGE_DATASETS is datasets.IMAGE_DATASETS  # the checks import the table's
    assert set(counting.DATASETS) == set(datasets.IMAGE_DATASETS)
    assert counting.DATASETS["cifar100"] == (3, 32, 100, 50000, 10000)
    assert counting.TEXT_SIZES["qqp"] == {"train": 363846, "dev": 40430}


def test_a_row_is_checked():
    with pytest.raises(ValueError, match="kind"):
        Dataset("x", "audio", 2)
    with pytest.raises(ValueError, match="channels"):
        Dataset("x", "image", 2, {"train": 1})
    with pytest.raises(ValueError, match="channels"):
        Dataset("x", "text", 2, {"train": 1}, channels=1, size=8)

