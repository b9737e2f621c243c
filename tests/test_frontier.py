"""The frontier stage: settings, the validation split, the selection rule, units then gather."""

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from attncert.pipeline.audit import Audit
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
    assert stage.parse_setting("lofast-0.5") == stage.Setting("lofast", 0.5)
    assert stage.parse_setting("lmt-0.15") == stage.Setting("lmt", 0.15)
    assert stage.parse_setting("linear-1") == stage.Setting("linear", 1.0)
    assert stage.parse_setting("lofast-0.5_tie1").model_axes() == {"qk_tied": True}
    s = stage.parse_setting("lofast-0.5_p7_qk1.5_r4_vo0.25_mix0.3")
    assert (s.kind, s.value, s.is_vit) == ("lofast", 0.5, True)
    assert s.model_axes() == {"patch": 7, "gamma_qk": 1.5, "radius_attn": 4.0, "gamma_vo": 0.25}
    assert s.train_axes() == {"lofast_mix": 0.3}
    s = stage.parse_setting("lofast-0.02_qk4_d2_ep24_warm0.75_route1")
    assert s.model_axes() == {"gamma_qk": 4.0, "depth": 2}
    assert s.train_axes() == {"epochs": 24, "lofast_start": 0.75}
    assert (s.routed, stage.parse_setting("standard_d2_ep24_route1").axes) == (
        True, {"depth": 2, "epochs": 24, "route": True})
    std = stage.parse_setting("standard_p7")
    assert (std.kind, std.value, std.is_vit, std.axes) == ("standard", None, False,
                                                           {"patch": 7})
    for bad, match in (("lofast", "<kind>-<value>"), ("lofast-0", "<kind>-<value>"),
                       ("lmt-x", "<kind>-<value>"), ("olsa-1.0", "<kind>-<value>"),
                       ("lofast-0.5-1", "<kind>-<value>"), ("standard-1", "<kind>-<value>"),
                       ("lofast-0.5_z3", "unknown axis"), ("lofast-0.5_p7.5", "not a int"),
                       ("lofast-0.5_qk0", "once"), ("lofast-0.5_p7_p4", "once"),
                       ("linear-0.5_p7", "no axes"), ("standard_qk1", "p, route, d and ep axes"),
                       ("lmt-0.5_warm0.5", "lofast-\\* only"), ("lofast-0.5_warm1", "below 1"),
                       ("lofast-0.5_ep2.5", "not a int"),
                       ("lofast-0.5_tie2", "not a 1 \\(on\\)")):
        with pytest.raises(ValueError, match=match):
            stage.parse_setting(bad)
    raw = dataclasses.asdict(PAPER["frontier"])
    for key, value, match in (("settings", ["lmt-0.2", "lofst-0.5"], "lofst"),
                              ("settings", ["linear-0.5"], "at least one ViT setting"),
                              ("settings", ["standard", "lofast-0.5_x1"], "unknown axis"),
                              ("min_attention_gap", -1.0, "min_attention_gap"),
                              ("select_eps", 0.3, "not one of cert_eps"),
                              ("n_val", 6000, "holdout"),
                              ("audit", {**raw["audit"], "n": 2000}, "n_val"),
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
    rows = [("a", "lmt-0.2", "lmt", 98, 10, 0.0), ("a", "lofast-0.5", "lofast", 95, 80, 3.0),
            ("a", "linear-0.5", "linear", 85, 99, None),  # the baselines are never selected
            ("a", "standard", "standard", 99, None, 20.0),
            ("b", "lmt-0.2", "lmt", 90, 60, 2.0), ("b", "lofast-0.5", "lofast", 60, 10, 1.5),
            ("a", "lmt-0.2_route1", "lmt", 99, 99, 50.0)]  # another task: never a candidate
    table = pd.DataFrame([{"dataset": d, "setting": s, "kind": k, "clean": c,
                           "certified@0.5": r, "uniform_gap": g,
                           "task": "routed" if "route" in s else "plain"}
                          for d, s, k, c, r, g in rows])
    selected, scores = stage.select(table, 0.5)
    # lmt: (54 + 75) / 2 = 64.5; lofast: (87.5 + 35) / 2 = 61.25
    assert selected == "lmt-0.2" and scores.to_dict() == {"lmt-0.2": 64.5, "lofast-0.5": 61.25}
    # with attention counted: lmt-0.2 loses nothing on dataset a, so it is not a transformer
    assert stage.attending(table, 1.0).to_dict() == {"lmt-0.2": False, "lofast-0.5": True}
    assert stage.select(table, 0.5, 1.0)[0] == "lofast-0.5"
    assert stage.select(table, 0.5, 5.0)[0] is None  # none attends


def test_the_target_reads_the_standard_vit_of_the_same_patch_depth_and_dataset():
    rows = [("a", "standard", "standard", 14, 10.0, None, 0),
            ("a", "standard_p7", "standard", 7, 60.0, None, 0),
            ("a", "lofast-0.5", "lofast", 14, 6.0, 1.4, 0),      # 6 >= 5, 1.4 >= 1.3: met
            ("a", "lofast-0.5_p7", "lofast", 7, 6.0, 2.0, 0),    # 6 < 30: not met
            ("a", "lmt-0.5", "lmt", 14, 6.0, 1.2, 0),            # radius ratio too small
            ("a", "lofast-1", "lofast", 14, 8.0, 2.0, 1),        # a broken certificate
            ("b", "lofast-0.5", "lofast", 14, 9.0, 2.0, 0),      # no standard ViT on b
            ("a", "standard_route1", "standard", 14, 58.0, None, 0),
            ("a", "lmt-0.5_route1", "lmt", 14, 20.0, 2.0, 0),  # 20 < 29: the routed standard's
            ("a", "standard_d2_route1", "standard", 14, 30.0, None, 0),
            ("a", "lofast-0.1_d2_route1", "lofast", 14, 20.0, 2.0, 0)]  # 20 >= 15 at depth 2
    table = pd.DataFrame([{"dataset": d, "setting": s, "kind": k, "patch": p,
                           "depth": 2 if "_d2" in s else 3,
                           "uniform_gap": g, "local_global": r, "broken": b,
                           "task": "routed" if "route" in s else "plain"}
                          for d, s, k, p, g, r, b in rows])
    t = stage.attention_targets(table)
    assert t["target_met"].tolist() == [True, False, False, False, False, False, True]
    assert t["standard_gap"].tolist()[-1] == 30.0
    t = stage.attention_targets(table.drop(columns="depth").iloc[:-2])  # records without depth
    assert t["target_met"].tolist() == [True, False, False, False, False, False]
    assert t["standard_gap"].tolist()[-1] == 58.0
    assert t["standard_gap"].tolist()[:2] == [10.0, 60.0]
    assert t["share_of_standard"].tolist()[0] == pytest.approx(0.6)


def test_a_setting_builds_its_model_and_recipe_from_train_vit_and_its_axes():
    tv, f = PAPER["train_vit"], PAPER["frontier"]
    data = {"train": {"x": torch.zeros(1, 3, 32, 32, dtype=torch.uint8)},
            "classes": list(range(10)), "mean": [0.5] * 3, "std": [0.25] * 3}
    base = stage.model_config(f, tv, stage.parse_setting("lofast-0.5"), "cifar10", data)
    assert (base.kind, base.gamma_qk, base.radius_attn) == ("lipschitz", tv.gamma_qk,
                                                            tv.radius_attn)
    opened = stage.model_config(f, tv, stage.parse_setting("lofast-0.5_p8_qk2_r4"), "cifar10",
                                data)
    assert (opened.patch, opened.gamma_qk, opened.radius_attn) == (8, 2.0, 4.0)
    assert dataclasses.replace(opened, patch=base.patch, gamma_qk=base.gamma_qk,
                               radius_attn=base.radius_attn) == base
    std = stage.model_config(f, tv, stage.parse_setting("standard_p8"), "cifar10", data)
    assert (std.kind, std.block, std.patch, std.dim, std.depth) == (
        "standard", "prenorm", 8, base.dim, base.depth)
    rec = stage.train_config(f, tv, stage.parse_setting("standard"), 0)
    assert (rec.margin, rec.lr, rec.epochs) == ("none", f.standard.lr, tv.train.epochs)
    mixed = stage.train_config(f, tv, stage.parse_setting("lofast-0.25_mix0.3"), 0)
    assert (mixed.margin, mixed.lofast_eps, mixed.lofast_mix) == ("lofast", 0.25, 0.3)


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
                            settings=["lmt-0.2", "lofast-0.5_qk2", "standard", "linear-0.5"],
                            depth=1, heads=2,
                            holdout=20, n_val=12, cert_eps=[0.1, 0.5], select_eps=0.5,
                            audit=Audit(n=10, steps=3, restarts=1, batch_size=0),
                            linear=dataclasses.replace(PAPER["frontier"].linear, epochs=1,
                                                       batch_size=8, warmup_steps=1),
                            results_dir=str(tmp_path / "w"), metrics=str(tmp_path / "f.json"))
    base = BaseParams(scale="smoke", seed=0, device="cpu", precision="fp32", threads=0,
                      deterministic=False, compile="off",
                      batch_memory=0.0)
    assert stage.units(p) == ["mnist-lmt-0.2", "mnist-lofast-0.5_qk2", "mnist-standard",
                              "mnist-linear-0.5"]
    train, val = stage.split(data, p.holdout)
    assert torch.equal(val["x"], x[40:]) and torch.equal(train["x"], x[:40])
    with pytest.raises(ValueError, match="has not run"):
        stage.run(p, _ctx(base, tv))
    recs = {}
    for unit in stage.units(p):
        rec = recs[unit] = stage.run(p, _ctx(base, tv, unit)).record
        assert rec["n_val"] == 12 and rec["n_attacked"] == 10 and rec["broken"] == 0
        for r in rec["audit"]:  # never above what PGD leaves on the same points
            for key in ("certified_global", f"certified_{unit[6:]}"):
                assert r.get(key, 0) <= r["robust_acc"]
    assert rec["kind"] == "linear" and seen == {"mnist": "processed"}
    assert rec["attention"] is None and "certified_acc" in rec
    opened, std = recs["mnist-lofast-0.5_qk2"], recs["mnist-standard"]
    # R^2 gamma_qk^2 / sqrt(d_h), d_h = 8 / 2
    assert opened["attention"]["logit_cap"] == pytest.approx(tv.radius_attn ** 2 * 4.0 / 2.0)
    assert opened["attention"]["n"] == 12 and opened["local_global_radius"] is not None
    assert opened["median_radius"] >= opened["median_radius_global"]
    assert std["attention"]["logit_cap"] is None and "certified_acc" not in std
    assert std["n_train"] == 40
    again = stage.run(p, _ctx(base, tv, "mnist-lmt-0.2")).record
    assert again["checkpoint"] == "resume" and again["clean_acc"] == \
        stage.read_unit(p, _ctx(base, tv), "mnist-lmt-0.2")["clean_acc"]
    res = stage.run(p, _ctx(base, tv)).result
    assert list(res.table["setting"]) == p.settings and res.selected_any in p.settings[:2]
    assert res.selected in (*p.settings[:2], None)
    assert res.metrics["grid_setting"] == "lmt-0.2"
    assert res.metrics["grid_is_selected"] == (res.selected == "lmt-0.2")
    for name in ("frontier.csv", "frontier.png", "attention.png"):
        assert (tmp_path / "w" / name).is_file()
    assert len(res.targets) == 2 and list(res.attention_table().columns)[-1] == "local_global"
    assert json.loads(Path(p.metrics).read_text())["rows"][2]["certified@0.5"] is None
    with pytest.raises(ValueError, match="other params"):
        stage.run(dataclasses.replace(p, n_val=11), _ctx(base, tv))
    with pytest.raises(ValueError, match="other params"):  # the recipe is part of the key
        stage.run(p, _ctx(base, dataclasses.replace(
            tv, train=dataclasses.replace(tv.train, lr=0.5))))


