"""The repository stands alone: nothing refers to files outside it, and every citation of
``docs/<file>.md §<n>`` names a section that exists in that file."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [
    *sorted((ROOT / "macformer_lit").rglob("*.py")),
    *sorted((ROOT / "tests").rglob("*.py")),
    *sorted((ROOT / "benchmarks").rglob("*.py")),
    *sorted((ROOT / "configs").rglob("*.yaml")),
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
# Written in pieces so that this file does not match its own patterns.
OUTSIDE = re.compile(
    "|".join(
        [
            r"\.\./" + "shared",
            "SPEC" + r"\.md",
            "PITFALLS" + r"\.md",
            "STYLE" + r"\.md",
            "SPEC" + " §",
            "/work/" + "shared",
        ]
    )
)
CITATION = re.compile(r"docs/(\w+)\.md §(\d+(?:\.\d+)?)((?:, §\d+(?:\.\d+)?)*)")


def _sections(doc: Path) -> set[str]:
    """Section numbers of the ``## 3. Title`` and ``### 3.1 Title`` headings of ``doc``."""
    found = re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", doc.read_text(), flags=re.MULTILINE)
    return set(found)


def test_nothing_refers_to_files_outside_the_repository():
    hits = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in SOURCES
        if path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not hits, "\n".join(hits)


def test_every_docs_citation_names_an_existing_section():
    cited = 0
    missing = []
    for path in SOURCES:
        text = path.read_text().replace("\n", " ")
        for name, first, more in CITATION.findall(text):
            doc = ROOT / "docs" / f"{name}.md"
            numbers = [first, *re.findall(r"§(\d+(?:\.\d+)?)", more)]
            have = _sections(doc) if doc.is_file() else set()
            for number in numbers:
                cited += 1
                if number not in have:
                    missing.append(f"{path.relative_to(ROOT)}: docs/{name}.md §{number}")
    assert cited > 30  # the package's docstrings cite the docs throughout
    assert not missing, "\n".join(missing)
