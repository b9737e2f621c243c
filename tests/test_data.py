"""Data stage library: the mirror route, torchvision loading, SST-2 parsing, samples (the text
datasets from the hub, Yelp and QQP, and the errors of the routes: test_data_text.py)."""

import time
from pathlib import Path

import pytest
import torch

from attncert import data


def _listing(folder: Path):
    return sorted((p.relative_to(folder), p.stat().st_size, p.stat().st_mtime_ns)
                  for p in folder.rglob("*"))


def test_mnist_from_mirror_through_torchvision(mirror, tmp_path):
    before = _listing(mirror / "MNIST")
    source = data.fetch_image("mnist", tmp_path / "raw", mirror, download=False)
    assert source.startswith("mirror ")
    assert _listing(mirror / "MNIST") == before, "the mirror must never be modified"
    obj = data.process_image("mnist", tmp_path / "raw", 300, 100, 0, source)
    assert obj["train"]["x"].shape == (300, 1, 28, 28) and obj["train"]["x"].dtype == torch.uint8
    assert obj["test"]["y"].shape == (100,)
    # the full-split statistics of MNIST are well known: mean 0.1307, std 0.3081
    full = data.process_image("mnist", tmp_path / "raw", 0, 0, 0, source)
    assert len(full["train"]["y"]) == 60000 and len(full["test"]["y"]) == 10000
    assert full["mean"][0] == pytest.approx(0.1307, abs=1e-3)
    assert full["std"][0] == pytest.approx(0.3081, abs=1e-3)
    assert torch.bincount(full["train"]["y"]).tolist()[:3] == [5923, 6742, 5958]
    # a second fetch reuses the raw copy
    assert data.fetch_image("mnist", tmp_path / "raw", None, download=False) == source


def test_subset_is_seeded_and_distinct():
    a = data.subset_indices(1000, 50, seed=3)
    assert torch.equal(a, data.subset_indices(1000, 50, seed=3))
    assert not torch.equal(a, data.subset_indices(1000, 50, seed=4))
    assert len(set(a.tolist())) == 50
    assert torch.equal(data.subset_indices(10, 0, 0), torch.arange(10))
    assert torch.equal(data.subset_indices(10, 20, 0), torch.arange(10))


def test_channel_stats():
    x = torch.zeros(4, 3, 2, 2, dtype=torch.uint8)
    x[:, 1] = 255
    x[:2, 2] = 255
    mean, std = data.channel_stats(x)
    assert mean == pytest.approx([0.0, 1.0, 0.5])
    assert std[0] == 0 and std[2] > 0


def test_sst2_reader_handles_both_column_orders(tmp_path):
    mirror_style = tmp_path / "a.tsv"
    mirror_style.write_text("label\tcontent\n1\ta fine , funny film .\n0\tdull\n")
    glue_style = tmp_path / "b.tsv"
    glue_style.write_text("sentence\tlabel\ta \"quoted\" line\t1\n".replace("\ta \"", "\na \""))
    glue_test = tmp_path / "c.tsv"
    glue_test.write_text("index\tsentence\n0\tno labels here\n")
    assert data.read_sst2_tsv(mirror_style) == {"text": ["a fine , funny film .", "dull"],
                                                "label": [1, 0]}
    assert data.read_sst2_tsv(glue_style) == {"text": ['a "quoted" line'], "label": [1]}
    assert data.read_sst2_tsv(glue_test) is None


def test_sst2_from_mirror(mirror, tmp_path):
    source = data.fetch_sst2(tmp_path / "raw", mirror, download=False)
    obj = data.process_sst2(tmp_path / "raw", 0, 0, 0, source)
    assert len(obj["train"]["y"]) == 67349 and len(obj["dev"]["y"]) == 872
    assert len(obj["test"]["y"]) == 1821 and obj["unlabelled_splits"] == []
    assert obj["dev"]["text"][0] == "one long string of cliches ."
    assert set(obj["train"]["y"].tolist()) == {0, 1}


def test_samples_from_mirror(mirror, tmp_path):
    cifar = data.load_sample("cifar10_sample", mirror, tmp_path)
    assert cifar["test"]["x"].shape == (20, 3, 32, 32)
    assert cifar["test"]["y"][:3].tolist() == [3, 8, 8]  # official CIFAR-10 test labels
    imnet = data.load_sample("imagenet_sample", mirror, tmp_path)
    assert imnet["test"]["x"].shape == (20, 3, 224, 224)
    assert imnet["classes"][int(imnet["test"]["y"][0])] == "bull mastiff"


def test_missing_data_names_both_routes(tmp_path, monkeypatch):
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(data.MIRROR_ENV, str(empty))

    def offline(*args, **kwargs):
        raise OSError("<urlopen error [Errno -2] Name or service not known>")

    monkeypatch.setattr("torchvision.datasets.utils.download_url", offline)
    t0 = time.perf_counter()
    for name in ("mnist", "cifar10", "svhn", "sst2"):
        with pytest.raises(data.DataUnavailable) as err:
            data.prepare([name], [], "unused", str(tmp_path / "raw"), str(tmp_path / "out"),
                         download=True, max_train=0, max_test=0, subset_seed=0, progress=False)
        msg = str(err.value)
        assert str(empty) in msg and "download failed" in msg and "Name or service" in msg
        assert data.MIRROR_ENV in msg and "data.download" in msg
    assert time.perf_counter() - t0 < 30
    assert not (tmp_path / "out").exists(), "nothing is written when a dataset is missing"


def test_missing_samples_are_explained(tmp_path):
    with pytest.raises(data.DataUnavailable, match="no public download route"):
        data.load_sample("imagenet_sample", tmp_path, tmp_path)
    with pytest.raises(data.DataUnavailable, match="add cifar10 to data.datasets"):
        data.load_sample("cifar10_sample", None, tmp_path)


