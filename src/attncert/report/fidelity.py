"""The fidelity record: how the paper scale relates to each table and figure of the four papers.

``fidelity.yaml`` (beside ``params.yaml``) holds, per paper:

- ``items``: every table and figure of the paper, where the text states it, the stage that
  reproduces it (or none) and a status: ``reproduced`` | ``partly`` | ``not_reproduced``, with
  ``why`` unless reproduced;
- ``settings``: every ``params.yaml`` key that reproduces (or claims) a paper setting: the
  paper's value, where the text states it, and a status: ``same`` (params.yaml runs exactly the
  paper's value: :func:`check_params` fails otherwise, and the item's stage reads the key) |
  ``borrowed`` (the paper's value, checked as ``same``, in a setting no paper runs: counted
  apart, never as reproducing the paper) | ``deviates`` | ``not_stated`` (ours) |
  ``not_reproduced``, with ``why`` unless same; a key has at most one row per item.
  ``params_value`` gives the params spelling of the paper's value where the two differ in form
  (``null`` for the paper's sqrt(d)).

Our value is never written in the record: it is read from ``params.yaml`` when the record is
rendered (``docs/fidelity.md``, with its summary) or checked, so the two cannot drift.

    python -m attncert.report.fidelity check       # the record's schema and every "same" row
    python -m attncert.report.fidelity docs        # rewrite docs/fidelity.md (its summary too)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIDELITY_FILE = "fidelity.yaml"
DOCS_FILE = "docs/fidelity.md"
PAPERS = {"lofast": "LoFAST", "olsa": "OLSA", "specformer": "SpecFormer", "certvit": "CertViT"}
ITEM_STATUS = ("reproduced", "partly", "not_reproduced")
SETTING_STATUS = ("same", "borrowed", "deviates", "not_stated", "not_reproduced")
#: a row whose value params.yaml must hold
HOLDS_PAPER_VALUE = ("same", "borrowed")
_UNSET = object()


class FidelityError(ValueError):
    """The record is malformed, or params.yaml departs from a row marked "same"."""


@dataclass(frozen=True)
class Item:
    id: str
    paper: str
    what: str
    where: str
    stage: str | None
    status: str
    why: str


@dataclass(frozen=True)
class Setting:
    key: str
    item: str
    paper: Any
    where: str
    status: str
    why: str
    params_value: Any = _UNSET
    #: a "deviates" row whose value is the paper's number with another meaning (a unit)
    meaning_differs: bool = False

    @property
    def expected(self) -> Any:
        """The value params.yaml must hold for a "same" row."""
        return self.paper if self.params_value is _UNSET else self.params_value


@dataclass(frozen=True)
class Record:
    items: list[Item]
    settings: list[Setting]

    def item(self, item_id: str) -> Item:
        return next(i for i in self.items if i.id == item_id)


def _text(row: Mapping, name: str, where: str, required: bool = True) -> str:
    value = row.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str) or not value.strip():
        raise FidelityError(f"{where}: '{name}' must be a non-empty string")
    return value.strip()


def parse(raw: Any, source: str = FIDELITY_FILE) -> Record:
    """The record from its YAML tree, with one-line errors for every malformed row."""
    if not isinstance(raw, Mapping) or set(raw) - set(PAPERS):
        raise FidelityError(f"{source}: expected one mapping per paper ({', '.join(PAPERS)})")
    items: list[Item] = []
    settings: list[Setting] = []
    for paper, body in raw.items():
        if not isinstance(body, Mapping) or set(body) - {"items", "settings"}:
            raise FidelityError(f"{source}: {paper}: expected 'items' and 'settings'")
        for n, row in enumerate(body.get("items") or []):
            where = f"{source}: {paper}.items[{n}]"
            status = _text(row, "status", where)
            if status not in ITEM_STATUS:
                raise FidelityError(f"{where}: status {status!r} not in {ITEM_STATUS}")
            item_id = _text(row, "id", where)
            if not item_id.startswith(f"{paper}/"):
                raise FidelityError(f"{where}: id {item_id!r} must start with '{paper}/'")
            why = _text(row, "why", where, required=status != "reproduced")
            items.append(Item(item_id, paper, _text(row, "what", where),
                              _text(row, "where", where), row.get("stage"), status, why))
        for n, row in enumerate(body.get("settings") or []):
            where = f"{source}: {paper}.settings[{n}]"
            status = _text(row, "status", where)
            if status not in SETTING_STATUS:
                raise FidelityError(f"{where}: status {status!r} not in {SETTING_STATUS}")
            if "paper" not in row:
                raise FidelityError(f"{where}: 'paper' is missing (null when not stated)")
            if status in HOLDS_PAPER_VALUE and row["paper"] is None:
                raise FidelityError(f"{where}: a '{status}' row needs the paper's value")
            meaning = row.get("meaning_differs", False)
            if not isinstance(meaning, bool) or (meaning and status != "deviates"):
                raise FidelityError(f"{where}: 'meaning_differs' is true or false, and true "
                                    "only on a 'deviates' row")
            settings.append(Setting(_text(row, "key", where), _text(row, "item", where),
                                    row["paper"], _text(row, "where", where), status,
                                    _text(row, "why", where, required=status != "same"),
                                    row.get("params_value", _UNSET), meaning))
    ids = Counter(i.id for i in items)
    twice = [i for i, n in ids.items() if n > 1]
    if twice:
        raise FidelityError(f"{source}: item ids given twice: {twice}")
    stray = sorted({s.item for s in settings} - set(ids))
    if stray:
        raise FidelityError(f"{source}: settings name unknown items: {stray}")
    rows = Counter((s.key, s.item) for s in settings)
    twice = sorted(f"{k} ({i})" for (k, i), n in rows.items() if n > 1)
    if twice:
        raise FidelityError(f"{source}: keys given twice for one item: {twice}")
    return Record(items, settings)


def load(path: str | Path = FIDELITY_FILE) -> Record:
    from attncert.pipeline.params import read_yaml

    path = Path(path)
    if not path.is_file():
        raise FidelityError(f"{path}: not found")
    return parse(read_yaml(path), str(path))


def lookup(tree: Mapping, key: str) -> Any:
    """The value of a dotted ``key`` in a params tree (:class:`FidelityError` if absent)."""
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise FidelityError(f"{key}: not a params.yaml key")
        node = node[part]
    return node


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    return a == b


def check_params(record: Record, params: Mapping) -> list[str]:
    """Every departure of ``params`` (a params.yaml tree) from the record: a key it lacks, a
    value that differs from a row marked "same", and a value equal to the paper's on a row
    marked "deviates" (the departure it records is gone: the row becomes "same"), unless the
    row says the number means something else here (``meaning_differs``)."""
    problems = []
    for s in record.settings:
        try:
            ours = lookup(params, s.key)
        except FidelityError as exc:
            problems.append(str(exc))
            continue
        if s.status in HOLDS_PAPER_VALUE and not _same(ours, s.expected):
            problems.append(f"{s.key}: params.yaml has {ours!r}, the paper ({s.where}) "
                            f"{s.expected!r}; the row is marked {s.status}")
        elif (s.status == "deviates" and not s.meaning_differs and s.expected is not None
              and _same(ours, s.expected)):
            problems.append(f"{s.key}: params.yaml has the paper's {ours!r} ({s.where}); "
                            "the row is marked deviates: mark it same")
    return problems


#: an item's stage that is several dvc.yaml stages (the grid trains, then certifies)
STAGE_GROUPS = {"vit_grid": ("train_vit", "certify_vit")}
_REF = re.compile(r"\$\{\s*([A-Za-z_][\w.]*)\s*\}")


def stage_reads(dvc_stages: Mapping[str, Any]) -> dict[str, set[str]]:
    """dvc.yaml stage name -> the params keys it reads: its ``params`` entries and the keys its
    ``matrix`` or ``foreach`` expands (a grid point's values)."""
    out: dict[str, set[str]] = {}
    for name, stage in dvc_stages.items():
        keys = {p for p in stage.get("params") or [] if isinstance(p, str)}
        keys |= set(_REF.findall(str(stage.get("matrix", "")) + str(stage.get("foreach", ""))))
        out[name] = keys
    return out


def item_stages(stage: str, dvc_stages: Mapping[str, Any]) -> list[str]:
    """The dvc.yaml stages an item's ``stage`` names: itself, its units (``<stage>_*``) or its
    :data:`STAGE_GROUPS` entry."""
    names = STAGE_GROUPS.get(stage, (stage,))
    return [n for n in dvc_stages if any(n == g or n.startswith(f"{g}_") for g in names)]


def check_stages(record: Record, dvc_stages: Mapping[str, Any]) -> list[str]:
    """Every departure of the record from the pipeline (``dvc_stages``: dvc.yaml's
    ``stages``): an item's stage that names no dvc.yaml stage, an item reproduced (in part)
    without a stage or not reproduced with one, and a row marked "same" that no
    stage of its item reads (no stage, or the key belongs to another stage's setting: such a
    value is "borrowed", not a reproduction of the paper's setting)."""
    reads = stage_reads(dvc_stages)
    items = {i.id: i for i in record.items}
    problems = [f"{i.id}: stage {i.stage!r} names no dvc.yaml stage" for i in record.items
                if i.stage and not item_stages(i.stage, dvc_stages)]
    problems += [f"{i.id}: {i.status} with no stage" if not i.stage else
                 f"{i.id}: not reproduced, yet names stage {i.stage!r}" for i in record.items
                 if bool(i.stage) == (i.status == "not_reproduced")]
    for s in record.settings:
        if s.status != "same":
            continue
        item = items[s.item]
        if not item.stage:
            problems.append(f"{s.key}: marked same for {s.item}, which no stage reproduces")
            continue
        names = item_stages(item.stage, dvc_stages)
        if not any(s.key == k or s.key.startswith(f"{k}.") for n in names for k in reads[n]):
            problems.append(f"{s.key}: marked same for {s.item}, but its stage "
                            f"({', '.join(names)}) does not read it: the value is borrowed by "
                            "another setting")
    return problems


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_fmt(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _cell(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("|", "\\|")).strip()


#: what the record holds (the page's opening paragraph)
INTRO = """\
`fidelity.yaml` records, for every table and figure of the four papers (LoFAST, ICML 2024;
OLSA, ICLR 2023 submission; SpecFormer; CertViT) and for every `params.yaml` key that
reproduces one, the paper's value, where its full text states it (section, table or
appendix), and a status: *same* (the stage that reproduces the item runs the paper's value; a
test fails when `params.yaml` departs from it or when no such stage reads the key),
*borrowed* (the paper's value, held as firmly, in a setting no paper runs: not counted as
reproducing anything), *deviates* (and why), *ours* (the paper does not state it) or *not
reproduced* (and why). Our values are read from `params.yaml` when the record is
rendered, never written in it."""

#: where the papers' numbers stand in the reports (after the summary)
PAPER_NUMBERS = """\
Paper numbers stand only beside a model of their own setting (`src/attncert/report/paper.py` states
table, column, row and setting for each): LoFAST Tables 1-2 beside the crown stage's 128-d
ViTs, never the 384-d grid (LoFAST Figure 2 prints no numbers); CertViT's Table 1 beside its
small ViTs trained here (`certvit.table1`), at the pixel-space radius its eps covers (its
eps is a radius on the normalised input: eps x min std, 1.58 -> 0.4867 on MNIST, 0.141 ->
0.0281 on CIFAR-10 and 0.0361 on CIFAR-100), never beside the section's own ViT-B/16 run;
OLSA's radii (its unsound softmax constant 1/4; ours 1/2) beside the 3-layer OLSA on SST-2
and Yelp and the frozen head on QQP."""

STATUS_LABEL = {"same": "same", "borrowed": "borrowed (no paper's setting)",
                "deviates": "deviates", "not_stated": "ours (not stated)",
                "not_reproduced": "not reproduced", "reproduced": "reproduced",
                "partly": "partly"}


def render_docs(record: Record, params: Mapping) -> str:
    """docs/fidelity.md: per paper, its tables and figures, then every setting."""
    out = ["# Fidelity: the paper scale against the four papers", "", INTRO, "",
           f"Generated from `{FIDELITY_FILE}` and `params.yaml` by "
           "`python -m attncert.report.fidelity docs`; do not edit by hand "
           "(`python -m attncert.report.fidelity check` checks the record). \"where\" is the "
           "section, table or appendix of the paper's full text that states the value. \"ours\" "
           "is `params.yaml` at the paper scale; a row marked *same* is checked by the tests "
           "(`tests/test_fidelity.py`). The cpu and smoke scales (`profiles/`) are budget "
           "versions of every row and claim no paper setting.", "",
           "## Summary", "", render_summary(record), "", PAPER_NUMBERS, ""]
    for paper, title in PAPERS.items():
        items = [i for i in record.items if i.paper == paper]
        if not items:
            continue
        out += [f"## {title}", "", "| item | where | stage | status | why |",
                "|---|---|---|---|---|"]
        out += [f"| {_cell(i.what)} | {_cell(i.where)} | {i.stage or '–'} | "
                f"{STATUS_LABEL[i.status]} | {_cell(i.why) or '–'} |" for i in items]
        rows = [s for s in record.settings if s.item in {i.id for i in items}]
        out += ["", f"### {title}: settings", "",
                "| key | item | paper | where | ours | status | why |",
                "|---|---|---|---|---|---|---|"]
        for s in rows:
            try:
                ours = _fmt(lookup(params, s.key))
            except FidelityError:
                ours = "(missing)"
            out.append(f"| `{s.key}` | {s.item.split('/', 1)[1]} | {_cell(_fmt(s.paper))} | "
                       f"{_cell(s.where)} | {_cell(ours)} | {STATUS_LABEL[s.status]} | "
                       f"{_cell(s.why) or '–'} |")
        out.append("")
    return "\n".join(out)


def render_summary(record: Record) -> str:
    """The page's short summary: per paper, counts of items and settings by status."""
    out = ["| paper | tables and figures: reproduced / partly / not | settings: same / borrowed "
           "/ deviates / ours (not stated) / not reproduced |", "|---|---|---|"]
    for paper, title in PAPERS.items():
        ic = Counter(i.status for i in record.items if i.paper == paper)
        ids = {i.id for i in record.items if i.paper == paper}
        sc = Counter(s.status for s in record.settings if s.item in ids)
        out.append(f"| {title} | {ic['reproduced']} / {ic['partly']} / {ic['not_reproduced']} | "
                   f"{sc['same']} / {sc['borrowed']} / {sc['deviates']} / {sc['not_stated']} / "
                   f"{sc['not_reproduced']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    from attncert.pipeline.params import PARAMS_FILE, read_yaml

    ap = argparse.ArgumentParser(prog="python -m attncert.report.fidelity",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("command", choices=["check", "docs"])
    ap.add_argument("--record", default=FIDELITY_FILE)
    ap.add_argument("--params", default=PARAMS_FILE)
    ap.add_argument("--dvc", default="dvc.yaml")
    args = ap.parse_args(argv)
    try:
        record = load(args.record)
        params = read_yaml(args.params)
        problems = check_params(record, params)
        problems += check_stages(record, read_yaml(args.dvc).get("stages") or {})
        if args.command == "docs":
            Path(DOCS_FILE).parent.mkdir(exist_ok=True)
            Path(DOCS_FILE).write_text(render_docs(record, params))
            print(f"wrote {DOCS_FILE}")
        for p in problems:
            print(f"fidelity: {p}", file=sys.stderr)
        if problems:
            return 1
        print(f"fidelity: {len(record.items)} tables and figures, {len(record.settings)} "
              "settings; params.yaml matches every row marked same or borrowed, and a stage "
              "reads every row marked same")
    except FidelityError as exc:
        print(f"fidelity: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
