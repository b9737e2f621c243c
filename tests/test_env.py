"""The pinned environment is described identically in requirements.txt and environment.yml."""

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
        out[name.lower().replace("_", "-")] = version
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