def test_the_cost_model_counts_every_unit():
    from attncert.cost.table import stage_work

    items = stage_work(PAPER, ["frontier"])[0]
    f = PAPER["frontier"]
    assert any(s.startswith("standard") for s in f.settings)  # the standard ViT is counted too
    assert {w.unit for w in items} == {f"frontier_unit@{d}-{s}" for d in f.datasets
                                       for s in f.settings}
    linear = [s for s in f.settings if s.startswith("linear-")]
    assert linear  # the linear baseline: counted, a small fraction of a ViT unit
    unit_flops = {u: sum(w.flops for w in items if w.unit == u) for u in {w.unit for w in items}}
    for s in linear:
        lin = unit_flops[f"frontier_unit@{f.datasets[0]}-{s}"]
        assert 0 < lin < 0.01 * min(v for u, v in unit_flops.items() if "linear-" not in u)
    lofast = sum(w.flops for w in items if "lofast" in w.unit)
    lmt = sum(w.flops for w in items if "lmt" in w.unit)
    assert lofast > lmt > 0  # the bound in every training step costs more than an offset


def test_the_routing_task_needs_token_mixing_and_keeps_its_splits_apart():
    """Composed images: the marker points to the quadrant whose digit is the label; every
    quadrant image comes from its own part (no validation image in a training composite); a
    routed setting changes the task, not the model."""
    from attncert.data import routing
    from attncert.frontier.study import task_parts

    n = 64
    # each image is one flat value that encodes its index: its label is the index mod 10
    vals = torch.arange(n) + 10
    part = {"x": vals.to(torch.uint8).view(n, 1, 1, 1).expand(n, 1, 28, 28).clone(),
            "y": torch.arange(n) % 10}
    out = routing.compose(part, seed=3)
    assert out["x"].shape == (n, 1, 28, 28) and out["x"].dtype == torch.uint8
    k = routing.marker_of(out["x"])
    quads = [out["x"][:, 0, 0, 20], out["x"][:, 0, 20, 0], out["x"][:, 0, 20, 20]]
    chosen = torch.stack(quads, 1)[torch.arange(n), k].long() - 10
    assert torch.equal(out["y"], chosen % 10) and len(set(k.tolist())) == 3
    assert torch.equal(routing.compose(part, seed=3)["x"], out["x"])  # seeded
    with pytest.raises(ValueError, match="square uint8"):
        routing.compose({"x": part["x"].float(), "y": part["y"]}, 0)
    val = {"x": torch.full((8, 1, 28, 28), 200, dtype=torch.uint8),
           "y": torch.zeros(8, dtype=torch.long)}
    data = {"mean": [0.5], "std": [0.5], "classes": list(range(10))}
    setting = stage.parse_setting("lmt-0.5_qk1_route1")
    assert setting.routed and setting.model_axes() == {"gamma_qk": 1.0}
    assert stage.parse_setting("standard_route1").routed
    d2, tr, va = task_parts(data, part, val, setting, seed=0)
    assert set(va["x"][:, :, 14:, :].unique().tolist()) <= {200}  # validation images only
    assert 200 not in set(tr["x"].unique().tolist())
    assert d2["mean"] != [0.5] and data["mean"] == [0.5]  # the composed normalisation
    plain = stage.parse_setting("lmt-0.5")
    assert task_parts(data, part, val, plain, seed=0)[1]["x"] is part["x"]


def test_the_selection_rows_say_when_no_certified_setting_attends():
    m = {"select_eps": 0.5, "selected": None, "selected_any": "lofast-0.5",
         "scores": {"lofast-0.5": 80.0}, "grid_setting": "lofast-0.5",
         "grid_is_selected": False, "settings": [], "datasets": []}
    rows = {r["key"]: r for r in stage.headline_rows(m, {})}
    assert "None" not in rows["selected"]["label"] and "none:" in rows["selected"]["label"]
    assert rows["selected"]["ours"] is None and rows["grid_is_selected"]["ours"] == 0
    assert "it trains lofast-0.5" in rows["grid_is_selected"]["label"]
    m.update(selected="lofast-0.5", grid_is_selected=True)
    rows = {r["key"]: r for r in stage.headline_rows(m, {})}
    assert "lofast-0.5; its score" in rows["selected"]["label"]
    assert rows["grid_is_selected"]["ours"] == 1
