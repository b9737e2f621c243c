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
      "status": "borrowed", "why": "elsewhere"}, "needs the paper's value"),
    ({"key": "x.y", "item": "lofast/table1", "paper": 1, "where": "Sec. 1",
      "status": "borrowed"}, "'why' must be"),
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


PAPER_NAMES = re.compile(r"LoFAST|OLSA|SpecFormer|CertViT")


def _claiming_keys(text: str) -> set[str]:
    """params.yaml keys, nested ones too, whose own comment names a paper (a section's own
    comment excepted: it introduces its keys)."""
    return {k for k, c in _own_comments(text).items() if "." in k and PAPER_NAMES.search(c)}


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


def _own_comments(text: str) -> dict[str, str]:
    """params.yaml key (dotted, nested keys too) -> its own comment, with the comment lines
    below it indented deeper than the key (a comment line at the key's own indentation opens
    the next key's block and belongs to no key)."""
    own, stack, last, depth = {}, [], None, 0
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if line.lstrip().startswith("#"):
            if last is not None and indent > depth:
                own[last] += " " + line.strip()
            else:
                last = None
            continue
        m = re.match(r"^(\s*)([A-Za-z_0-9]+):(.*)$", line)
        if not m:
            continue
        while stack and stack[-1][0] >= len(m.group(1)):
            stack.pop()
        stack.append((len(m.group(1)), m.group(2)))
        last, depth = ".".join(k for _, k in stack), len(m.group(1))
        own[last] = m.group(3).split("#", 1)[1] if "#" in m.group(3) else ""
    return own


def _comment_chains(text: str) -> dict[str, str]:
    """params.yaml key -> its own comment (:func:`_own_comments`) and every ancestor's; a key
    of a flow mapping gets its line's comment."""
    own = _own_comments(text)
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


def _same_called_ours(record, text: str) -> list[str]:
    """Keys whose row reproduces the paper's value while their own comment calls the value
    ours, unless another paper's row of the key states nothing (text.max_len: LoFAST's 32,
    none in OLSA)."""
    own = _own_comments(text)
    ours_too = {s.key for s in record.settings if s.status != "same"}
    return sorted(s.key for s in record.settings if s.status == "same"
                  and s.key not in ours_too and re.search(r"\bours\b", own.get(s.key, "")))


def test_a_same_row_is_not_called_ours(record):
    """The comment and the record must not contradict each other; a planted one is caught."""
    text = (ROOT / "params.yaml").read_text()
    assert _same_called_ours(record, text) == []
    row = next(s for s in record.settings if s.status == "same" and s.key.count(".") == 1
               and not any(o.key == s.key and o.status != "same" for o in record.settings))
    key = row.key.split(".")[1]  # every section's `key:` line now says ours, this one's too
    planted = re.sub(rf"(?m)^(  {key}:[^#\n]*)(#.*)?$", r"\1# ours", text)
    assert row.key in _same_called_ours(record, planted)


def test_comment_scans_catch_planted_contradictions():
    """The scans above read nested keys and continuation lines, and nothing else."""
    text = ("a:                 # section comment naming LoFAST\n"
            "  b: 1             # LoFAST Table 1\n"
            "  c:\n"
            "    d: 2           # plain,\n"
            "                   # then OLSA sec. 5 (continued)\n"
            "  # a block comment naming CertViT belongs to no key\n"
            "  e: 3\n")
    assert _claiming_keys(text) == {"a.b", "a.c.d"}
    own = _own_comments(text)
    assert "CertViT" not in own["a.c.d"] and "OLSA" in own["a.c.d"] and own["a.e"] == ""
    assert "section comment" in _comment_chains(text)["a.c.d"]


@pytest.fixture(scope="module")
def dvc_stages():
    return read_yaml(ROOT / "dvc.yaml")["stages"]


def test_every_same_row_is_read_by_its_items_stage(record, dvc_stages):
    """A row marked same reproduces a setting a stage runs: the stage of its item reads the key
    (dvc.yaml params or matrix); the paper's value used elsewhere is 'borrowed'."""
    assert fidelity.check_stages(record, dvc_stages) == []
    assert any(s.status == "borrowed" for s in record.settings)


def _planted(record, **changes):
    import dataclasses

    return dataclasses.replace(record, **changes)


def test_a_same_row_no_stage_runs_is_caught(record, dvc_stages):
    import dataclasses

    row = next(s for s in record.settings if s.status == "borrowed")
    same = dataclasses.replace(row, status="same")
    problems = fidelity.check_stages(_planted(record, settings=[*record.settings, same]),
                                     dvc_stages)
    assert len(problems) == 1 and "does not read it" in problems[0]
    item = record.item(same.item)
    no_stage = [dataclasses.replace(i, stage=None) if i.id == item.id else i
                for i in record.items]
    problems = fidelity.check_stages(_planted(record, items=no_stage), dvc_stages)
    assert any("which no stage reproduces" in p for p in problems)
    renamed = [dataclasses.replace(i, stage="no_such_stage") if i.id == item.id else i
               for i in record.items]
    problems = fidelity.check_stages(_planted(record, items=renamed), dvc_stages)
    assert f"{item.id}: stage 'no_such_stage' names no dvc.yaml stage" in problems
    lost = next(i for i in record.items if i.status == "not_reproduced")
    staged = [dataclasses.replace(i, stage=item.stage) if i.id == lost.id else i
              for i in record.items]
    problems = fidelity.check_stages(_planted(record, items=staged), dvc_stages)
    assert problems == [f"{lost.id}: not reproduced, yet names stage {item.stage!r}"]


def test_a_borrowed_row_is_held_like_same(record, params):
    import copy

    row = next(s for s in record.settings if s.status == "borrowed")
    bad = copy.deepcopy(params)
    node = bad
    *parents, leaf = row.key.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = "something else"
    problems = fidelity.check_params(record, bad)
    assert len(problems) == 1 and "marked borrowed" in problems[0]


def test_a_key_given_twice_for_one_item_is_refused():
    item = {"id": "lofast/table1", "paper": "lofast", "what": "T1", "where": "Table 1",
            "stage": "crown", "status": "reproduced"}
    row = {"key": "x.y", "item": "lofast/table1", "paper": 1, "where": "Sec. 1",
           "status": "same"}
    with pytest.raises(fidelity.FidelityError, match="given twice for one item"):
        fidelity.parse({"lofast": {"items": [item], "settings": [row, dict(row)]}})
