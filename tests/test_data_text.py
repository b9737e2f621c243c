"""Data stage library: Yelp polarity and QQP through the hub's datasets (a stand-in mirror),
and each route's errors."""

import sys
from pathlib import Path

import pytest
import torch

from attncert import data

# ---------------------------------------------------------------------------- Yelp, QQP
YELP_TRAIN = ('"2","Great tacos, ""best"" in town.\\nWill return."\n'
              '"1","Cold food."\n'
              '"2","Friendly staff."\n')
YELP_TEST = '"1","Slow service,\\nrude waiter."\n"2","Loved it."\n'
QQP_HEADER = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
QQP_TRAIN = (QQP_HEADER + '0\t1\t2\tHow do I learn "Python"?\tHow to learn Python?\t1\n'
             "1\t3\t4\tWhy is the sky blue?\tHow tall is Everest?\t0\n")
QQP_DEV = QQP_HEADER + "7\t9\t10\tIs tea healthy?\tIs green tea good for you?\t1\n"
QQP_TEST = "id\tquestion1\tquestion2\n0\tno label here?\tnor here?\n"


def _stand_in_text_mirror(root: Path) -> Path:
    (root / "YelpPolarity").mkdir(parents=True)
    (root / "YelpPolarity" / "train.csv").write_text(YELP_TRAIN)
    (root / "YelpPolarity" / "test.csv").write_text(YELP_TEST)
    (root / "QQP").mkdir()
    for split, text in (("train", QQP_TRAIN), ("dev", QQP_DEV), ("test", QQP_TEST)):
        (root / "QQP" / f"{split}.tsv").write_text(text)
    return root


def test_yelp_and_qqp_from_a_stand_in_mirror(tmp_path, monkeypatch):
    mirror = _stand_in_text_mirror(tmp_path / "mirror")
    monkeypatch.setenv(data.MIRROR_ENV, str(mirror))
    out = tmp_path / "out"
    rows = data.prepare(["yelp_polarity", "qqp"], [], "unused", str(tmp_path / "raw"), str(out),
                        download=False, max_train=0, max_test=0, subset_seed=0, progress=False)
    by_name = {r["dataset"]: r for r in rows}
    assert by_name["yelp_polarity"]["source"] == f"mirror {mirror / 'YelpPolarity'}"
    assert (by_name["yelp_polarity"]["n_train"], by_name["yelp_polarity"]["n_test"]) == (3, 2)
    assert (by_name["qqp"]["n_train"], by_name["qqp"]["n_dev"]) == (2, 1)
    yelp = data.load_processed("yelp_polarity", out)
    assert yelp["kind"] == "text" and yelp["classes"] == ["negative", "positive"]
    assert yelp["train"]["text"][0] == 'Great tacos, "best" in town.\nWill return.'
    assert yelp["train"]["y"].tolist() == [1, 0, 1] and yelp["test"]["y"].tolist() == [0, 1]
    assert yelp["test"]["text"][0] == "Slow service,\nrude waiter."
    qqp = data.load_processed("qqp", out)
    assert qqp["train"]["text"] == ['How do I learn "Python"?', "Why is the sky blue?"]
    assert qqp["train"]["text_pair"][1] == "How tall is Everest?"
    assert qqp["train"]["y"].tolist() == [1, 0] and qqp["dev"]["y"].tolist() == [1]
    assert qqp["unlabelled_splits"] == ["test"] and "test" not in qqp
    assert qqp["classes"] == ["not_duplicate", "duplicate"]
    assert (mirror / "QQP" / "train.tsv").read_text() == QQP_TRAIN, "the mirror is untouched"
    # subsets are seeded, per split, like SST-2's
    sub = data.process_hub_text("yelp_polarity", tmp_path / "raw", 2, 1, 0, "x")
    assert len(sub["train"]["y"]) == 2 and len(sub["test"]["text"]) == 1


def test_imagenette_jpegs_become_the_evaluation_crop(tmp_path, monkeypatch):
    """Imagenette's folder of JPEGs (torchvision's class, its 320-pixel layout) from the
    mirror route: every image cropped to 224 x 224 uint8, labels in sorted-wnid order, class
    names the first synonym, a seeded subset of the training split decoded only."""
    from standins import write_imagenette

    mirror = tmp_path / "mirror"
    write_imagenette(mirror / "Imagenette" / "raw", per_class=2)
    monkeypatch.setenv(data.MIRROR_ENV, str(mirror))
    out = tmp_path / "out"
    rows = data.prepare(["imagenette"], [], "unused", str(tmp_path / "raw"), str(out),
                        download=False, max_train=7, max_test=0, subset_seed=0, progress=False)
    assert rows[0]["source"] == f"mirror {mirror / 'Imagenette' / 'raw'}"
    assert (rows[0]["n_train"], rows[0]["n_test"], rows[0]["shape"]) == (7, 20, "3x224x224")
    obj = data.load_processed("imagenette", out)
    assert obj["train"]["x"].dtype == torch.uint8
    assert obj["test"]["y"].tolist() == [k for k in range(10) for _ in range(2)]
    assert obj["classes"][0] == "tench" and len(obj["classes"]) == 10
    assert len(obj["mean"]) == 3 and all(0 < s < 0.5 for s in obj["std"])


