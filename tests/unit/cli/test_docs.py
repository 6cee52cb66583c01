"""The documentation: README.md fits a screen, every relative link resolves inside the repository, nothing points
outside it, the recipe reference is the schema's, and every page of docs/ is in the index."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README_MAX_LINES = 150
REGENERATE = "python -m dstrain.cli.reference_docs --write docs/recipes.md"

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
    from dstrain.cli.reference_docs import generated_part, recipe_reference

    committed = (ROOT / "docs" / "recipes.md").read_text(encoding="utf-8")
    assert generated_part(committed) == recipe_reference(), (
        f"docs/recipes.md is out of date with the recipe schema (dstrain/config/schema.py); regenerate it: {REGENERATE}")


def test_every_docs_page_is_in_the_index():
    index = ROOT / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for t in links(index) if t.partition("#")[0]}
    pages = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "README.md"]
    assert pages, "docs/ holds no pages"
    missing = [p.name for p in pages if p.resolve() not in linked]
    assert missing == [], f"docs/README.md does not link {missing}"


def test_readme_links_the_docs_index():
    assert "docs/README.md" in links(ROOT / "README.md") or "docs/" in links(ROOT / "README.md")


# --- Commands quoted in the docs are the code's --------------------------------------------------------------------
# Every `dstrain …` (also `python -m dstrain …`, `torchrun … -m dstrain …`) in README.md and docs/*.md, in code blocks
# and inline code, names a real command and only options its parser has; every `make TARGET` a Makefile target; every
# tools/X.py (or .sh) an existing file. Placeholders (RECIPE, runs/NAME, …) are positionals: not checked.

COMMAND_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
DSTRAIN = re.compile(r"(?:(?<=^)|(?<=[\s(=]))dstrain(?=[ \t])")  # the command word, not dstrain/, dstrain's, -m dstrain.x
MAKE = re.compile(r"(?:^|[;&|(]\s*)(?:[A-Z_]+=\S+\s+)*make\s+((?:[A-Z_]+=\S+\s+)*)([A-Za-z][\w-]*)")
TOOL = re.compile(r"(?<![\w/.-])tools/[\w.-]+\.(?:py|sh)\b")
STOP = {"|", "||", "&&", ";", ">", ">>", "2>&1", "=", "->", "→"}


def code_segments(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of each code-block line (continuations joined) and each inline code span."""
    text = path.read_text(encoding="utf-8").replace("\\`", "\x00")  # escaped backticks inside table cells
    segments, prose = [], []
    fence, pending, start = None, "", 0
    for number, line in enumerate(text.split("\n"), start=1):
        marker = re.match(r"\s*(```|~~~)", line)
        if fence:
            if marker and marker.group(1) == fence:
                fence = None
            elif line.rstrip().endswith("\\"):
                pending, start = pending + line.rstrip()[:-1] + " ", start or number
            else:
                segments.append((start or number, pending + line))
                pending, start = "", 0
            prose.append("")
            continue
        if marker:
            fence = marker.group(1)
            prose.append("")
            continue
        prose.append(line)
    body = "\n".join(prose)
    for m in re.finditer(r"`([^`]+)`", body):
        segments.append((body.count("\n", 0, m.start()) + 1, m.group(1).replace("\n", " ")))
    return sorted(segments)


def command_table() -> dict:
    from dstrain.cli import COMMANDS

    return COMMANDS


def command_parser(words: list[str], module: str):
    import importlib

    return importlib.import_module(f"dstrain.cli.{module}").parser("dstrain " + " ".join(words))


