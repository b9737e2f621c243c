"""The frontier stage: settings, the validation split, the selection rule, units then gather."""

import dataclasses
from pathlib import Path

import pandas as pd
import pytest
import torch

from attncert.pipeline.context import make_context
from attncert.pipeline.params import BaseParams, ParamsError, parse_section
from attncert.pipeline.shapes import VitShape
from attncert.stages import frontier as stage
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]
PAPER = load_params(ROOT / "params.yaml")


def _ctx(base, tv, unit=None):
    """The frontier's context: the unit (None: the gathering stage), train_vit's recipe."""
    return make_context(base, item=unit, processed_dir="processed", sections={"train_vit": tv},
                        device=unit is not None)


def test_settings_parse_and_bad_ones_are_refused():
    assert stage.parse_setting("lofast-0.5") == ("lofast", 0.5)
    assert stage.parse_setting("lmt-0.15") == ("lmt", 0.15)
    assert stage.parse_setting("linear-1") == ("linear", 1.0)
    for bad in ("lofast", "lofast-0", "lmt-x", "olsa-1.0", "lofast-0.5-1"):
        with pytest.raises(ValueError, match="<kind>-<value>"):
            stage.parse_setting(bad)
    raw = dataclasses.asdict(PAPER["frontier"])
    for key, value, match in (("settings", ["lmt-0.2", "lofst-0.5"], "lofst"),
                              ("settings", ["linear-0.5"], "at least one ViT setting"),
                              ("select_eps", 0.3, "not one of cert_eps"),
                              ("n_val", 6000, "holdout"),
                              ("n_attack", 2000, "n_val"),
                              ("datasets", ["sst2"], "not an image dataset")):
        with pytest.raises(ParamsError, match=match):
            parse_section("frontier", raw | {key: value}, stage.Params)


def test_the_grid_setting_is_named_like_a_frontier_setting():
    tv = PAPER["train_vit"]
    assert stage.grid_setting(tv) == f"lmt-{tv.train.lmt_offset:g}"
    def with_train(**changes):
        return dataclasses.replace(tv, train=dataclasses.replace(tv.train, **changes))

    assert stage.grid_setting(with_train(margin="lofast", lofast_eps=0.5)) == "lofast-0.5"
    assert stage.grid_setting(with_train(margin="none")) is None


def test_selection_reads_clean_and_certified_at_the_selection_eps_averaged_over_datasets():
    rows = [("a", "lmt-0.2", "lmt", 98, 10), ("a", "lofast-0.5", "lofast", 95, 80),
            ("a", "linear-0.5", "linear", 85, 99),  # the baseline is never selected
            ("b", "lmt-0.2", "lmt", 90, 60), ("b", "lofast-0.5", "lofast", 60, 10)]
    table = pd.DataFrame([{"dataset": d, "setting": s, "kind": k, "clean": c,
                           "certified@0.5": r} for d, s, k, c, r in rows])
    selected, scores = stage.select(table, 0.5)
    # lmt: (54 + 75) / 2 = 64.5; lofast: (87.5 + 35) / 2 = 61.25
    assert selected == "lmt-0.2" and scores.to_dict() == {"lmt-0.2": 64.5, "lofast-0.5": 61.25}


class _NoTest(dict):
    """A processed dataset whose test split must not be read."""

    def __getitem__(self, key):
        if key == "test":
            raise AssertionError("the frontier read the test split")
        return super().__getitem__(key)


def test_units_train_on_the_training_split_minus_the_held_out_images_then_gather(
        tmp_path, monkeypatch):
    """Each unit on its own (as its DVC stage runs it), the held-out images certified and
    attacked with the test split never read, then the gathering stage; a stale or missing
    record is refused, and a rerun of a finished unit resumes (the same record)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (60, 1, 16, 16), generator=g, dtype=torch.uint8)
    data = _NoTest(name="mnist", train={"x": x, "y": torch.arange(60) % 3},
                   classes=["0", "1", "2"], mean=[0.5], std=[0.25], source="synthetic")
    seen = {}

    def load(name, processed_dir):
        seen[name] = processed_dir
        return data

    monkeypatch.setattr(stage, "load_processed", load)
    paper_tv = PAPER["train_vit"]
    tv = dataclasses.replace(paper_tv, vit=VitShape(8, 8, None, None, 8), train=dataclasses.replace(
        paper_tv.train, epochs=1, batch_size=8, warmup_steps=1, augment="none", lofast_ramp=0.0))
    p = dataclasses.replace(PAPER["frontier"], datasets=["mnist"],
                            settings=["lmt-0.2", "lofast-0.5", "linear-0.5"], depth=1, heads=2,
                            holdout=20, n_val=12, n_attack=10, cert_eps=[0.1, 0.5],
                            select_eps=0.5, attack_steps=3, attack_restarts=1, linear_epochs=1,
                            results_dir=str(tmp_path / "w"), metrics=str(tmp_path / "f.json"))
    base = BaseParams(scale="smoke", seed=0, device="cpu", precision="fp32", threads=0,
                      deterministic=False)
    assert stage.units(p) == ["mnist-lmt-0.2", "mnist-lofast-0.5", "mnist-linear-0.5"]
    train, val = stage.split(data, p.holdout)
    assert torch.equal(val["x"], x[40:]) and torch.equal(train["x"], x[:40])
    with pytest.raises(ValueError, match="has not run"):
        stage.run(p, _ctx(base, tv))
    for unit in stage.units(p):
        rec = stage.run(p, _ctx(base, tv, unit))
        assert rec["n_val"] == 12 and rec["n_attacked"] == 10 and rec["broken"] == 0
        for e in ("0.1", "0.5"):  # never above what PGD leaves on the same points
            assert rec["certified_acc_attacked"][e] <= rec["pgd_acc"][e]
    assert rec["kind"] == "linear" and seen == {"mnist": "processed"}
    again = stage.run(p, _ctx(base, tv, "mnist-lmt-0.2"))
    assert again["checkpoint"] == "resume" and again["clean_acc"] == \
        stage.read_unit(p, _ctx(base, tv), "mnist-lmt-0.2")["clean_acc"]
    res = stage.run(p, _ctx(base, tv))
    assert list(res.table["setting"]) == p.settings and res.selected in p.settings[:2]
    assert res.metrics["grid_setting"] == "lmt-0.2"
    assert res.metrics["grid_is_selected"] == (res.selected == "lmt-0.2")
    assert (tmp_path / "w" / "frontier.csv").is_file()
    assert (tmp_path / "w" / "frontier.png").is_file()
    with pytest.raises(ValueError, match="other params"):
        stage.run(dataclasses.replace(p, n_val=11), _ctx(base, tv))
    with pytest.raises(ValueError, match="other params"):  # the recipe is part of the key
        stage.run(p, _ctx(base, dataclasses.replace(
            tv, train=dataclasses.replace(tv.train, lr=0.5))))


def test_the_cost_model_counts_every_vit_unit():
    from attncert.cost.vision_stages import frontier_work

    items = frontier_work(PAPER, 0)
    f = PAPER["frontier"]
    vit = [s for s in f.settings if not s.startswith("linear-")]
    assert {w.unit for w in items} == {f"frontier_unit@{d}-{s}" for d in f.datasets
                                       for s in vit}
    lofast = sum(w.flops for w in items if "lofast" in w.unit)
    lmt = sum(w.flops for w in items if "lmt" in w.unit)
    assert lofast > lmt > 0  # the bound in every training step costs more than an offset
