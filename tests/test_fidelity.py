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


def test_a_deviates_row_whose_departure_is_gone_is_caught(record, params):
    """A row marked deviates whose params value became the paper's must become same (unless
    the number means something else here: meaning_differs)."""
    import copy

    row = next(s for s in record.settings if s.status == "deviates" and not s.meaning_differs
               and isinstance(s.expected, (int, float, str)) and not isinstance(s.expected, bool))
    bad = copy.deepcopy(params)
    node = bad
    *parents, leaf = row.key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = row.expected
    assert fidelity.check_params(record, params) == []
    problems = fidelity.check_params(record, bad)
    assert len(problems) == 1 and problems[0].startswith(row.key) and "mark it same" in problems[0]
    assert any(s.meaning_differs for s in record.settings)  # those pass with the paper's number


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
    ({"key": "x.y", "item": "lofast/table1", "paper": 1, "where": "Sec. 1", "status": "same",
      "meaning_differs": True}, "only on a 'deviates' row"),
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


def _comment_chains(text: str) -> dict[str, str]:
    """params.yaml key (dotted, nested keys too) -> its own comment (continuation lines
    included) and every ancestor's; a key of a flow mapping gets its line's comment."""
    own, stack, last = {}, [], None
    for line in text.splitlines():
        if not line.strip():
            continue
        if line.lstrip().startswith("#"):
            if last is not None and line.startswith(" "):
                own[last] += " " + line.strip()
            continue
        m = re.match(r"^(\s*)([A-Za-z_0-9]+):(.*)$", line)
        if not m:
            continue
        while stack and stack[-1][0] >= len(m.group(1)):
            stack.pop()
        stack.append((len(m.group(1)), m.group(2)))
        last = ".".join(k for _, k in stack)
        own[last] = m.group(3).split("#", 1)[1] if "#" in m.group(3) else ""
    return {k: " ".join(own.get(".".join(k.split(".")[:i]), "")
                        for i in range(1, k.count(".") + 2)) for k in own}


def _chain(chains: dict[str, str], key: str) -> str:
    while key not in chains and "." in key:  # a flow mapping's entry: its line's comment
        key = key.rsplit(".", 1)[0]
    return chains.get(key, "")


def test_every_key_no_paper_states_says_ours(record):
    """The header's promise: "ours" marks every value no paper states, on the key's comment
    or an enclosing key's."""
    chains = _comment_chains((ROOT / "params.yaml").read_text())
    missing = sorted({s.key for s in record.settings if s.status == "not_stated"
                      and "ours" not in _chain(chains, s.key)})
    assert not missing, f"params.yaml: not_stated keys without 'ours' in their comment: {missing}"


def test_a_not_stated_key_without_ours_is_caught(record):
    row = next(s for s in record.settings if s.status == "not_stated")
    text = (ROOT / "params.yaml").read_text()
    chains = _comment_chains(text.replace("ours", "o-u-r-s"))
    assert "ours" not in _chain(chains, row.key)