def check_dstrain_command(rest: str) -> str | None:
    """What is wrong with the words after `dstrain` (None: nothing)."""
    tokens = []
    for token in rest.split():
        if token in STOP or token.startswith("#"):
            break
        tokens.append(token)
    table, words = command_table(), []
    while tokens and not isinstance(table, tuple):
        word = tokens[0].strip("`'\"),:;.")
        if word.startswith("-"):
            break
        if word not in table:
            if words:
                return f"`dstrain {' '.join(words)} {word}`: no such subcommand (there are {', '.join(table)})"
            return f"`dstrain {word}`: no such command (commands: {', '.join(table)})"
        words, table, tokens = words + [word], table[word], tokens[1:]
    if not isinstance(table, tuple):
        return None  # `dstrain --help`, `dstrain --version`, or a bare group such as `dstrain data`
    options = command_parser(words, table[0])._option_string_actions
    bad = [flag for token in tokens for clean in [token.strip("[]()`'\",;")]
           if re.match(r"^--?[A-Za-z]", clean) and (flag := clean.split("=", 1)[0]) not in options]
    if bad:
        return f"`dstrain {' '.join(words)}` has no option {', '.join(bad)}"
    return None


def make_targets(root: Path = ROOT) -> set[str]:
    text = (root / "Makefile").read_text(encoding="utf-8")
    return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w-]*)\s*:(?!=)", text, re.M)}


def command_problems(path: Path, root: Path = ROOT) -> list[str]:
    targets = make_targets(root) if (root / "Makefile").is_file() else set()
    problems = []
    for number, segment in code_segments(path):
        where = f"{path.relative_to(root)}:{number}"
        for m in DSTRAIN.finditer(segment):
            wrong = check_dstrain_command(segment[m.end():])
            if wrong:
                problems.append(f"{where}: {wrong} — in: {segment.strip()}")
        for m in MAKE.finditer(segment):
            if m.group(2) not in targets:
                problems.append(f"{where}: `make {m.group(2)}`: no such Makefile target — in: {segment.strip()}")
        for m in TOOL.finditer(segment):
            if not (root / m.group(0)).is_file():
                problems.append(f"{where}: {m.group(0)}: no such file — in: {segment.strip()}")
    return problems


def test_commands_in_the_docs_are_real():
    problems = [p for path in COMMAND_DOCS for p in command_problems(path)]
    assert problems == [], "commands in the docs that the code does not have:\n" + "\n".join(problems)


def test_command_checker_catches_what_it_should(tmp_path):
    """The check above would pass vacuously if it matched nothing: show it catches each kind of wrong command."""
    (tmp_path / "Makefile").write_text("demo: install\n\techo\ninstall:\n\techo\nX := 1\n")
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "real.py").write_text("")
    page = tmp_path / "page.md"
    page.write_text("Run `dstrain evaluate --drafter x` or `dstrain eval --drafter x --limit 2`.\n"
                    "```bash\ndstrain data shards --inputs a.jsonl \\\n  --out s --shard-size 4   # a comment\n"
                    "torchrun --nproc-per-node 2 -m dstrain train RECIPE [--dry-run] [--nope]\n"
                    "python -m dstrain plan RECIPE train.steps=3\nmake demo\nmake X\nmake test\n"
                    "python tools/real.py; python tools/gone.py\ndstrain data pack --unpack\n```\n"
                    "`dstrain data` and `dstrain data bogus` and `dstrain/cli/x.py` and `make install`\n")
    assert command_problems(page, tmp_path) == [
        "page.md:1: `dstrain evaluate`: no such command (commands: " + ", ".join(command_table()) + ") — in: dstrain evaluate --drafter x",
        "page.md:3: `dstrain data shards` has no option --shard-size — in: dstrain data shards --inputs a.jsonl    --out s --shard-size 4   # a comment",
        "page.md:5: `dstrain train` has no option --nope — in: torchrun --nproc-per-node 2 -m dstrain train RECIPE [--dry-run] [--nope]",
        "page.md:8: `make X`: no such Makefile target — in: make X",
        "page.md:9: `make test`: no such Makefile target — in: make test",
        "page.md:10: tools/gone.py: no such file — in: python tools/real.py; python tools/gone.py",
        "page.md:13: `dstrain data bogus`: no such subcommand (there are " + ", ".join(command_table()["data"]) + ") — in: dstrain data bogus",
    ]


# --- Every option says what it does and what it defaults to ---------------------------------------------------------