def test_text_readers_refuse_malformed_rows(tmp_path):
    bad = tmp_path / "train.csv"
    bad.write_text('"2","fine"\n"5","a five-star label"\n')
    with pytest.raises(ValueError, match=r"train\.csv:2: expected"):
        data.read_yelp_csv(bad)
    tsv = tmp_path / "train.tsv"
    tsv.write_text(QQP_HEADER + "0\t1\t2\tq one?\tq two?\tmaybe\n")
    with pytest.raises(ValueError, match=r"train\.tsv:2: is_duplicate must be 0 or 1"):
        data.read_qqp_tsv(tsv)
    tsv.write_text("id\tquestion\tlabel\n")
    with pytest.raises(ValueError, match="no \\['question1', 'question2'\\] column"):
        data.read_qqp_tsv(tsv)


class _FakeHub:
    """Stands in for ``datasets.load_dataset``: records the call, returns rows per split."""

    SPLITS = {
        ("fancyzhx/yelp_polarity", None): {
            "train": [{"text": 'Two lines\nof "praise"', "label": 1}, {"text": "Meh.", "label": 0}],
            "test": [{"text": "Bad.", "label": 0}],
        },
        ("nyu-mll/glue", "qqp"): {
            "train": [{"question1": "A\tB?", "question2": "C\nD?", "label": 0, "idx": 0},
                      {"question1": "E?", "question2": "F?", "label": 1, "idx": 1}],
            "validation": [{"question1": "G?", "question2": "H?", "label": 1, "idx": 0}],
            "test": [{"question1": "I?", "question2": "J?", "label": -1, "idx": 0}],
        },
    }

    def __init__(self):
        self.calls = []

    def __call__(self, path, name=None, **kwargs):
        self.calls.append((path, name, kwargs))
        return self.SPLITS[(path, name)]


def test_download_route_goes_through_hf_datasets(tmp_path, monkeypatch):
    import datasets

    fake = _FakeHub()
    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.delenv(data.MIRROR_ENV, raising=False)
    raw, out = tmp_path / "raw", tmp_path / "out"
    rows = data.prepare(["yelp_polarity", "qqp"], [], "", str(raw), str(out), download=True,
                        max_train=0, max_test=0, subset_seed=0, progress=False)
    assert [(path, name) for path, name, _ in fake.calls] == [
        ("fancyzhx/yelp_polarity", None), ("nyu-mll/glue", "qqp")]
    assert all(str(raw) in kw["cache_dir"] for _, _, kw in fake.calls), "cache under raw_dir"
    by_name = {r["dataset"]: r for r in rows}
    assert by_name["yelp_polarity"]["source"] == (
        "download (Hugging Face datasets: fancyzhx/yelp_polarity)")
    assert by_name["qqp"]["source"] == "download (Hugging Face datasets: nyu-mll/glue qqp)"
    # written in the original layouts, read back by the mirror route's readers
    assert (raw / "YelpPolarity/raw/train.csv").read_text().startswith(
        '"2","Two lines\\nof ""praise"""\n')
    yelp = data.load_processed("yelp_polarity", out)
    assert yelp["train"]["text"] == ['Two lines\nof "praise"', "Meh."]
    assert yelp["train"]["y"].tolist() == [1, 0] and yelp["test"]["y"].tolist() == [0]
    qqp = data.load_processed("qqp", out)
    assert qqp["train"]["text"] == ["A B?", "E?"] and qqp["train"]["text_pair"] == ["C D?", "F?"]
    assert qqp["train"]["y"].tolist() == [0, 1] and qqp["dev"]["text"] == ["G?"]
    assert "test" not in qqp, "GLUE's QQP test split has no labels: not kept"
    # the raw copy is reused: no second download
    fake.calls.clear()
    data.prepare(["qqp"], [], "", str(raw), str(out), download=True, max_train=0, max_test=0,
                 subset_seed=0, progress=False)
    assert fake.calls == []


