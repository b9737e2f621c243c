"""The hub models an offline run needs are listed from the params file and fetched."""

from pathlib import Path

import pytest

from attncert.pipeline import prefetch
from attncert.pipeline.profile import _base_text

ROOT = Path(__file__).resolve().parents[1]


def test_hub_ids_of_the_params_leave_keywords_and_folders_out(tmp_path):
    folder = tmp_path / "local-model"
    folder.mkdir()
    raw = {"specformer": {"sources": ["WinKawaks/vit-small-patch16-224", "scratch",
                                      "facebook/deit-tiny-patch16-224"]},
           "certvit": {"source": "pipeline", "imagenet": {"sources": ["tiny", str(folder),
                                                                      "google/vit-base-patch16-224"]}},
           "text": {"tokenizer": "minilm-package",
                    "frozen": {"source": "bert-base-uncased"}}}
    assert prefetch.hub_ids(raw) == ["WinKawaks/vit-small-patch16-224",
                                     "facebook/deit-tiny-patch16-224",
                                     "google/vit-base-patch16-224", "bert-base-uncased"]
    got = prefetch.prefetch(["a/b", "c"], download=lambda r: f"/cache/{r}")
    assert got == {"a/b": "/cache/a/b", "c": "/cache/c"}

    def offline(repo):
        raise ConnectionError("offline")

    with pytest.raises(RuntimeError, match="prefetch: a/b: ConnectionError"):
        prefetch.prefetch(["a/b"], download=offline)


def test_the_committed_params_name_their_hub_models():
    """Every hub id of the committed (paper) params is a string the prefetch lists."""
    from ruamel.yaml import YAML

    raw = YAML(typ="safe", pure=True).load(_base_text(ROOT))
    ids = prefetch.hub_ids(raw)
    assert ids == list(dict.fromkeys(ids)) and all(isinstance(i, str) and i for i in ids)
    sources = raw["specformer"]["sources"]
    assert [s for s in sources if s != "scratch"] == [i for i in ids if i in sources]
