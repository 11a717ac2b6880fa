"""The README and the pages under docs/: their interactive examples run and print what they say, their links lead
somewhere, and the README stays a user's guide."""

import doctest
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```.*?^```", re.S | re.M)


def interactive_blocks(path: Path) -> list[str]:
    return [b for b in re.findall(r"```python\n(.*?)```", path.read_text(), re.S) if b.lstrip().startswith(">>>")]


def slug(heading: str) -> str:
    """The anchor GitHub (and MkDocs' toc extension, for these headings) gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCED.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_has_an_interactive_example() -> None:
    assert interactive_blocks(README), "the README has no interactive example"


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_interactive_examples_print_what_the_page_says(path: Path) -> None:
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for i, block in enumerate(interactive_blocks(path)):
        runner.run(doctest.DocTestParser().get_doctest(block, {}, f"{path.name} block {i}", str(path), 0))
    assert runner.summarize(verbose=False).failed == 0


@pytest.mark.parametrize("path", PAGES, ids=lambda p: p.name)
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(path: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", FENCED.sub("", path.read_text()))
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(link)
    assert not broken, f"{path.name} links to what does not exist: {broken}"


def test_the_readme_is_a_users_guide_of_at_most_400_lines() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 400
    # Measurement logs live in docs/performance.md, current figures only.
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", text), "a dated log in the README: move it to docs/performance.md"
    assert "](docs/performance.md)" in text


def test_every_docs_page_is_linked_from_the_readme_or_the_docs_index() -> None:
    linked = set(re.findall(r"\]\((?:docs/)?([\w-]+\.md)", README.read_text() + (ROOT / "docs/index.md").read_text()))
    pages = {p.name for p in PAGES if p.parent.name == "docs"} - {"index.md"}
    assert pages <= linked, f"pages nobody links to: {sorted(pages - linked)}"
