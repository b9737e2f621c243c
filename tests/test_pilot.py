"""The pilot (attncert.pipeline.pilot): its params cut every training run to one epoch and
still validate; it picks one unit of each kind, records each unit's time, memory and failure,
resumes, and projects the real hours from measured / estimated."""

import json
import os

import pytest

from attncert.pipeline import pilot
from attncert.pipeline.params import read_yaml
from attncert.pipeline.profile import flatten
from attncert.stages.registry import load_params

STAGES = ["data", "train_vit@cifar10-4-4-0.5", "certify_vit@cifar10-4-4-0.5",
          "train_vit@svhn-4-4-0.5", "frontier_unit@cifar10-lmt", "frontier_unit@cifar10-std",
          "specformer_runs@cifar10", "specformer_runs@svhn", "text_unit@sst2-olsa",
          "text_unit@yelp_polarity", "crown_unit@cifar10-3", "crown_unit@cifar10-5",
          "crown_unit@svhn-4", "certvit_main", "certvit_imagenet", "figures"]
FAKE_DVC = """#!/usr/bin/env bash
echo "$*" >>"$DVC_LOG"
if [ "$1" = stage ]; then printf '%s\n' $STAGES; exit 0; fi
stage="${@: -1}"
if [ "$stage" = "${FAIL_STAGE:-none}" ]; then echo "simulated failure in $stage" >&2; exit 1; fi
mkdir -p reports/headline
echo '{"peak_gb": 1.5, "gpu_peak_gb": 7.25}' >"reports/headline/${stage//@/_}.json"
"""


def test_pilot_params_cut_every_training_run_to_one_epoch(tmp_path):
    from ruamel.yaml import YAML

    committed = read_yaml("params.yaml")
    cut = pilot.pilot_params(committed)
    flat, before = flatten(cut), flatten(committed)
    assert flat["train_vit.train.epochs"] == 1 and flat["text.epochs.sst2"] == 1
    assert flat["certvit.table1.pretrain_epochs.cifar10"] == 1
    assert flat["text.frozen.lr_decay_epochs.qqp"] == []
    assert flat["crown.time_budget"] == min(before["crown.time_budget"], pilot.CROWN_BUDGET)
    for key, value in flat.items():  # nothing else moves, and no run keeps more epochs
        if "epochs" not in key and key != "crown.time_budget":
            assert value == before[key], key
        elif isinstance(value, int):
            assert value <= 1, key
    assert flatten(committed) == before  # the input is not modified
    with open(tmp_path / "params.yaml", "w") as f:
        YAML(typ="safe", pure=True).dump(cut, f)
    load_params(tmp_path / "params.yaml")  # the cut params are valid params


def test_one_unit_of_each_kind():
    units = dict(pilot.pick_units(STAGES))
    assert units == {"grid point": ["train_vit@cifar10-4-4-0.5", "certify_vit@cifar10-4-4-0.5"],
                     "frontier": ["frontier_unit@cifar10-lmt"],
                     "specformer": ["specformer_runs@cifar10"],
                     "text": ["text_unit@yelp_polarity"],
                     "crown": ["crown_unit@cifar10-5"], "certvit": ["certvit_main"]}
    assert dict(pilot.pick_units(["data", "text_unit@sst2-olsa"])) == {
        "text": ["text_unit@sst2-olsa"]}


@pytest.fixture
def fake_dvc(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "dvc").write_text(FAKE_DVC)
    (bin_dir / "dvc").chmod(0o755)
    log = tmp_path / "dvc.log"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DVC_LOG", str(log))
    monkeypatch.setenv("STAGES", " ".join(STAGES))
    return log


def test_the_command_lists_its_units_and_refuses_bad_input(tmp_path, fake_dvc, capsys,
                                                           monkeypatch):
    assert pilot.main(["--list"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        " ".join(s) for _, s in pilot.pick_units(STAGES)]
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        pilot.main([])
    assert "repository root" in capsys.readouterr().err
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text("base: {scale: huge}\n")
    with pytest.raises(SystemExit):
        pilot.main([])
    assert "params.yaml:" in capsys.readouterr().err


def test_units_are_recorded_with_failures_and_memory_and_resume(tmp_path, fake_dvc,
                                                                   monkeypatch):
    scratch, out = tmp_path / "scratch", tmp_path / "pilot.json"
    scratch.mkdir()
    units = pilot.pick_units(STAGES)
    monkeypatch.setenv("FAIL_STAGE", "specformer_runs@cifar10")
    record = {}
    pilot.run_units(scratch, units, record, out)
    saved = json.loads(out.read_text())["units"]
    assert saved["specformer"]["status"] == "failed in specformer_runs@cifar10"
    assert "simulated failure" in saved["specformer"]["output"]
    grid = saved["grid point"]
    assert grid["status"] == "ok" and grid["gpu_peak_gb"] == 7.25 and grid["peak_gb"] == 1.5
    assert fake_dvc.read_text().splitlines()[:2] == [
        "repro --single-item train_vit@cifar10-4-4-0.5",
        "repro --single-item certify_vit@cifar10-4-4-0.5"]
    # a rerun runs only what did not finish
    monkeypatch.delenv("FAIL_STAGE")
    fake_dvc.write_text("")
    pilot.run_units(scratch, units, json.loads(out.read_text()), out)
    assert fake_dvc.read_text().splitlines() == ["repro --single-item specformer_runs@cifar10"]
    assert json.loads(out.read_text())["units"]["specformer"]["status"] == "ok"


def test_projected_hours_are_the_estimate_times_measured_over_estimated(monkeypatch):
    from attncert.cost import plan

    calls = []

    def hours(params, gpu):
        calls.append(params)
        return {"crown_unit@cifar10-5": 0.5 if len(calls) == 1 else 10.0}

    monkeypatch.setattr(plan, "unit_hours", hours)
    record = {"units": {
        "crown": {"stages": ["crown_unit@cifar10-5"], "seconds": 3600.0, "status": "ok"},
        "certvit": {"stages": ["certvit_main"], "seconds": 60.0, "status": "failed in x"}}}
    pilot.project(record, "params.yaml", "params.yaml")
    crown = record["units"]["crown"]
    assert crown["calibration"] == 2.0 and crown["projected_hours"] == 20.0
    assert crown["estimated_hours"] == 10.0
    assert "projected_hours" not in record["units"]["certvit"]
    assert "| crown | crown_unit@cifar10-5 | ok | 60.0 |" in pilot.table(record)
