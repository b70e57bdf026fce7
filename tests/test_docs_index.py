"""The guides can be found: every `docs/*.md` is linked from the index `docs/README.md`, and every page of a
folder below (`docs/benchmarks/*.md`) from the index or from a guide the index links; the front page links that
index, and no relative link in README.md or docs/**/*.md names a file that does not exist.

Links are Markdown's inline `[text](target)`; code (fenced blocks and `inline` spans) is not read, since
a command there may hold brackets. Only the standard library is used.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
INDEX = DOCS / "README.md"
FRONT_PAGE = ROOT / "README.md"
PAGES = [FRONT_PAGE, *sorted(DOCS.rglob("*.md"))]

FENCED_CODE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# [text](target "optional title"); an image's ![alt](target) matches too.
INLINE_LINK = re.compile(r"\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def link_targets(page: Path) -> list[str]:
    """The targets of a page's inline links, outside code, as written."""
    prose = INLINE_CODE.sub("", FENCED_CODE.sub("", page.read_text(encoding="utf-8")))
    return INLINE_LINK.findall(prose)


def local_files(page: Path) -> list[tuple[str, Path]]:
    """(target as written, file it names) for each link to a file of this repository: no scheme, no bare anchor."""
    files = []
    for target in link_targets(page):
        parts = urlsplit(target)
        if parts.scheme or parts.netloc or not parts.path:
            continue
        files.append((target, (page.parent / unquote(parts.path)).resolve()))
    return files


def test_every_guide_is_linked_from_the_docs_index():
    guides = {path.resolve() for path in DOCS.glob("*.md")} - {INDEX.resolve()}
    linked = {path for _, path in local_files(INDEX)}
    missing = sorted(path.name for path in guides - linked)
    assert not missing, f"docs/README.md links no line to {missing}: add one line per guide"


def test_every_page_below_docs_is_linked_from_the_index_or_a_guide_it_links():
    # One click further: BENCHMARKS.md's headline table links the log's pages (docs/benchmarks/), the index links it.
    below = {path.resolve() for path in DOCS.rglob("*.md") if path.parent != DOCS}
    guides = {path for _, path in local_files(INDEX) if path.parent == DOCS.resolve() and path.suffix == ".md"}
    linked = {path for page in [INDEX, *sorted(guides)] if page.exists() for _, path in local_files(page)}
    missing = sorted(str(path.relative_to(DOCS.resolve())) for path in below - linked)
    assert not missing, f"neither docs/README.md nor a guide it links links to {missing}"


def test_the_front_page_links_the_docs_index():
    linked = {path for _, path in local_files(FRONT_PAGE)}
    assert INDEX.resolve() in linked, "README.md does not link docs/README.md, the index of the guides"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_names_a_file_that_exists(page):
    broken = [target for target, path in local_files(page) if not path.exists()]
    assert not broken, f"{page.relative_to(ROOT)} links to files that do not exist: {broken}"


def test_links_are_read_from_prose_and_not_from_code(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "See [a](a.md#part), [site](https://example.org) and [top](#top), ![img](pics/b.png \"B\").\n"
        "```bash\npython x.py [c](c.md)\n```\nand `[d](d.md)` in a span.\n",
        encoding="utf-8",
    )
    folder = tmp_path.resolve()
    assert local_files(page) == [("a.md#part", folder / "a.md"), ("pics/b.png", folder / "pics" / "b.png")]


HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: the text lower-cased, punctuation (backticks, dots, slashes,
    brackets...) dropped but for hyphens and underscores, spaces as hyphens; a repeated one gets -1, -2, ..."""
    anchors: set[str] = set()
    for text in HEADING.findall(FENCED_CODE.sub("", page.read_text(encoding="utf-8"))):
        base = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        anchor, count = base, 0
        while anchor in anchors:
            count += 1
            anchor = f"{base}-{count}"
        anchors.add(anchor)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_into_a_page_names_one_of_its_headings(page):
    # A section moved, renamed or deleted leaves the links into it pointing nowhere (on 2026-11-28 an edit deleted
    # 2,020 lines of BENCHMARKS.md; four links of other guides led into them).
    broken = [target for target, path in local_files(page)
              if urlsplit(target).fragment and path.suffix == ".md" and path.exists()
              and unquote(urlsplit(target).fragment) not in heading_anchors(path)]
    own = heading_anchors(page)
    broken += [target for target in link_targets(page) if target.startswith("#") and unquote(target[1:]) not in own]
    assert not broken, f"{page.relative_to(ROOT)} links to headings that do not exist: {broken}"


def test_heading_anchors_are_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Scaling (`benchmarks/scaling.py`)\n## The GPU round of 2026-11-28 (one NVIDIA H100)\n"
                    "### Notes\n### Notes\n```\n# not a heading\n```\n", encoding="utf-8")
    assert heading_anchors(page) == {"scaling-benchmarksscalingpy", "the-gpu-round-of-2026-11-28-one-nvidia-h100",
                                     "notes", "notes-1"}
