"""The cost estimate: counted FLOPs and kernels, read from the params file; training step times."""

import dataclasses
import json
import math
import re
from pathlib import Path

import pytest
import torch
from helpers import params_with

from attncert import cost
from attncert.pipeline.params import read_yaml
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]


def _hours(table: str) -> dict[str, float]:
    rows = re.findall(r"^\| \**([a-z_]+)\** \| [^|]+ \| \**([0-9.e+-]+)\** \|", table, re.M)
    return {k: float(v) for k, v in rows}


def test_counts_are_exact_for_a_linear_map():
    lin = torch.nn.Linear(8, 4, bias=False)
    c = cost.fit(lambda b: (lambda: lin(torch.zeros(b, 8))))
    assert c.per_sample == 2 * 8 * 4 and c.per_call == 0 and c.kernels >= 1


def test_table_has_every_stage_and_follows_the_params(smoke, tmp_path):
    p = load_params(smoke)
    table = cost.cost_table(p, cost.GPUS["h100"])
    hours = _hours(table)
    assert set(cost.STAGES) | {"total"} <= set(hours)
    assert hours["total"] == pytest.approx(sum(hours[s] for s in cost.STAGES), rel=0.01)
    for stage in ("train_vit", "certify_vit", "specformer", "text", "certvit", "crown"):
        assert hours[stage] > 0, stage
    assert "at most" in table and "H100" in table
    # more epochs: more training hours; a larger patch: fewer tokens, fewer FLOPs
    def train_vit_flops(path):
        return sum(w.flops for w in cost.stage_work(load_params(path), ["train_vit"])[0])

    base = train_vit_flops(smoke)
    longer = params_with(smoke, tmp_path, "train_vit", "train.epochs", 4)
    assert train_vit_flops(longer) > 3.9 * base
    assert train_vit_flops(params_with(smoke, tmp_path, "vit", "lofast.patch", 14)) < base


def test_crown_work_is_per_dataset(smoke, tmp_path):
    """Each dataset of crown.datasets trains, certifies and audits its own models; CROWN's
    time-limit bound counts every dataset's points."""
    def crown(path):
        work, seconds = cost.stage_work(load_params(path), ["crown"])
        return {w.what for w in work}, sum(w.flops for w in work), seconds

    names, flops, seconds = crown(smoke)
    assert names and all(n.startswith("mnist L") for n in names)
    two_names, two_flops, two_seconds = crown(params_with(smoke, tmp_path, "crown", "datasets",
                                                    ["mnist", "fashion_mnist"]))
    assert two_names == names | {n.replace("mnist", "fashion_mnist", 1) for n in names}
    assert two_flops == pytest.approx(2 * flops, rel=0.01)
    assert two_seconds == pytest.approx(2 * seconds)


def test_unknown_pretrained_source_is_a_clear_error(smoke, tmp_path):
    p = load_params(params_with(smoke, tmp_path, "certvit", "source", "someone/vit-huge"))
    with pytest.raises(ValueError, match="HF_VITS"):
        cost.stage_work(p)


def test_the_cli_names_a_missing_file_or_key_without_a_traceback(smoke, tmp_path, capsys):
    from ruamel.yaml import YAML

    from attncert.cost.cli import main

    yaml = YAML()
    data = yaml.load(smoke.read_text())
    del data["train_vit"]["train"]["lofast_start"]
    bad = tmp_path / "missing.yaml"
    with bad.open("w") as f:
        yaml.dump(data, f)
    for path, match in ((bad, "train_vit.train.lofast_start: missing"),
                        (tmp_path / "absent.yaml", "no such file")):
        with pytest.raises(SystemExit) as exc:
            main(["table", "--params", str(path)])
        assert exc.value.code == 2
        assert match in capsys.readouterr().err


def test_paper_params_name_a_known_certvit_source():
    source = read_yaml(ROOT / "params.yaml")["certvit"]["source"]
    assert source == "pipeline" or source in cost.HF_VITS