def leaf_commands(table: dict | None = None, words: tuple[str, ...] = ()):
    for name, entry in (command_table() if table is None else table).items():
        if isinstance(entry, dict):
            yield from leaf_commands(entry, words + (name,))
        else:
            yield list(words + (name,)), entry[0]


def option_help_problems(parser) -> list[str]:
    """Optional arguments without help, or whose help hides a default they have (store_true flags: help only)."""
    import argparse

    problems = []
    for action in parser._actions:
        if not action.option_strings or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
            continue
        if action.help == argparse.SUPPRESS:  # a hidden alias kept for old command lines
            continue
        name, text, default = "/".join(action.option_strings), action.help or "", action.default
        if not text.strip():
            problems.append(f"{name}: no help")
        elif default is not None and default is not False and default != argparse.SUPPRESS and "%(default)" not in text and not re.search(
                rf"default\W{{0,3}}{re.escape(str(default))}(?![\w.])", text):
            problems.append(f"{name}: help does not show its default {default!r} (add %(default)s)")
    return problems


def test_every_option_has_help_and_shows_its_default():
    problems = [f"dstrain {' '.join(words)} {p}" for words, module in leaf_commands()
                for p in option_help_problems(command_parser(words, module))]
    assert problems == [], "options to describe in their parser's help=:\n" + "\n".join(problems)


def test_option_help_checker_catches_what_it_should():
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=int, default=3)
    ap.add_argument("--b", type=int, default=3, help="three of them")
    ap.add_argument("--c", type=int, default=3, help="count (default %(default)s)")
    ap.add_argument("--d", type=int, default=30, help="count (default 3)")
    ap.add_argument("--e", action="store_true")
    ap.add_argument("--f", action="store_true", help="a flag")
    ap.add_argument("--g", help="none by default: what happens then")
    ap.add_argument("--h-old", help=argparse.SUPPRESS)
    ap.add_argument("--i", default="runs/x", help="out (default: runs/x)")
    ap.add_argument("--j", type=float, default=0.0, help="a zero default is a default too")
    ap.add_argument("pos", help="positionals are not options")
    assert option_help_problems(ap) == ["--a: no help", "--b: help does not show its default 3 (add %(default)s)",
                                        "--d: help does not show its default 30 (add %(default)s)", "--e: no help",
                                        "--j: help does not show its default 0.0 (add %(default)s)"]


# --- Every command block is run by the doc test or says why not -----------------------------------------------------

def test_every_command_block_runs_or_says_why_not():
    from doc_commands import problems

    assert problems() == [], "\n".join(problems())


def test_command_block_checker_catches_what_it_should(tmp_path):
    from doc_commands import blocks, problems

    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "```bash\ndstrain train RECIPE\n```\n\n<!-- doc-test: form: the commands shapes -->\n```bash\ndstrain recipes\n```\n\n"
        "<!-- doc-test: long: quite a while -->\n```bash\ndstrain table\n```\n\n<!-- doc-test: later: soon enough -->\n"
        "```bash\ndstrain plan tiny_moe\n```\n\n```bash\ncurl http://example.org\nsbatch job.sh\n```\n\n"
        "```text\nnot a command\n```\n\n```bash\n# a comment\ndstrain data synthetic \\\n  --recipe tiny_moe  # c\n```\n")
    assert problems(tmp_path) == [
        "README.md:2: a placeholder in a block the doc test runs (mark the block form): dstrain train RECIPE",
        "README.md:7: marked form but has no placeholder: run it, or mark the block with what it needs: dstrain recipes",
        "README.md:11: doc-test long: say how long (quite a while)",
        "README.md:16: doc-test kind 'later' is not one of form, gpu, cluster, hub, long, suite, yours",
        "README.md:21: not a command the doc test knows how to run: curl http://example.org",
        "README.md:22: sbatch runs on a cluster: mark the block cluster",
    ]
    last = blocks(tmp_path / "README.md")[-1]
    assert last.commands == [(31, "dstrain data synthetic    --recipe tiny_moe  # c")]
