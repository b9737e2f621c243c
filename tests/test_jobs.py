"""One job list: every stage module names its plan (``jobs(params)``, data that the cost model
prices); at every scale the units of those jobs, the units the stage modules run (``units(p)``
and ``unit_stage``, the grid's points) and dvc.yaml's resolved unit and grid stages are one
list, and the cost model's units are the same (smoke scale: the estimate runs code)."""

import json
import shutil
from collections import defaultdict
from pathlib import Path

import pytest

from attncert import stages
from attncert.pipeline import dvcfile, profile
from attncert.pipeline import jobs as J
from attncert.pipeline.runs import GridPoint
from attncert.stages import certvit, crown, frontier, specformer, text
from attncert.stages.registry import MODULES, load_params, stage_jobs

ROOT = Path(__file__).resolve().parents[1]
SPLIT = {"frontier": frontier, "specformer": specformer, "text": text, "certvit": certvit,
         "crown": crown}


@pytest.fixture(scope="module", params=["paper", "cpu", "smoke"])
def scale_params(request, tmp_path_factory):
    if request.param == "paper":
        return load_params(ROOT / "params.yaml")
    tmp = tmp_path_factory.mktemp(request.param)
    shutil.copy(ROOT / "params.yaml", tmp / "params.yaml")
    shutil.copytree(ROOT / "profiles", tmp / "profiles")
    profile.apply(request.param, tmp)
    return load_params(tmp / "params.yaml")


def _dvc_runs(p) -> list[dvcfile.StageRun]:
    return dvcfile.stage_runs(dvcfile.read_stages(ROOT / "dvc.yaml"), p)


def _module_units(p) -> list[str]:
    return [m.unit_stage(p[name], u) for name, m in SPLIT.items() for u in m.units(p[name])]


def test_every_split_stage_names_its_units_as_dvc_does(scale_params):
    assert set(SPLIT) == set(stages.UNIT_STAGES.values())
    runs = _dvc_runs(scale_params)
    dvc_units = [f"{r.stage}@{r.key}" if r.key else r.stage for r in runs
                 if r.stage in stages.UNIT_STAGES]
    named = _module_units(scale_params)
    assert len(named) == len(set(named))
    assert sorted(named) == sorted(dvc_units)


def test_the_grid_s_points_are_dvc_s(scale_params):
    g = scale_params["vit_grid"]
    points = {GridPoint(g.results_dir, d, depth, h, vo).name for d in g.dataset
              for depth in g.depth for h in g.heads for vo in g.gamma_vo}
    for stage in ("train_vit", "certify_vit"):
        assert {r.run for r in _dvc_runs(scale_params) if r.stage == stage} == points


def test_the_cost_model_plans_the_same_units(smoke):
    """The plan's units (the grid's points and every split stage's units) are the list above."""
    from attncert.cost import plan
    from attncert.cost.counting import GPUS

    p = load_params(smoke)
    hours = plan.unit_hours(p, GPUS["h100"])
    grid = {u for u in hours if u.startswith("grid ")}
    g = p["vit_grid"]
    assert len(grid) == len(g.dataset) * len(g.depth) * len(g.heads) * len(g.gamma_vo)
    assert set(hours) - grid == set(_module_units(p))


def test_every_stage_module_has_the_same_names():
    assert tuple(MODULES) == stages.STAGES
    for name, module in MODULES.items():
        assert module.SECTION == name
        assert isinstance(module.Params, type), name
        assert callable(module.jobs) and callable(module.run), name
        assert callable(getattr(module, "headline_rows", None)) or name == "figures", name


def test_the_jobs_are_the_units_each_stage_runs(scale_params):
    """A split stage's jobs sit in exactly its units; a grid point's two jobs in the point's
    unit; a stage run whole has jobs outside any unit."""
    for name, module in SPLIT.items():
        planned = J.units(module.jobs(scale_params))
        assert planned == list(dict.fromkeys(
            module.unit_stage(scale_params[name], u) for u in module.units(scale_params[name])))
    g = scale_params["vit_grid"]
    points = [f"grid {GridPoint(g.results_dir, d, depth, h, vo).name}" for d in g.dataset
              for depth in g.depth for h in g.heads for vo in g.gamma_vo]
    for stage in ("train_vit", "certify_vit"):
        assert J.units(MODULES[stage].jobs(scale_params)) == points
    for stage in ("data", "tightness", "figures"):
        assert MODULES[stage].jobs(scale_params) and not J.units(MODULES[stage].jobs(scale_params))
    everything = stage_jobs(scale_params)
    assert [j.stage for j in everything] == sorted(
        (j.stage for j in everything), key=stages.STAGES.index)  # pipeline order