def test_cost_doc_block_is_replaced_between_the_markers(tmp_path):
    doc = tmp_path / "cost.md"
    doc.write_text(f"a\n{cost.MARKERS[0]}\nold\n{cost.MARKERS[1]}\nb\n")
    cost.write_block("| new |", doc)
    assert doc.read_text() == f"a\n{cost.MARKERS[0]}\n| new |\n{cost.MARKERS[1]}\nb\n"
    doc.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        cost.write_block("x", doc)
    # the blocks live in docs/cost.md (linked from README), and only there
    committed = (ROOT / cost.COST_DOC).read_text()
    assert all(m in committed for m in (*cost.MARKERS, *cost.PLAN_MARKERS))
    readme = (ROOT / "README.md").read_text()
    assert f"({cost.COST_DOC})" in readme
    assert not any(m in readme for m in (*cost.MARKERS, *cost.PLAN_MARKERS))


def test_bench_times_a_training_step_of_every_model_kind(smoke):
    """Every kind (the rows the GPU calibration reads), and with ``adversarial`` SpecFormer's
    two under PGD training (step kinds of their own, the attack's passes in the step: slower
    than the kind's plain step)."""
    from attncert.cost.bench import ADVERSARIAL_KINDS
    from attncert.cost.graphs import graphs_key

    rows = cost.bench_training(load_params(smoke), batch=2, steps=1, device="cpu")
    assert [r["model"] for r in rows] == list(cost.bench_models(load_params(smoke)))
    adv = cost.bench_training(load_params(smoke), batch=2, steps=1, device="cpu",
                              adversarial=True)
    assert [r["model"] for r in adv] == [graphs_key(k, adversarial=True)
                                         for k in ADVERSARIAL_KINDS]
    assert len(rows) == 7 and all(r["ms_per_step"] > 0 and r["precision"] == "fp32"
                                  and r["status"] == "ok" for r in rows + adv)
    ms = {r["model"]: r["ms_per_step"] for r in rows + adv}
    assert all(ms[graphs_key(k, adversarial=True)] > ms[k] for k in ADVERSARIAL_KINDS)


def test_bench_times_the_audit_step_of_each_image_kind(smoke):
    from attncert.cost.bench import AUDIT_KINDS, bench_audits
    from attncert.cost.graphs import graphs_key

    rows = bench_audits(load_params(smoke), batch=2, steps=1, device="cpu")
    assert [r["model"] for r in rows] == [graphs_key(k, audit=True) for k in AUDIT_KINDS]
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in rows)
    with pytest.raises(ValueError, match="mode"):
        bench_audits(load_params(smoke), batch=2, mode="fast")


def test_text_work_counts_every_model_the_stage_trains(smoke):
    """The text estimate trains exactly the stage's models (attncert.text.jobs.dataset_jobs):
    the frozen encoder's forward once per sentence, its head for the head's own epochs."""
    from attncert.stages.text import dataset_jobs, text_datasets
    from attncert.text.tokenize import VOCAB

    p = load_params(smoke)
    t = p["text"]
    assert t.datasets == ["sst2", "yelp_polarity"] and "qqp" in t.frozen.datasets
    work = cost.stage_work(p, ["text"])[0]
    trained = {w.what for w in work if ":" not in w.what and "(" not in w.what}
    assert trained == {f"{d} {name}" + (" head" if name == "frozen-olsa" else "")
                       for d in text_datasets(t) for name in dataset_jobs(t, VOCAB, d)}
    assert {w.what.split()[0] for w in work if "frozen-olsa (" in w.what} == set(
        t.frozen.datasets)
    # QQP's head trains for its own epochs on the cached states: more epochs, more work
    def head(q):
        return next(w for w in cost.stage_work(q, ["text"])[0]
                    if w.what == "qqp frozen-olsa head")
    more = dataclasses.replace(p, sections={**p.sections, "text": dataclasses.replace(
        t, frozen=dataclasses.replace(
            t.frozen, epochs={**t.frozen.epochs, "qqp": 4 * t.frozen.epochs["qqp"]}))})
    assert head(more).flops == pytest.approx(4 * head(p).flops)


