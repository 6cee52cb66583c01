"""The documentation: README.md fits a screen, every relative link resolves inside the repository, nothing points
outside it, the recipe reference is the schema's, and every page of docs/ is in the index."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 150
REGENERATE = "python -m dstrain.docs_gen --write docs/recipes.md"

LINK = re.compile(r"(?<!\!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMAGE = re.compile(r"!\[[^\]]*\]\(\s*([^)\s]+)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
# Text that points outside the repository: the workspace's shared folder, or absolute paths of a machine.
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.~-])/(?:work|home|root|Users)/")


def doc_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(ROOT.glob("corpus/**/README.md")),
             *sorted(ROOT.glob("benchmarks/**/README.md"))]
    return [f for f in files if f.is_file()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.*?)\s*#*\s*$", text, re.M)}


def links(path: Path) -> list[str]:
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return [m.group(1) for m in LINK.finditer(text)] + [m.group(1) for m in IMAGE.finditer(text)]


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: — not files
            if target.lower().startswith("file:"):
                bad.append(f"{target} (a file URL)")
            continue
        where, _, anchor = target.partition("#")
        if where.startswith("/"):
            bad.append(f"{target} (absolute: use a path relative to {path.relative_to(root)})")
            continue
        dest = (path.parent / where).resolve() if where else path
        try:
            dest.relative_to(root)
        except ValueError:
            bad.append(f"{target} (outside the repository)")
            continue
        if not dest.exists():
            bad.append(f"{target} (no such file or folder)")
        elif anchor and dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
            bad.append(f"{target} (no heading '#{anchor}' in {dest.relative_to(root)})")
    return bad


def test_readme_fits_a_screen():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/"


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(path):
    assert broken_links(path) == []


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_nothing_points_outside_the_repository(path):
    text = path.read_text(encoding="utf-8")
    hits = [f"line {text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in OUTSIDE.finditer(text)]
    assert hits == [], f"{path.relative_to(ROOT)} refers to paths outside the repository"


def test_link_checker_catches_what_it_should(tmp_path):
    """The checks above would pass vacuously if they matched nothing: show they catch each kind of bad link."""
    root = tmp_path / "repo"
    (root / "docs").mkdir(parents=True)
    (root / "docs" / "other.md").write_text("# Other page\n")
    page = root / "docs" / "page.md"
    page.write_text("# The paper's `τ` table: **reproduce**\n[ok](other.md#other-page) [gone](nowhere.md) "
                    "[up](../../elsewhere.md) [abs](/etc/passwd) [self](#the-papers-τ-table-reproduce) [no](#nope) "
                    "[web](https://example.org/x)\n```\n[in a fence](ignored.md)\n```\n")
    assert broken_links(page, root) == ["nowhere.md (no such file or folder)", "../../elsewhere.md (outside the repository)",
                                        "/etc/passwd (absolute: use a path relative to docs/page.md)",
                                        "#nope (no heading '#nope' in docs/page.md)"]
    assert OUTSIDE.search("see ../shared/DESIGN.md") and OUTSIDE.search("at /work/main/x") and not OUTSIDE.search("runs/work/x")


def test_recipe_reference_is_up_to_date():
    from dstrain.docs_gen import generated_part, recipe_reference

    committed = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert generated_part(committed) == recipe_reference(), (
        f"docs/recipes.md is out of date with the recipe schema (dstrain/recipe.py); regenerate it: {REGENERATE}")


def test_every_docs_page_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index) if t.partition("#")[0]}
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md"]
    assert pages, "docs/ holds no pages"
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert missing == [], f"docs/README.md does not link {missing}"


def test_readme_links_the_docs_index():
    assert "docs/README.md" in links(ROOT / "README.md") or "docs/" in links(ROOT / "README.md")
