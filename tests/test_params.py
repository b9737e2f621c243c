"""params.yaml schema: YAML 1.2 types, unknown keys, wrong types, invalid values, profiles."""

import dataclasses
import shutil
from pathlib import Path

import pytest
from helpers import set_key

from attncert.pipeline import profile
from attncert.pipeline.params import ParamsError, read_yaml
from attncert.pipeline.shapes import VitShape
from attncert.stages.registry import load_params, validate

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def raw():
    return read_yaml(ROOT / "params.yaml")


def test_committed_params_are_valid_paper_scale():
    p = load_params(ROOT / "params.yaml")
    assert p["base"].scale == "paper"
    assert set(p["data"].datasets) == {"mnist", "fashion_mnist", "cifar10", "cifar100", "svhn",
                                       "imagenette", "sst2", "yelp_polarity", "qqp"}
    assert set(p["data"].optional) == {"yelp_polarity", "qqp"}  # offline: skipped, recorded


def test_yaml_12_semantics(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text("a: 1e-3\nb: yes\nc: 0o17\nd: 017\n")
    data = read_yaml(f)
    assert data["a"] == pytest.approx(1e-3) and isinstance(data["a"], float)
    assert data["b"] == "yes"  # YAML 1.1 would make this True
    assert data["c"] == 15 and data["d"] == 17


@pytest.mark.parametrize(
    "section,key,value,match",
    [
        ("data", "max_train", "1000", r"^data\.max_train: expected int, got str"),
        ("data", "max_train", -5, r"^data\.max_train: must be >= 0"),
        ("data", "download", "yes", r"^data\.download: expected true/false"),
        ("data", "datasets", ["mnist", "tinyimagenet"],
         r"^data\.datasets: unknown value 'tinyimagenet'"),
        ("data", "datasets", "mnist", r"^data\.datasets: expected a list"),
        ("data", "datasets", ["mnist", "mnist"], r"duplicate"),
        ("data", "optional", ["yelp"], r"^data\.optional: unknown value 'yelp'"),
        ("base", "device", "gpu", r"^base\.device: unknown device 'gpu'"),
        ("base", "scale", "huge", r"^base\.scale: unknown value 'huge'"),
        ("base", "seed", 1.5, r"^base\.seed: expected int, got float"),
        ("base", "seed", True, r"^base\.seed: expected int, got bool"),
        ("text", "olsa.residual", "gate", r"^text\.olsa\.residual: unknown value 'gate'"),
        ("text", "olsa.residual_init", 1.0, r"^text\.olsa: residual_init must be in \(0, 1\)"),
        ("text", "olsa.residual_init", 0.0, r"^text\.olsa: residual_init must be in \(0, 1\)"),
        ("text", "olsa.alpha1", 0.0, r"^text\.olsa\.alpha1: must be > 0"),
        ("text", "lofast.dim", 10, r"^text\.lofast: dim 10 is not divisible by 4 heads"),
        ("vit", "lofast_small.heads", 3,
         r"^vit\.lofast_small: dim = 128 is not divisible by heads = 3"),
        ("vit", "lofast.patch", 0, r"^vit\.lofast\.patch: must be > 0"),
        ("vit_grid", "heads", [4, 7],
         r"^vit_grid\.heads: 7 heads do not split train_vit's shape's dim = 384"),
        ("frontier", "heads", 5, r"^frontier\.heads: 5 heads do not split"),
        ("vit", "lofast_small.depth", 0, r"^vit\.lofast_small\.depth: must be > 0"),
        ("crown", "vit", "lofast_smal",
         r"^crown\.vit: 'lofast_smal' is not a shape of the vit section \(did you mean "
         r"'lofast_small'\?\); known: lofast, "),
        ("crown", "vit", {"patch": 16},
         r"^crown\.vit: expected the name of a shape of the vit section"),
        ("specformer", "certified.vit", "lofast",
         r"^specformer\.certified\.vit: the shape it names has depth: null; this stage "
         r"needs a depth"),
        ("certvit", "vit", "lofast", r"^certvit\.vit: the shape it names has depth: null"),
        ("certvit", "table1.vit", {"mnist": "certvit_mnist"},
         r"^certvit\.table1: vit needs an entry for \['cifar10', 'cifar100'\]"),
        ("certvit", "table1.vit", {"mnist": "certvit_mnist", "cifar10": "lofast",
                                   "cifar100": "certvit_cifar100"},
         r"^certvit\.table1\.vit\.cifar10: the shape it names has depth: null"),
        ("crown", "datasets", ["cifar10", "sst2"],
         r"^crown\.datasets: 'sst2' is not an image dataset; choose from mnist, "),
        ("crown", "datasets", ["svhn", "sst2"],
         r"^crown\.datasets: 'sst2' is not an image dataset"),
        ("crown", "datasets", [], r"^crown\.datasets: needs at least one entry"),
        ("crown", "datasets", ["svhn", "svhn"], r"^crown\.datasets: has duplicate entries"),
        ("crown", "datasets", "cifar10", r"^crown\.datasets: expected a list"),
        ("specformer", "sources", [], r"^specformer\.sources: needs at least one entry"),
        ("specformer", "sources", "scratch", r"^specformer\.sources: expected a list"),
        ("specformer", "image_size", 0, r"^specformer\.image_size: must be > 0"),
        ("specformer", "methods", ["vanilla", "lipsformer"],
         r"^specformer\.methods: the pre-trained weights of 'WinKawaks/vit-small-patch16-224' "
         r"do not fit lipsformer \(the baselines change"),
        ("specformer", "adv_methods", ["l2former"],
         r"^specformer\.adv_methods: the pre-trained weights .* do not fit l2former"),
    ],
)
def test_invalid_values_name_the_key(raw, section, key, value, match):
    set_key(raw, section, key, value)
    with pytest.raises(ParamsError, match=match) as err:
        validate(raw)
    assert "\n" not in str(err.value)


def test_unknown_and_missing_keys(raw):
    raw["data"]["max_trian"] = 3
    msg = r"data\.max_trian: unknown parameter \(did you mean 'max_train'"
    with pytest.raises(ParamsError, match=msg):
        validate(raw)
    del raw["data"]["max_trian"]
    del raw["data"]["subset_seed"]
    with pytest.raises(ParamsError, match=r"data\.subset_seed: missing"):
        validate(raw)


def test_a_key_of_the_old_layout_names_its_new_place(raw):
    """A ViT shape lives in the vit section; a stage names it (one-line error for the old keys)."""
    raw["crown"]["dim"] = 128
    with pytest.raises(ParamsError, match=r"^crown\.dim: renamed: the key is now crown\.vit "
                                          r"\(the name of a shape of the vit section"):
        validate(raw)
    del raw["crown"]["dim"]
    raw["certvit"]["table1"]["grid"] = {"mnist": 4}
    with pytest.raises(ParamsError, match=r"^certvit\.table1\.grid: renamed: the key is now "
                                          r"certvit\.table1\.vit"):
        validate(raw)


def test_stages_share_a_named_shape(raw):
    """crown and the certified pair name one shape at the paper scale: one edit moves both."""
    p = validate(raw)
    assert p["crown"].vit is p["specformer"].certified.vit is p["vit"]["lofast_small"]
    raw["vit"]["lofast_small"]["dim"] = 64
    p = validate(raw)
    assert p["crown"].vit.dim == p["specformer"].certified.vit.dim == 64
    assert p.fields("vit")["lofast_small"]["dim"] == 64
    # a grid stage's shape leaves depth and heads to its grid; arch() takes them
    assert p["train_vit"].vit.depth is None
    assert p["train_vit"].vit.arch(depth=2, heads=4)["dim"] == 384
    with pytest.raises(ParamsError, match="depth is null"):
        p["train_vit"].vit.arch(heads=4)


def test_unknown_section(raw):
    raw["dat"] = {}
    with pytest.raises(ParamsError, match=r"^dat: unknown section \(did you mean 'data'"):
        validate(raw)


def test_float_fields_accept_ints(raw):
    # YAML `1` where a float is declared is widened, never a type error
    from attncert.pipeline.params import BaseParams, _check_type

    assert BaseParams is not None
    assert _check_type("k", 1, float) == 1.0 and isinstance(_check_type("k", 1, float), float)
    assert _check_type("k", [1, 0.5], list[float]) == [1.0, 0.5]
    with pytest.raises(ParamsError, match="expected float, got str"):
        _check_type("k", "1e-3", float)


@pytest.fixture
def project_copy(tmp_path):
    """params.yaml and profiles/ outside git: the working copy is the base."""
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    shutil.copytree(ROOT / "profiles", tmp_path / "profiles")
    return tmp_path


@pytest.mark.parametrize("name", ["cpu", "smoke"])
def test_profiles_apply_and_validate(project_copy, name):
    before = (project_copy / "params.yaml").read_text()
    changes = profile.apply(name, project_copy)
    after = load_params(project_copy / "params.yaml")
    assert after["base"].scale == name
    assert changes, "a profile must change something"
    assert "# attncert parameters" in (project_copy / "params.yaml").read_text()  # comments kept
    for key, (_, new) in changes.items():
        section, *path = key.split(".")  # a group's field or a mapping param's entry
        value = after[section]
        for part in path:
            value = getattr(value, part) if dataclasses.is_dataclass(value) else value[part]
        if isinstance(value, VitShape):  # a stage's vit key: the shape of that name
            new = after["vit"][new]
        assert value == new
    # a profile is applied to the paper base, so re-applying never stacks
    with pytest.raises(ParamsError, match="not in git"):
        profile.apply("paper", project_copy)
    (project_copy / "params.yaml").write_text(before)


def test_profile_with_unknown_key_is_rejected(project_copy):
    (project_copy / "profiles" / "bad.yaml").write_text("data:\n  max_trian: 3\n")
    with pytest.raises(ParamsError, match=r"data\.max_trian: profile 'bad' sets a key"):
        profile.apply("bad", project_copy)
    with pytest.raises(ParamsError, match="unknown profile"):
        profile.apply("nope", project_copy)


def test_profile_with_invalid_value_is_rejected_before_writing(project_copy):
    (project_copy / "profiles" / "bad.yaml").write_text("data:\n  max_train: -1\n")
    before = (project_copy / "params.yaml").read_text()
    with pytest.raises(ParamsError, match=r"data\.max_train: must be >= 0"):
        profile.apply("bad", project_copy)
    assert (project_copy / "params.yaml").read_text() == before


def test_specformer_baselines_run_from_scratch(raw):
    """The attention-swapping baselines are valid with the from-scratch source only."""
    raw["specformer"]["sources"] = ["scratch"]
    raw["specformer"]["methods"] = ["vanilla", "specformer", "l2former", "lnformer", "lipsformer"]
    assert validate(raw)["specformer"].methods[-1] == "lipsformer"
    raw["specformer"]["sources"] = ["scratch", "some/model"]
    msg = r"weights of 'some/model' do not fit l2former, lnformer, lipsformer"
    with pytest.raises(ParamsError, match=msg):
        validate(raw)