def test_text_sizes_follow_the_stage_s_draws(smoke):
    """Certified and attacked counts as the stage draws them (n_test 0: the whole reported
    split), Yelp's dev held out of its training split, QQP reported on dev."""
    import dataclasses

    from attncert.text.plan import text_sizes

    smoke_text = load_params(smoke)["text"]
    t = dataclasses.replace(smoke_text, max_train=0, max_test=0, n_test=0,
                            audit=dataclasses.replace(smoke_text.audit, n=1000),
                            frozen=dataclasses.replace(smoke_text.frozen, max_train=0))
    yelp = text_sizes(t, cost.TEXT_SIZES["yelp_polarity"])
    assert yelp == {"train": 560000 - 38000, "dev": 38000, "reported": 38000,
                    "frozen_train": 522000, "certified": 38000, "attacked": 1000}
    qqp = text_sizes(t, cost.TEXT_SIZES["qqp"])
    assert qqp["certified"] == qqp["dev"] == qqp["reported"] == 40430
    assert qqp["train"] == 363846


def test_the_multi_gpu_plan_schedules_units_longest_first(smoke):
    from attncert.cost import plan
    from attncert.cost.counting import GPUS

    assert plan.makespan([5, 4, 3, 3, 3], 2) == 10  # LPT (the optimum 9: within 4/3)
    assert plan.makespan([5, 4, 3, 3, 3], 1) == 18 and plan.makespan([7, 1], 8) == 7
    with pytest.raises(ValueError):
        plan.makespan([1.0], 0)
    p = load_params(smoke)
    hours = plan.unit_hours(p, GPUS["h100"])
    g = p["vit_grid"]
    grid = [u for u in hours if u.startswith("grid ")]
    assert len(grid) == len(g.dataset) * len(g.depth) * len(g.heads) * len(g.gamma_vo)
    assert "certvit_main" in set(hours)   # smoke: the tiny ImageNet ViT is not costed
    gathering = {"specformer", "text", "crown", "frontier", "certvit"}  # units do the work
    assert not set(hours) & {"tightness", "figures", "data", *gathering}
    # every other unit is a DVC stage that scripts/repro-gpus hands out under that name
    from attncert.pipeline import dvcfile

    names = {f"{r.stage}@{r.key}" if r.key else r.stage
             for r in dvcfile.stage_runs(dvcfile.read_stages(ROOT / "dvc.yaml"), p)}
    units = set(hours) - set(grid)
    assert units <= names
    assert {u.split("@")[0] for u in units} >= {"specformer_runs", "text_unit", "crown_unit",
                                                "frontier_unit"}
    # scripts/repro-gpus leaves exactly the gathering stages (and data, tightness, figures)
    # to its final repro
    script = (ROOT / "scripts" / "repro-gpus").read_text()
    final = script.split("case $stage in", 1)[1].split(")", 1)[0]
    assert {s.strip() for s in final.split("|")} == {
        "data", "tightness", *gathering, "figures", "certify_vit@*"}
    table = plan.plan_table(p, GPUS["h100"], [1, 2])
    assert "| 1 |" in table and "1.00x" in table and "longest unit" in table


