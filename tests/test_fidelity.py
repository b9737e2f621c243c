"""The fidelity record (fidelity.yaml): well formed, params.yaml at every setting it marks
"same", every paper-claiming params.yaml comment covered, the docs page (with its summary) in
step with it."""

import re
from pathlib import Path

import pytest

from attncert.pipeline.params import read_yaml
from attncert.report import fidelity

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def record():
    return fidelity.load(ROOT / fidelity.FIDELITY_FILE)


@pytest.fixture(scope="module")
def params():
    return read_yaml(ROOT / "params.yaml")


def test_params_match_every_row_marked_same(record, params):
    assert fidelity.check_params(record, params) == []
    assert sum(s.status == "same" for s in record.settings) > 40


def test_every_paper_has_its_tables_and_figures(record):
    for paper in fidelity.PAPERS:
        ids = {i.id for i in record.items if i.paper == paper}
        assert any("/table1" in i for i in ids), paper
    ids = {i.id for i in record.items}
    # the items the reproductions rest on
    assert {"lofast/table1", "lofast/table2", "lofast/table3", "lofast/figure2", "olsa/table1",
            "olsa/table3", "olsa/table9", "specformer/table1", "specformer/table3",
            "specformer/table5", "certvit/table1", "certvit/table3"} <= ids


def test_a_departure_from_a_same_row_is_caught(record, params):
    import copy

    bad = copy.deepcopy(params)
    bad["specformer"]["msvp_lambda"] = [1e-5, 1e-5, 1e-5]
    bad["text"]["epochs"]["yelp_polarity"] = 50
    problems = fidelity.check_params(record, bad)
    assert any(p.startswith("specformer.msvp_lambda") for p in problems)
    assert any(p.startswith("text.epochs") for p in problems)
    del bad["vit"]["lofast_small"]["dim"]
    assert any("vit.lofast_small.dim: not a params.yaml key" in p
               for p in fidelity.check_params(record, bad))


@pytest.mark.parametrize("row, match", [
    ({"key": "x.y", "item": "lofast/table1", "paper": 1, "where": "Sec. 1", "status": "ok"},
     "status 'ok'"),
    ({"key": "x.y", "item": "lofast/table1", "paper": None, "where": "Sec. 1",
      "status": "same"}, "needs the paper's value"),
    ({"key": "x.y", "item": "lofast/table1", "paper": None, "where": "Sec. 1",
      "status": "not_stated"}, "'why' must be"),
    ({"key": "x.y", "item": "lofast/table9", "paper": 1, "where": "Sec. 1",
      "status": "same"}, "unknown items"),
    ({"key": "x.y", "item": "lofast/table1", "where": "Sec. 1", "status": "same"},
     "'paper' is missing"),
])
def test_malformed_rows_are_refused(row, match):
    item = {"id": "lofast/table1", "paper": "lofast", "what": "T1", "where": "Table 1",
            "stage": "crown", "status": "reproduced"}
    with pytest.raises(fidelity.FidelityError, match=match):
        fidelity.parse({"lofast": {"items": [item], "settings": [row]}})


def _claiming_keys(text: str) -> set[str]:
    """params.yaml keys whose own comment names a paper (a section header's comment excepted)."""
    keys, section = set(), None
    for line in text.splitlines():
        m = re.match(r"^([a-z_]+):", line)
        if m:
            section = m.group(1)
            continue
        m = re.match(r"^  ([a-z_0-9]+):[^#]*#(.*)$", line)
        if m and section and re.search(r"LoFAST|OLSA|SpecFormer|CertViT", m.group(2)):
            keys.add(f"{section}.{m.group(1)}")
    return keys


def test_every_key_whose_comment_names_a_paper_has_a_row(record):
    covered = {s.key for s in record.settings}
    covered |= {k.rsplit(".", 1)[0] for k in covered}  # a mapping's rows per entry
    missing = sorted(_claiming_keys((ROOT / "params.yaml").read_text()) - covered)
    assert not missing, f"params.yaml comments cite a paper for keys with no row: {missing}"


def test_docs_are_generated_from_the_record(record, params):
    """docs/fidelity.md, its summary included, is the record's rendering; README links it."""
    docs = (ROOT / fidelity.DOCS_FILE).read_text()
    assert docs == fidelity.render_docs(record, params), (
        "docs/fidelity.md is stale: run python -m attncert.report.fidelity docs")
    assert fidelity.render_summary(record) in docs
    assert f"({fidelity.DOCS_FILE})" in (ROOT / "README.md").read_text()


def test_no_row_cites_a_summary(record):
    for text in [i.where for i in record.items] + [s.where for s in record.settings]:
        assert "summary" not in text.lower(), text
