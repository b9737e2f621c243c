"""docs/math.md is the repository's own math document: every reference to it from the code,
the notebooks, the tests and the fidelity record names a section it has."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "math.md"
#: "docs/math.md section 6", "docs/math.md sections 4-6", "docs/math.md sec. 2", "sections 4, 5, 7"
REF = re.compile(r"docs/math\.md\s+(?:sections?|sec\.)\s+((?:\d+(?:\s*(?:-|,|and)\s*)?)+)")


def _sources() -> list[Path]:
    files = [*(ROOT / "src").rglob("*.py"), *(ROOT / "notebooks").glob("*.py"),
             *(ROOT / "tests").glob("*.py"), ROOT / "fidelity.yaml", ROOT / "README.md",
             *(ROOT / "docs").glob("*.md")]
    return [f for f in files if f != Path(__file__).resolve()]


def _sections() -> set[int]:
    return {int(m) for m in re.findall(r"^## (\d+)\. ", DOC.read_text(), flags=re.M)}


def _numbers(spec: str) -> set[int]:
    out: set[int] = set()
    for part in re.split(r"\s*(?:,|and)\s*", spec.strip()):
        if "-" in part:
            lo, hi = (int(p) for p in part.split("-"))
            out |= set(range(lo, hi + 1))
        elif part:
            out.add(int(part))
    return out


def test_the_sections_are_numbered_in_order():
    text = DOC.read_text()
    numbers = [int(m) for m in re.findall(r"^## (\d+)\. ", text, flags=re.M)]
    assert numbers == list(range(1, len(numbers) + 1)) and len(numbers) >= 9


def test_every_reference_names_a_section_that_exists():
    sections, refs, missing = _sections(), 0, []
    for path in _sources():
        text = re.sub(r"\s*\n\s*#?\s*", " ", path.read_text())  # references wrap across lines
        assert "MATH.md" not in text.replace("docs/math.md", ""), \
            f"{path.relative_to(ROOT)} names a math document outside the repository"
        for m in REF.finditer(text):
            refs += 1
            missing += [(path.relative_to(ROOT), n) for n in _numbers(m.group(1)) - sections]
    assert refs >= 40, refs  # the code does cite the document
    assert not missing, missing


def test_the_reference_pattern_reads_ranges_and_lists():
    assert _numbers("4-6") == {4, 5, 6} and _numbers("4, 5, 7") == {4, 5, 7}
    assert _numbers("4 and 7") == {4, 7}
    m = REF.search("see docs/math.md sections 1, 3, 7, 8). More")
    assert m and _numbers(m.group(1)) == {1, 3, 7, 8}
