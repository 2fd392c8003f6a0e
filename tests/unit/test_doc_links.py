"""Every relative link in the README, docs/ and the chart's README points at a file that exists and,
with a `#fragment`, at a heading of that file (GitHub's anchor rules)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "charts" / "xpyd-operator" / "README.md"]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
CODE = re.compile(r"`[^`\n]*`")


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    text = FENCE.sub("", path.read_text())
    headings = re.findall(r"^#{1,6}\s+(.+?)\s*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", heading.lower().replace("`", "")).replace(" ", "-") for heading in headings}


def links(path: Path) -> list[str]:
    return [target for target in LINK.findall(CODE.sub("", FENCE.sub("", path.read_text())))
            if not re.match(r"[a-z]+:", target)           # http:, https:, mailto: are not checked here
            and re.fullmatch(r"[\w./#~-]+", target)]     # not a regex in a CEL rule like `[a-z]([-a-z]*)`


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(document: Path) -> None:
    broken = []
    for target in links(document):
        file_part, _, fragment = target.partition("#")
        linked = (document.parent / file_part).resolve() if file_part else document
        if not linked.exists():
            broken.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            broken.append(f"{target}: no heading #{fragment}")
    assert broken == [], broken


def test_the_checker_sees_links_and_anchors() -> None:
    assert "stopping" in anchors(ROOT / "docs" / "proxy.md")
    assert "docs/proxy.md" in links(ROOT / "README.md")
