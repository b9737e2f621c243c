"""Scale profiles never discard edits: through `make pipeline SCALE=...` in a git checkout."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attncert.pipeline import profile
from attncert.pipeline.params import ParamsError
from attncert.stages.registry import load_params

ROOT = Path(__file__).resolve().parents[1]
FILES = ("Makefile", "params.yaml", "dvc.yaml", "profiles", ".dvc/config", ".dvcignore",
         ".gitignore")


@pytest.fixture
def project(tmp_path, venv_env):
    """The pipeline's definition files in a fresh git repository (committed: paper scale)."""
    repo = tmp_path / "repo"
    for rel in FILES:
        src, dst = ROOT / rel, repo / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-qm", "snapshot"], cwd=repo, check=True)
    return repo


def _make(repo: Path, env: dict, tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`make pipeline ...` with this interpreter's environment (never reinstalled: -o) and a
    stand-in for dvc that records the params.yaml `dvc repro` would have run on."""
    fake = tmp_path / "fake-dvc"
    fake.write_text('#!/bin/sh\ncp params.yaml "$0.params"\necho "dvc $*"\n')
    fake.chmod(0o755)
    venv = Path(sys.prefix)
    env = dict(env, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")]))
    return subprocess.run(["make", "-o", f"{venv}/.installed", "pipeline", f"VENV={venv}",
                           f"DVC={fake}", *args], cwd=repo, env=env, capture_output=True,
                          text=True, timeout=300)


def _edit(repo: Path, section: str, key: str, value: str) -> None:
    """Set ``section.key`` in params.yaml by text, as a person would (the first ``key`` after
    the section's line: ``train_vit``'s ``epochs`` is ``train_vit.train.epochs``)."""
    path = repo / "params.yaml"
    text = path.read_text()
    start = text.index(f"\n{section}:")
    m = re.compile(rf"^( +{key}: *)[^#\n]*?( *(#.*)?)$", re.M).search(text, start)
    path.write_text(text[:m.start()] + m.group(1) + value + m.group(2) + text[m.end():])


def test_an_edit_survives_make_pipeline_scale_paper(project, venv_env, tmp_path):
    _edit(project, "train_vit", "epochs", "50")
    proc = _make(project, venv_env, tmp_path, "SCALE=paper")
    assert proc.returncode == 0, proc.stderr
    assert "1 edit(s) kept: train_vit.train.epochs" in proc.stdout and "dvc repro" in proc.stdout
    ran = load_params(tmp_path / "fake-dvc.params")  # what `dvc repro` ran on
    assert ran["train_vit"].train.epochs == 50 and ran["base"].scale == "paper"
    assert load_params(project / "params.yaml")["train_vit"].train.epochs == 50
    assert "# attncert parameters" in (project / "params.yaml").read_text()  # comments kept
    diff = subprocess.run(["dvc", "params", "diff"], cwd=project, env=venv_env,
                          capture_output=True, text=True, check=True).stdout
    assert re.search(r"train_vit\.train\.epochs\s+100\s+50", diff), diff


def test_scale_changes_keep_edits_and_refuse_scale_dependent_ones(project, venv_env, tmp_path):
    # a key no profile sets is carried across scales: paper -> cpu -> paper -> smoke
    _edit(project, "tightness", "input_radius", "2.0")
    for scale in ("cpu", "paper", "smoke"):
        proc = _make(project, venv_env, tmp_path, f"SCALE={scale}")
        assert proc.returncode == 0, proc.stderr
        p = load_params(project / "params.yaml")
        assert p["base"].scale == scale and p["tightness"].input_radius == 2.0
    # smoke sets train_vit.train.epochs: an edit of it is kept while the scale stays ...
    _edit(project, "train_vit", "epochs", "3")
    assert _make(project, venv_env, tmp_path, "SCALE=smoke").returncode == 0
    assert load_params(project / "params.yaml")["train_vit"].train.epochs == 3
    # ... and refused, with the key named on one line, when the scale changes
    before = (project / "params.yaml").read_text()
    (tmp_path / "fake-dvc.params").unlink()
    proc = _make(project, venv_env, tmp_path, "SCALE=cpu")
    assert proc.returncode != 0 and not (tmp_path / "fake-dvc.params").exists(), "no dvc repro"
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("profile: error:")]
    assert "train_vit.train.epochs=3" in line and "KEEP_EDITS=1" in line
    assert "input_radius" not in line, "an edit of a key no profile sets is no conflict"
    assert (project / "params.yaml").read_text() == before, "nothing is written on refusal"
    # KEEP_EDITS=1 carries it over as it is
    proc = _make(project, venv_env, tmp_path, "SCALE=cpu", "KEEP_EDITS=1")
    assert proc.returncode == 0, proc.stderr
    p = load_params(project / "params.yaml")
    assert (p["base"].scale, p["train_vit"].train.epochs, p["tightness"].input_radius) == (
        "cpu", 3, 2.0)
    assert p["train_vit"].vit.patch == 14, "the cpu profile's own values are applied"
    # undoing the edit (the cpu value) lets the scale change again without a flag
    _edit(project, "train_vit", "epochs", "6")
    assert _make(project, venv_env, tmp_path, "SCALE=paper").returncode == 0
    p = load_params(project / "params.yaml")
    assert (p["train_vit"].train.epochs, p["tightness"].input_radius) == (100, 2.0)


def test_added_keys_are_refused_not_dropped(project):
    path = project / "params.yaml"
    path.write_text(path.read_text().replace("\ndata:\n", "\ndata:\n  new_key: 1\n", 1))
    with pytest.raises(ParamsError, match=r"added: \['data.new_key'\]"):
        profile.apply("cpu", project)


def test_a_changed_profile_is_picked_up_not_kept_as_an_edit(project):
    profile.apply("cpu", project)
    cpu = project / "profiles" / "cpu.yaml"
    cpu.write_text(cpu.read_text().replace("    epochs: 6\n", "    epochs: 8\n", 1))
    _edit(project, "tightness", "input_radius", "2.0")
    profile.apply("cpu", project)
    p = load_params(project / "params.yaml")
    assert (p["train_vit"].train.epochs, p["tightness"].input_radius) == (8, 2.0)
    assert profile.edits(project)[1] == {"tightness.input_radius": 2.0}