def test_units_sharing_a_gpu():
    """K units per GPU: a kernel-bound unit's time grows by the measured slowdown, a FLOP-bound
    one's by K (it gets 1 / K of the GPU); K beyond the measured ones is refused."""
    from attncert.cost import plan
    from attncert.cost.counting import GPUS
    from attncert.cost.work import Work

    gpu = GPUS["h100"]
    kernels = Work("train_vit", "tiny", "bf16", flops=1e6, kernels=1e6)
    flops = Work("specformer", "big", "bf16", flops=1e18, kernels=10)
    slow = plan.slowdown(4)
    assert plan.slowdown(1) == 1.0 and 1.0 < slow < 1.2 and plan.slowdown(3) == slow
    assert kernels.seconds(gpu, 0.3, 4, slow) == pytest.approx(slow * kernels.seconds(gpu, 0.3))
    assert flops.seconds(gpu, 0.3, 4, slow) == pytest.approx(4 * flops.seconds(gpu, 0.3))
    most = max(k for by_k in plan.concurrency().values() for k in by_k)
    for k in (0, most + 1):
        with pytest.raises(ValueError, match="units per GPU"):
            plan.slowdown(k)


def test_the_concurrency_record_is_read_per_model_kind(tmp_path):
    """Each kind takes its own measured slowdown (the larger over compile modes, the smallest
    K at or above the one asked for); a kind without one, the largest measured."""
    from attncert.cost import bench, plan

    path = tmp_path / "concurrency.json"
    rows = [{"kind": "a", "mode": "eager", "k": 1, "ms_per_step": 10.0, "batch": 8},
            {"kind": "a", "mode": "eager", "k": 4, "ms_per_step": 12.0, "batch": 8},
            {"kind": "a", "mode": "graphs", "k": 1, "ms_per_step": 2.0, "batch": 8},
            {"kind": "a", "mode": "graphs", "k": 4, "ms_per_step": 3.0, "batch": 8},
            {"kind": "b", "mode": "eager", "k": 1, "ms_per_step": 10.0, "batch": 8},
            {"kind": "b", "mode": "eager", "k": 2, "ms_per_step": 11.0, "batch": 8}]
    bench.merge_concurrency_bench(path, rows, "gpu", "2026-11-29", "x")
    table = plan.concurrency(path)
    assert table == {"a": {1: 1.0, 4: 1.5}, "b": {1: 1.0, 2: pytest.approx(1.1)}}
    assert plan.slowdown(4, "a", table) == 1.5 and plan.slowdown(2, "a", table) == 1.5
    assert plan.slowdown(2, "b", table) == pytest.approx(1.1)
    assert plan.slowdown(4, "b", table) == 1.5  # b not measured at 4: the largest there
    assert plan.slowdown(2, "c", table) == 1.5  # unmeasured kind: the largest at 2
    with pytest.raises(ValueError, match="measured up to 4"):
        plan.slowdown(5, "a", table)
    # a new measurement replaces the row of its kind, mode and K, and keeps the others
    bench.merge_concurrency_bench(path, [dict(rows[3], ms_per_step=2.2)], "gpu", "2026-11-30",
                                  "x")
    assert plan.concurrency(path)["a"][4] == pytest.approx(1.2)
    assert len(json.loads(path.read_text())["rows"]) == len(rows)


def test_the_concurrency_bench_names_an_unknown_kind(smoke):
    from attncert.cost import bench

    with pytest.raises(ValueError, match="model kind"):
        bench.bench_concurrency(load_params(smoke), 2, (1,), 1, "cpu", kind="a ViT")


def test_the_plan_with_units_sharing_each_gpu(smoke):
    from attncert.cost import plan
    from attncert.cost.counting import GPUS

    p = load_params(smoke)
    alone = plan.unit_hours(p, GPUS["h100"])
    shared = plan.unit_hours(p, GPUS["h100"], per_gpu=4)
    assert set(shared) == set(alone)
    assert all(alone[u] <= shared[u] <= 4 * alone[u] + 1e-12 for u in alone)
    table = plan.plan_table(p, GPUS["h100"], [1], per_gpu=4)
    assert "| 1 | 4 |" in table and "4 units per GPU" in table


