"""The documentation's own structure: its code fences close, and its links between pages reach a
file and a heading that exist. The docs hold long verbatim benchmark output, whose own fences (the
benchmark prints them around plans and reports) once turned the rest of a page into code."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _outside_fences(text: str) -> list[str]:
    """The lines of ``text`` that are not inside a fenced block."""
    lines, inside = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            inside = not inside
        elif not inside:
            lines.append(line)
    return lines


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    anchors = set()
    for line in _outside_fences(page.read_text()):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_fence_opened_is_closed(page: Path) -> None:
    inside, opened = False, 0
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if not FENCE.match(line):
            continue
        nested = inside and line.strip() != "```"
        assert not nested, f"{page.name}:{number} opens a fence inside the one opened at {opened}"
        inside, opened = not inside, number
    assert not inside, f"{page.name}: the fence opened at line {opened} is never closed"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_between_pages_reaches_its_heading(page: Path) -> None:
    broken = []
    for line in _outside_fences(page.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):
                continue  # another site's
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(target)
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                broken.append(target)
    assert not broken, f"{page.name} links to what does not exist: {broken}"