def test_a_plan_is_data_and_refuses_what_it_cannot_price():
    from attncert.cost import pricing

    with pytest.raises(ValueError, match="model kind 'mlp'"):
        J.Model("mlp")
    with pytest.raises(ValueError, match="unknown stage"):
        stage_jobs(load_params(ROOT / "params.yaml"), ["train"])
    job = J.Job("crown", "crown_unit@x", "x", J.Model("none"), (object(),))
    with pytest.raises(TypeError, match="crown x: no price for a object"):
        pricing.job_work(job)
    note = J.Job("data", "", "data", J.Model("none"), (J.Note("nothing on a GPU"),))
    (w,) = pricing.job_work(note)
    assert (w.stage, w.what, w.flops, w.kernels, w.unit) == ("data", "nothing on a GPU", 0, 0, "")


def check_plans(repo: Path) -> None:
    """The plans the cost model prices against what the units recorded in a run of ``repo``
    (tests/test_dvc_pipeline.py's smoke run): the frontier's and the crown study's sizes, and
    each text unit's models, in order, on the split sizes the plan prices."""
    p = load_params(repo / "params.yaml")
    recorded = {J.Train: ("n_train", "n_train"), J.Certify: ("n", "n_val"),
                J.Audit: ("n", "n_attacked")}  # phase: (its size, the record's key)
    for job in frontier.jobs(p):
        rec = json.loads((repo / p["frontier"].results_dir / "units" /
                          f"{job.unit.split('@')[1]}.json").read_text())
        for ph in job.phases:
            if type(ph) in recorded:
                size, key = recorded[type(ph)]
                assert getattr(ph, size) == rec[key], (job.name, ph)
    for job in crown.jobs(p):
        rec = json.loads((repo / p["crown"].results_dir / "units" /
                          f"{job.name.replace(' ', '-')}.json").read_text())
        assert next(ph for ph in job.phases if isinstance(ph, J.Certify)).n == rec["n"], job.name
    _check_text_plan(repo, p)


def _check_text_plan(repo: Path, p) -> None:
    from attncert.text.plan import jobs as text_jobs

    planned = defaultdict(list)
    for job in text_jobs(p):
        planned[job.unit.split("@")[1]].append(job)
    for unit, jobs in planned.items():
        rec = json.loads((repo / p["text"].results_dir / "units" / f"{unit}.json").read_text())
        if rec["data"] is not None:  # an SST-2 unit
            d, ran = rec["data"], [f"sst2 {j['model']}" for j in rec["jobs"]]
            sizes = (d["train"], d["dev"], d["frozen_train"], d["n_certified"],
                     d["n_attacked"])
        elif "models" in (rec["entry"] or {}):  # another dataset with its data
            d, ran = rec["entry"], [f"{unit} {m}" for m in rec["entry"]["models"]]
            sizes = (d["train_sentences"], d["dev_sentences"], d["frozen_train_sentences"],
                     d["n_certified"], d["n_attacked"])
        else:  # left out at this scale: recorded as unavailable
            continue
        assert ran == [j.name for j in jobs], unit
        n_train, n_dev, frozen, n_cert, n_attacked = sizes
        for job in jobs:
            train = next(ph for ph in job.phases if isinstance(ph, J.Train))
            head = job.model.kind == "frozen_head"
            assert (train.n_train, train.n_eval) == (frozen if head else n_train, n_dev), job.name
            audit = next(ph for ph in job.phases if isinstance(ph, J.Audit))
            assert audit.n == n_attacked, job.name
            for ph in job.phases:
                if isinstance(ph, J.LayerCertify):
                    assert ph.n == n_cert, job.name


def test_a_plan_names_a_shape_it_cannot_know():
    import dataclasses

    p = load_params(ROOT / "params.yaml")
    t = p["text"]
    odd = dataclasses.replace(p, sections={**p.sections, "text": dataclasses.replace(
        t, frozen=dataclasses.replace(t.frozen, source="some/encoder"))})
    with pytest.raises(ValueError, match="text.frozen.source: the shape of 'some/encoder'"):
        text.jobs(odd)
    cv = p["certvit"]
    odd = dataclasses.replace(p, sections={**p.sections, "certvit": dataclasses.replace(
        cv, imagenet=dataclasses.replace(cv.imagenet, sources=["some/vit"]))})
    with pytest.raises(ValueError, match="certvit.imagenet.sources: the shape of 'some/vit'"):
        certvit.jobs(odd)