def test_eight_gpus_share_the_paper_scale_near_linearly():
    """At the committed paper params the units spread over 8 GPUs at least 6x faster than on
    one, and no unit is longer than the 8-GPU makespan (the split stages' units are small)."""
    from attncert.cost import plan
    from attncert.cost.counting import GPUS

    hours = plan.unit_hours(load_params(ROOT / "params.yaml"), GPUS["h100"])
    total, span = sum(hours.values()), plan.makespan(list(hours.values()), 8)
    assert total / span >= 6, (total, span)
    assert max(hours.values()) <= span


def test_crown_bounds_are_costed_from_the_measured_seconds(tmp_path, monkeypatch):
    """A bound measured on CUDA counts as measured; one measured on the CPU only is scaled by
    the CUDA / CPU ratio of the bounds measured on both; none: NaN (kernels: test_crown_heads)."""
    from attncert.cost import crown_bench, pricing

    path = tmp_path / "crown.json"
    rows = [{"device": d, "depth": 3, "method": m, "seconds_per_bound": s, "date": "x",
             "machine": "X", "graph": crown_bench.GRAPH}
            for d, m, s in (("cpu", "crown", 4.0), ("cpu", "alpha_crown", 40.0),
                            ("cuda:0", "crown", 6.0))]
    crown_bench.merge_crown_bench(path, rows[:2])
    crown_bench.merge_crown_bench(path, rows[2:])  # another device type: the CPU rows stay
    crown_bench.merge_crown_bench(path, rows[:2])  # the same device type: replaced, not doubled
    assert len(json.loads(path.read_text())["rows"]) == 3
    assert pricing.crown_bound_seconds(3, "crown", path) == (6.0, "measured on CUDA")
    sec, how = pricing.crown_bound_seconds(3, "alpha_crown", path)
    assert sec == pytest.approx(60.0) and "CUDA / CPU" in how
    assert math.isnan(pricing.crown_bound_seconds(4, "crown", path)[0])
    # the committed measurement exists and the table states the seconds it used
    committed = json.loads((ROOT / pricing.CROWN_BENCH).read_text())["rows"]
    assert {r["device"].split(":")[0] for r in committed} == {"cpu", "cuda"}


def test_the_lofast_margin_is_counted_in_the_grid_s_training_step():
    """The grid's training work follows train_vit.train.margin: the lofast margin's bound (norms and
    their backward pass) adds kernels and FLOPs to every step."""
    from attncert.cost.counting import vit_counts
    from attncert.models import ViTConfig
    from attncert.pipeline.datasets import stand_in

    cfg = ViTConfig(image_size=28, channels=1, patch=14, dim=32, depth=2, heads=2,
                    mlp_hidden=32, num_classes=10, kind="lipschitz", pool="mean",
                    mean=tuple(stand_in("mnist")["mean"]))
    lmt, lofast = vit_counts(cfg, None, "lmt")["train"], vit_counts(cfg, None, "lofast")["train"]
    assert vit_counts(cfg, None, "none")["train"] == lmt  # a logit offset adds nothing
    assert lofast.kernels > lmt.kernels and lofast.flops(64) > lmt.flops(64)


def test_bench_margins_time_every_margin_and_name_a_failure(smoke, monkeypatch):
    from attncert.cost import bench

    rows = bench.bench_margins(load_params(smoke), batch=2, steps=1, device="cpu")
    assert [r["margin"] for r in rows] == list(bench.BENCH_MARGINS)
    assert all(r["status"] == "ok" and r["ms_per_step"] > 0 for r in rows)
    assert next(r["vs_lmt"] for r in rows if r["margin"] == "lmt") == 1.0

    def broken(*_a, **_k):
        raise RuntimeError("cannot capture\nmore")

    monkeypatch.setattr("attncert.training.train.step_loss", broken)
    rows = bench.bench_margins(load_params(smoke), batch=2, steps=1, device="cpu")
    assert {r["status"] for r in rows} == {"RuntimeError: cannot capture"}
    with pytest.raises(ValueError, match="mode"):
        bench.bench_margins(load_params(smoke), batch=2, device="cpu", mode="fast")
