"""Every training configuration comes from a params group whole, never from a field's silent
default: :class:`attncert.training.train.TrainConfig` is built by the recipe helper
(:meth:`attncert.training.recipe.Training.config`), the text models' config by
:meth:`attncert.text.params.TextRecipe.config`, and nowhere else."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from attncert.pipeline.params import ParamsError, read_yaml
from attncert.stages.registry import load_params, validate
from attncert.training.recipe import Training
from attncert.training.train import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "attncert"
CONFIGS = ("TrainConfig", "TextTrainConfig")
#: the recipe helpers: the image models' (``Training``) and the text models' (``TextRecipe``)
HELPERS = {"training/recipe.py", "text/params.py"}


def _builders() -> set[str]:
    found = set()
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name in CONFIGS:
                    found.add(path.relative_to(SRC).as_posix())
    return found


def test_only_the_recipe_helpers_build_a_training_config():
    builders = _builders()
    assert builders == HELPERS, (f"{sorted(builders - HELPERS)} build a config from flat "
                                 "keys: take a recipe group whole (Training.config, "
                                 "TextRecipe.config)")


def test_a_recipe_group_sets_every_config_field():
    names = {f.name for f in dataclasses.fields(TrainConfig)} - {"seed"}
    assert names == {f.name for f in dataclasses.fields(Training)} - {"adv_eps_255"} | {
        "adv_eps"}
    t = load_params(ROOT / "params.yaml")["frontier"].linear
    cfg = t.config(seed=3)
    assert (cfg.seed, cfg.margin, cfg.lr, cfg.adv_eps) == (3, "radius", t.lr, t.adv_eps_255 / 255)


@pytest.mark.parametrize("section, key, margin", [("train_vit", "train", "radius"),
                                                  ("crown", "train", "radius"),
                                                  ("frontier", "linear", "lmt")])
def test_a_recipe_refuses_a_margin_its_model_cannot_train(section, key, margin):
    raw = read_yaml(ROOT / "params.yaml")
    raw[section] = raw[section] | {key: raw[section][key] | {"margin": margin}}
    with pytest.raises(ParamsError, match=rf"^{section}\.{key}\.margin: '{margin}'"):
        validate(raw)


def test_a_text_job_sets_its_schedule_and_nothing_unknown():
    from attncert.text.jobs import dataset_jobs
    from attncert.text.params import JOB_FIELDS
    from attncert.text.train_text import TextTrainConfig

    t = load_params(ROOT / "params.yaml")["text"]
    names = {f.name for f in dataclasses.fields(TextTrainConfig)} - {"seed"}
    assert names == {f.name for f in dataclasses.fields(t.train)} | set(JOB_FIELDS)
    for name, job in dataset_jobs(t, 100, "sst2").items():
        cfg = t.train.config(7, job.train)
        assert (cfg.seed, cfg.epochs, cfg.lr) == (7, job.train["epochs"], job.train["lr"]), name
        assert cfg.bucket == t.train.bucket and cfg.eval_batch_size == t.train.eval_batch_size
    with pytest.raises(TypeError, match="lacks \\['gamma'\\]"):
        t.train.config(0, {"epochs": 1, "lr": 1e-3})
    with pytest.raises(TypeError, match="unknown \\['seed'\\]"):
        t.train.config(0, {"epochs": 1, "lr": 1e-3, "gamma": 0.0, "seed": 3})
