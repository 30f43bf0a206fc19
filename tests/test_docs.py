"""Links in README.md, docs/*.md and the performance journal (docs/perf/*.md) resolve: in-page
anchors to a heading of the same file (as GitHub names headings), relative links to a file of the
repository. docs/PERF.md stays a reference of at most 300 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "perf").glob("*.md"))]


def anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to '-', repeats numbered."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    in_code = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_code = not in_code
            continue
        m = re.match(r"(#{1,6}) (.*)", line)
        if in_code or not m:
            continue
        base = re.sub(r"[^\w\- ]", "", m.group(2).strip().lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_heading_anchors_follow_github():
    text = "# Where it stands\n## From /dev/shm, with `x` (12:26–12:28 UTC)\n## Where it stands\n```\n# not one\n```\n"
    assert anchors(text) == {"where-it-stands", "from-devshm-with-x-12261228-utc", "where-it-stands-1"}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_links_resolve(doc: Path):
    text = doc.read_text()
    own = anchors(text)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, frag = target.partition("#")
        if not path:
            assert frag in own, f"{doc.name}: no heading for #{frag}"
            continue
        dest = (doc.parent / path).resolve()
        assert dest.exists(), f"{doc.name}: {target} does not exist"
        if frag and dest.suffix == ".md":
            assert frag in anchors(dest.read_text()), f"{doc.name}: {path} has no heading for #{frag}"


def test_perf_is_a_reference_that_links_to_the_journal():
    text = (ROOT / "docs" / "PERF.md").read_text()
    assert len(text.splitlines()) <= 300, "docs/PERF.md is the reference: full records go to docs/perf/"
    journal = {p.name for p in (ROOT / "docs" / "perf").glob("*.md")}
    linked = {m.split("#")[0].removeprefix("perf/") for m in re.findall(r"\]\((perf/[^)\s]+)\)", text)}
    assert journal and journal <= linked, f"journal files PERF.md does not link: {sorted(journal - linked)}"
