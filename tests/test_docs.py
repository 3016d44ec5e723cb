"""The documentation's shape: a short README as the front door, every link inside the repository.

- README.md has at most 250 lines;
- every relative markdown link in README.md, docs/*.md, bench/README.md, deploy/README.md and
  tests/README.md resolves to an existing file or directory, and its ``#anchor`` to a heading of
  that file (GitHub's slug rules);
- no link leaves the repository (a ``../`` above its root, an absolute path);
- every page in docs/ is linked from README.md.

Pure text: no torch, no server.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_MAX_LINES = 250
# tests/README.md is written alongside this test; it is checked once it exists.
OPTIONAL = {ROOT / "tests" / "README.md"}

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def doc_files() -> list[Path]:
    files = [README, *sorted((ROOT / "docs").glob("*.md"))]
    files += [ROOT / "bench" / "README.md", ROOT / "deploy" / "README.md"]
    files += [p for p in sorted(OPTIONAL) if p.exists()]
    return files


def prose_lines(text: str) -> Iterator[str]:
    """The lines outside fenced code blocks."""
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield line


def links(path: Path) -> list[str]:
    """Every link target in a markdown file's prose (code spans and code blocks left out)."""
    found: list[str] = []
    for line in prose_lines(path.read_text(encoding="utf-8")):
        found += LINK.findall(INLINE_CODE.sub("", line))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a markdown file's headings, with GitHub's -1, -2 for repeats."""
    seen: dict[str, int] = {}
    result: set[str] = set()
    for line in prose_lines(path.read_text(encoding="utf-8")):
        match = HEADING.match(line)
        if not match:
            continue
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def resolve(source: Path, target: str) -> tuple[Path, str]:
    """The file a relative link points at (the source itself for ``#anchor``) and its anchor."""
    file_part, _, anchor = target.partition("#")
    if not file_part:
        return source, anchor
    return (source.parent / file_part).resolve(), anchor


def relative_links() -> list[tuple[Path, str]]:
    return [
        (path, target)
        for path in doc_files()
        for target in links(path)
        if not EXTERNAL.match(target)
    ]


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines; the limit is {README_MAX_LINES}: move reference text "
        "to docs/ and link it"
    )


def test_the_documents_exist() -> None:
    missing = [str(p.relative_to(ROOT)) for p in doc_files() if not p.is_file()]
    assert not missing, f"missing: {missing}"
    assert list((ROOT / "docs").glob("*.md")), "docs/ holds no page"


def test_links_stay_in_the_repository() -> None:
    outside = []
    for path, target in relative_links():
        file_part = target.partition("#")[0]
        if file_part.startswith("/") or not resolve(path, target)[0].is_relative_to(ROOT):
            outside.append(f"{path.relative_to(ROOT)}: {target}")
    assert not outside, "links that leave the repository:\n" + "\n".join(outside)


def test_relative_links_resolve() -> None:
    broken = []
    for path, target in relative_links():
        dest, anchor = resolve(path, target)
        where = f"{path.relative_to(ROOT)}: {target}"
        if not dest.is_relative_to(ROOT):
            continue  # test_links_stay_in_the_repository reports it
        if not dest.exists():
            if dest in OPTIONAL:
                continue
            broken.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_doc_is_linked_from_the_readme() -> None:
    linked = {resolve(README, target)[0] for target in links(README) if not EXTERNAL.match(target)}
    unlinked = [
        str(p.relative_to(ROOT)) for p in sorted((ROOT / "docs").glob("*.md")) if p not in linked
    ]
    assert not unlinked, f"pages in docs/ that README.md does not link: {unlinked}"


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("The two commands", "the-two-commands"),
        ("The contract (`proto/inference/v1/`)", "the-contract-protoinferencev1"),
        ("The Embed batch wait (`bench/batch_wait.py`)", "the-embed-batch-wait-benchbatch_waitpy"),
        ("Numerics: which mode, which weights?", "numerics-which-mode-which-weights"),
        ("Embed: the batcher", "embed-the-batcher"),
    ],
)
def test_slug_follows_github(heading: str, expected: str) -> None:
    assert slug(heading) == expected
