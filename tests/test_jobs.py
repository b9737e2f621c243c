"""One job list: at every scale, the units the stage modules name (``units(p)`` and
``unit_stage``, the grid's points) are exactly dvc.yaml's resolved unit stages and grid stages,
and the cost model's units are the same list (smoke scale: the estimate runs code)."""

import shutil
from pathlib import Path

import pytest

from attncert import stages
from attncert.pipeline import dvcfile, profile
from attncert.pipeline.runs import GridPoint
from attncert.stages import certvit, crown, frontier, specformer, text
from attncert.stages.registry import load_params

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