def test_imagenet_validation_images_the_user_provides(tmp_path):
    """The ImageFolder layout of the 1000 WordNet ids under <raw_dir>/ImageNet/val: labels
    are the sorted ids' positions, images get the evaluation crop, a seeded subset is kept;
    a wrong layout or none is explained (and the data stage records it as skipped)."""
    from torchvision.io import write_png

    raw = tmp_path / "raw"
    val = raw / "ImageNet" / "val"
    wnids = [f"n{1440764 + 7 * k:08d}" for k in range(1000)]
    for w in wnids:
        (val / w).mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for k in (0, 3, 999):
        img = torch.randint(0, 256, (3, 300, 260), generator=g, dtype=torch.uint8)
        write_png(img, str(val / wnids[k] / f"ILSVRC2012_val_{k:08d}.png"))
    got = data.load_imagenet_val(None, raw, 0, 0)
    assert got["test"]["x"].shape == (3, 3, 224, 224) and got["test"]["x"].dtype == torch.uint8
    assert sorted(got["test"]["y"].tolist()) == [0, 3, 999] and len(got["classes"]) == 1000
    assert got["source"] == f"user-provided {val} (3 of 3 images)"
    sub = data.load_imagenet_val(None, raw, 2, 0)
    assert len(sub["test"]["y"]) == 2 and set(sub["test"]["y"].tolist()) <= {0, 3, 999}
    rows = data.prepare([], ["imagenet_val"], "", str(raw), str(tmp_path / "out"),
                        download=False, max_train=0, max_test=0, subset_seed=0,
                        imagenet_val_images=2, progress=False)
    assert {r["dataset"]: r for r in rows}["imagenet_val"]["n_test"] == 2
    (val / wnids[5]).rename(val / "extra")
    with pytest.raises(data.DataUnavailable, match="expected the 1000 WordNet ids"):
        data.load_imagenet_val(None, raw, 0, 0)
    with pytest.raises(data.DataUnavailable, match="no public download route"):
        data.load_imagenet_val(None, tmp_path / "elsewhere", 0, 0)


def test_a_stratified_subset_spreads_over_the_classes_in_a_mixed_order():
    from attncert.data.common import stratified_indices

    labels = [k % 10 for k in range(1000)]  # 100 images of each of 10 classes
    idx = stratified_indices(labels, 55, seed=3)
    assert len(set(idx.tolist())) == 55
    counts = torch.bincount(torch.tensor([labels[i] for i in idx]), minlength=10)
    assert counts.min() >= 5 and counts.sum() == 55
    assert len({labels[i] for i in idx[:10]}) > 3   # a prefix mixes the classes
    assert torch.equal(idx, stratified_indices(labels, 55, seed=3))
    assert sorted(stratified_indices(labels, 0, seed=3).tolist()) == list(range(1000))


def test_samples_without_a_route_are_skipped_and_recorded(mirror, tmp_path, monkeypatch):
    """A mirror with MNIST but neither sample: the stage writes MNIST and a record of each
    sample's skip; a stage asking for the images gets the reason, not a missing file."""
    partial = tmp_path / "mirror"
    partial.mkdir()
    (partial / "MNIST").symlink_to(mirror / "MNIST")
    monkeypatch.setenv(data.MIRROR_ENV, str(partial))
    out = tmp_path / "out"
    rows = data.prepare(["mnist"], ["cifar10_sample", "imagenet_sample"], "unused",
                        str(tmp_path / "raw"), str(out), download=False, max_train=10,
                        max_test=10, subset_seed=0, progress=False)
    by_name = {r["dataset"]: r for r in rows}
    assert set(by_name) == {"mnist", "cifar10_sample", "imagenet_sample", "imagenet_val"}
    assert by_name["imagenet_val"]["skipped"] == "not listed in data.samples"
    assert "skipped" not in by_name["mnist"] and by_name["mnist"]["n_train"] == 10
    assert "no public download route" in by_name["imagenet_sample"]["skipped"]
    assert "add cifar10 to data.datasets" in by_name["cifar10_sample"]["skipped"]
    for name in ("cifar10_sample", "imagenet_sample"):
        assert by_name[name]["source"] == f"skipped: {by_name[name]['skipped']}"
        assert data.sample_skipped(name, out) == by_name[name]["skipped"]
        with pytest.raises(data.DataUnavailable, match=f"{name}: skipped by the data stage"):
            data.load_processed(name, out)
    # a sample that is not requested is recorded as such; one from the mirror is available
    monkeypatch.setenv(data.MIRROR_ENV, str(mirror))
    rows = data.prepare(["mnist"], ["cifar10_sample"], "unused", str(tmp_path / "raw"),
                        str(out), download=False, max_train=10, max_test=10, subset_seed=0,
                        progress=False)
    by_name = {r["dataset"]: r for r in rows}
    assert data.sample_skipped("cifar10_sample", out) is None
    assert by_name["cifar10_sample"]["n_test"] == 20
    assert by_name["imagenet_sample"]["skipped"] == "not listed in data.samples"


def test_env_var_overrides_param(monkeypatch, tmp_path):
    monkeypatch.delenv(data.MIRROR_ENV, raising=False)
    assert data.resolve_mirror("some/dir") == Path("some/dir")
    assert data.resolve_mirror("") is None
    monkeypatch.setenv(data.MIRROR_ENV, str(tmp_path))
    assert data.resolve_mirror("some/dir") == tmp_path


def test_load_processed_explains_missing_stage(tmp_path):
    with pytest.raises(data.DataUnavailable, match="run the data stage"):
        data.load_processed("mnist", tmp_path)