def test_optional_text_datasets_offline_are_skipped_and_recorded(mirror, tmp_path, monkeypatch):
    """No mirror folder and no network: Yelp and QQP are skipped with the reason; MNIST is
    processed; a stage asking for Yelp gets the reason. Not optional, the same fails fast."""
    import datasets

    def offline(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    partial = tmp_path / "mirror"
    partial.mkdir()
    (partial / "MNIST").symlink_to(mirror / "MNIST")
    monkeypatch.setenv(data.MIRROR_ENV, str(partial))
    out = tmp_path / "out"
    rows = data.prepare(["mnist", "yelp_polarity", "qqp"], [], "unused", str(tmp_path / "raw"),
                        str(out), download=True, max_train=10, max_test=10, subset_seed=0,
                        optional=["yelp_polarity", "qqp"], progress=False)
    by_name = {r["dataset"]: r for r in rows}
    assert by_name["mnist"]["n_train"] == 10 and "skipped" not in by_name["mnist"]
    for name in ("yelp_polarity", "qqp"):
        reason = by_name[name]["skipped"]
        assert "download failed" in reason and "Couldn't reach" in reason and str(partial) in reason
        assert "their original layout" in reason and data.MIRROR_ENV in reason
        assert by_name[name]["source"] == f"skipped: {reason}" and by_name[name]["kind"] == "text"
        assert data.dataset_skipped(name, out) == reason
        with pytest.raises(data.DataUnavailable, match=f"{name}: skipped by the data stage"):
            data.load_processed(name, out)
    assert data.dataset_skipped("mnist", out) is None
    # without the library the download route names it
    monkeypatch.setitem(sys.modules, "datasets", None)
    rows = data.prepare(["mnist"], [], "unused", str(tmp_path / "raw"), str(out), download=True,
                        max_train=10, max_test=10, subset_seed=0, optional=["qqp"],
                        progress=False)
    assert {r["dataset"]: r.get("skipped") for r in rows}["qqp"] == "not listed in data.datasets"
    with pytest.raises(data.DataUnavailable, match=r"qqp: .*(ModuleNotFoundError|ImportError)"):
        data.prepare(["qqp"], [], "unused", str(tmp_path / "raw"), str(tmp_path / "out2"),
                     download=True, max_train=0, max_test=0, subset_seed=0, progress=False)
    assert not (tmp_path / "out2").exists(), "a required dataset without a route writes nothing"


def test_text_lengths_count_both_sentences_of_a_pair():
    from attncert.figures import data as figs

    obj = {"classes": ["not_duplicate", "duplicate"],
           "train": {"text": ["how are you", "hi"], "text_pair": ["fine thanks", "hello there you"],
                     "y": torch.tensor([1, 0])},
           "dev": {"text": ["one two"], "y": torch.tensor([0])}}
    lengths = figs.sentence_lengths(obj)
    assert lengths["words"].tolist() == [5, 4, 2]
    assert lengths["label"].tolist() == ["duplicate", "not_duplicate", "not_duplicate"]


def test_a_transient_hub_error_is_retried_and_never_recorded_as_a_skip(tmp_path, monkeypatch):
    """Timeouts and server errors are retried; one that outlasts the retries fails the stage
    without a skip record; no route (offline, no library) is a skip at once."""
    import types

    from attncert.data import hub_text

    monkeypatch.setattr(hub_text, "RETRY_DELAYS", (0.0, 0.0))
    monkeypatch.setattr(hub_text.time, "sleep", lambda s: None)
    rows = [{"label": i % 2, "text": f"review {i}"} for i in range(6)]
    calls = []

    def flaky(fail_times, error):
        def load_dataset(*args, **kwargs):
            calls.append(args)
            if len(calls) <= fail_times:
                raise error
            return {"train": rows, "test": rows}
        return types.SimpleNamespace(load_dataset=load_dataset)

    monkeypatch.setitem(sys.modules, "datasets",
                        flaky(2, TimeoutError("Read timed out. (read timeout=10)")))
    source = hub_text.fetch_hub_text("yelp_polarity", tmp_path / "a", None, download=True)
    assert source.startswith("download") and len(calls) == 3
    calls.clear()
    monkeypatch.setitem(sys.modules, "datasets", flaky(9, OSError("502 Server Error")))
    with pytest.raises(hub_text.DownloadFailed, match="failed 3 times"):
        hub_text.fetch_hub_text("yelp_polarity", tmp_path / "b", None, download=True)
    out = tmp_path / "out"
    with pytest.raises(hub_text.DownloadFailed):  # an optional dataset too
        data.prepare(["yelp_polarity"], [], "", str(tmp_path / "c"), str(out), download=True,
                     max_train=0, max_test=0, subset_seed=0, optional=["yelp_polarity"],
                     progress=False)
    assert not (out / "yelp_polarity.pt").exists(), "a transient failure records no skip"
    calls.clear()
    monkeypatch.setitem(sys.modules, "datasets", flaky(9, ConnectionError(
        "Couldn't reach 'yelp_polarity' on the Hub (ConnectionError)")))
    with pytest.raises(data.DataUnavailable, match="Couldn't reach"):
        hub_text.fetch_hub_text("yelp_polarity", tmp_path / "d", None, download=True)
    assert len(calls) == 1  # no route: not retried


def _datasets_error(cause: BaseException, wrapped_in: type | None = None) -> ConnectionError:
    """The exception ``datasets.load_dataset`` raises when the hub call fails: ConnectionError
    "Couldn't reach '<name>' on the Hub (<class>)" raised from the hub library's error (itself,
    when ``wrapped_in`` is given, raised from ``cause``), as datasets/load.py does."""
    inner = cause
    if wrapped_in is not None:
        try:
            raise wrapped_in("An error happened while trying to locate the file on the Hub") \
                from cause
        except wrapped_in as e:
            inner = e
    try:
        raise ConnectionError(f"Couldn't reach 'yelp_polarity' on the Hub "
                              f"({type(inner).__name__})") from inner
    except ConnectionError as e:
        return e


def test_the_datasets_librarys_own_timeouts_are_transient_and_offline_is_no_route():
    """The shapes ``datasets`` really raises: a read timeout wrapped as "Couldn't reach ...
    (ReadTimeout)" (or around LocalEntryNotFoundError) is retried, not a skip; offline mode
    and a failed name lookup are no route."""
    import types

    from huggingface_hub import errors as hub_errors

    from attncert.data.hub_text import no_route

    # httpx's exception classes (names and messages as httpx raises them; httpx itself is not
    # a dependency here): none of them derives from the builtin TimeoutError
    httpx = types.SimpleNamespace(**{name: type(name, (Exception,), {}) for name in (
        "ReadTimeout", "ConnectTimeout", "RemoteProtocolError", "ConnectError")})

    timeout = httpx.ReadTimeout("The read operation timed out")
    assert not no_route(_datasets_error(timeout))
    assert not no_route(_datasets_error(timeout, hub_errors.LocalEntryNotFoundError))
    assert not no_route(_datasets_error(httpx.ConnectTimeout("timed out")))
    assert not no_route(_datasets_error(httpx.RemoteProtocolError(
        "Server disconnected without sending a response.")))
    assert no_route(_datasets_error(hub_errors.OfflineModeIsEnabled("Offline mode is enabled.")))
    assert no_route(_datasets_error(httpx.ConnectError("[Errno -2] Name or service not known"),
                                    hub_errors.LocalEntryNotFoundError))
    assert no_route(ModuleNotFoundError("No module named 'datasets'"))


def test_sst2_falls_back_to_hf_datasets_when_the_glue_archive_fails(tmp_path, monkeypatch):
    """GLUE's archive failing (after its retries) leads to GLUE's sst2 through ``datasets``,
    written as the archive's TSVs; with no route at all both failures are named."""
    import types

    import torchvision.datasets.utils as tv_utils

    from attncert.data import hub_text

    monkeypatch.setattr(hub_text, "RETRY_DELAYS", (0.0,))
    monkeypatch.setattr(hub_text.time, "sleep", lambda s: None)
    archive_calls = []

    def archive_down(url, download_root):
        archive_calls.append(url)
        raise OSError("HTTP Error 503: Service Unavailable")

    monkeypatch.setattr(tv_utils, "download_and_extract_archive", archive_down)
    rows = {"train": [{"sentence": "a fine\tfilm", "label": 1, "idx": 0},
                      {"sentence": "dull", "label": 0, "idx": 1}],
            "validation": [{"sentence": "great", "label": 1, "idx": 0}],
            "test": [{"sentence": "?", "label": -1, "idx": 0}]}
    hub_calls = []

    def load_dataset(path, name=None, **kwargs):
        hub_calls.append((path, name))
        return rows

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    source = data.fetch_sst2(tmp_path / "raw", None, download=True)
    assert len(archive_calls) == 2 and hub_calls == [("nyu-mll/glue", "sst2")]
    assert source == "download (Hugging Face datasets: nyu-mll/glue sst2)"
    obj = data.process_sst2(tmp_path / "raw", 0, 0, 0, source)
    assert obj["train"]["text"] == ["a fine film", "dull"] and obj["dev"]["y"].tolist() == [1]

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub")

    monkeypatch.setattr(tv_utils, "download_and_extract_archive", lambda url, download_root: (
        _ for _ in ()).throw(OSError("[Errno -3] Temporary failure in name resolution")))
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(data.DataUnavailable, match=r"GLUE archive: .*name resolution.*"
                                                   r"Hugging Face datasets: .*Couldn't reach"):
        data.fetch_sst2(tmp_path / "raw2", None, download=True)
