"""The pinned environment is described identically in requirements.txt and environment.yml."""

import re
from pathlib import Path

from attncert.pipeline.params import read_yaml

ROOT = Path(__file__).resolve().parents[1]


def _pins(lines):
    out = {}
    for line in lines:
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        name, _, version = line.partition("==")
        assert version, f"unpinned requirement: {line!r}"
        out[re.sub(r"[-_.]+", "-", name.strip()).lower()] = version.strip()
    return out


def test_requirements_and_environment_agree():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    env = read_yaml(ROOT / "environment.yml")
    deps = env["dependencies"]
    assert "python=3.11" in deps
    pip_block = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
    assert "-e ." in pip_block
    assert _pins(pip_block) == req


def test_nodeps_pins_are_listed_in_environment_yml():
    """conda cannot install without dependencies: environment.yml names the post-step and
    lists the same pins in its header."""
    nodeps = _pins((ROOT / "requirements-nodeps.txt").read_text().splitlines())
    text = (ROOT / "environment.yml").read_text()
    assert "pip install --no-deps -r requirements-nodeps.txt" in text
    header = [line.lstrip("# ").strip() for line in text.splitlines() if line.startswith("#   ")]
    assert _pins(h for h in header if "==" in h) == nodeps
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-deps -r requirements-nodeps.txt" in makefile


def test_torch_and_torchvision_pinned_together():
    req = _pins((ROOT / "requirements.txt").read_text().splitlines())
    assert req["torch"] == "2.13.0" and req["torchvision"] == "0.28.0"


def test_dvc_config_turns_off_analytics():
    text = (ROOT / ".dvc" / "config").read_text()
    assert "analytics = false" in text and "check_update = false" in text


def test_constraints_hold_the_dependencies_only():
    """constraints.txt pins what the requirements pull in, each at one exact version, and
    none of the packages the requirement files pin themselves; both install routes read it."""
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    locked = _pins(lines)
    assert len(locked) == len([x for x in lines if x.strip() and not x.startswith("#")])
    assert locked and all(v and "+" not in v and "*" not in v for v in locked.values())
    own = (_pins((ROOT / "requirements.txt").read_text().splitlines())
           | _pins((ROOT / "requirements-nodeps.txt").read_text().splitlines()))
    assert not set(locked) & set(own), sorted(set(locked) & set(own))
    assert "-c constraints.txt" in (ROOT / "requirements.txt").read_text().splitlines()
    pip_block = next(d["pip"] for d in read_yaml(ROOT / "environment.yml")["dependencies"]
                     if isinstance(d, dict) and "pip" in d)
    assert "-c constraints.txt" in pip_block
    assert "constraints.txt" in (ROOT / "Makefile").read_text().split(".installed:", 1)[1]
