"""The commands README.md and docs/*.md give a user to run: every line of a ```bash block, in order.

A block that cannot run as written on this machine says why on the line above its fence:
    <!-- doc-test: KIND: REASON -->
KIND is one of KINDS. `form` is a command's shape with placeholders in capitals (RECIPE, runs/NAME, N), not a command;
the others name what the block needs that a 2-core CI machine does not have, or that the suite already is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KINDS = {
    "form": "a command's shape, with placeholders in capitals",
    "gpu": "needs a GPU",
    "cluster": "needs a cluster (several nodes, Slurm)",
    "hub": "needs a download from a model or code hub",
    "long": "takes longer than the doc test allows (say how long)",
    "suite": "is the test suite or CI's own step",
    "yours": "needs your own model, recipe or files",
}
MARKER = re.compile(r"^<!--\s*doc-test:\s*(\w+)\s*:\s*(.*?)\s*-->\s*$")
PLACEHOLDER = re.compile(r"(?<![\w-])(?:[A-Z][A-Z0-9_]*[A-Z0-9]|N|M)(?![\w=-])|\[\.\.\.\]|\.\.\.")
# what a runnable line may start with: the dstrain command (any folder), torchrun, or a repository-root command
STARTS = ("dstrain ", "torchrun ", "python -m dstrain", "make ", "pip ", "python tools/", ".venv/bin/", "sbatch ")
FROM_REPOSITORY = ("make ", "pip ", "python tools/", ".venv/bin/")


@dataclass
class Block:
    doc: Path
    line: int  # of the opening fence
    commands: list[tuple[int, str]] = field(default_factory=list)  # (doc line, command with its continuations)
    kind: str | None = None
    reason: str = ""
    root: Path = ROOT

    @property
    def where(self) -> str:
        return f"{self.doc.relative_to(self.root)}:{self.line}"


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """Every ```bash block of a page, with its marker and its commands (a `\\` continuation joins lines; blank lines
    and whole-line comments are not commands)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    found, i = [], 0
    while i < len(lines):
        fence = re.match(r"^\s*```(\w*)\s*$", lines[i])
        if not fence:
            i += 1
            continue
        start, lang, body = i, fence.group(1), []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            body.append((i + 1, lines[i]))
            i += 1
        i += 1
        if lang not in ("bash", "sh", "shell"):
            continue
        prev = next((lines[k] for k in range(start - 1, -1, -1) if lines[k].strip()), "")
        marker = MARKER.match(prev.strip())
        block = Block(path, start + 1, kind=marker.group(1) if marker else None, reason=marker.group(2) if marker else "",
                      root=root)
        pending, first = "", 0
        for number, text in body:
            if not pending and (not text.strip() or text.lstrip().startswith("#")):
                continue
            if text.rstrip().endswith("\\"):
                pending, first = pending + text.rstrip()[:-1] + " ", first or number
                continue
            block.commands.append((first or number, pending + text))
            pending, first = "", 0
        found.append(block)
    return found


def without_comment(command: str) -> str:
    """The command before a trailing `# comment` (outside quotes)."""
    quote = None
    for k, ch in enumerate(command):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or command[k - 1].isspace()):
            return command[:k].rstrip()
    return command.rstrip()


def problems(root: Path = ROOT) -> list[str]:
    """Blocks the doc test could neither run nor skip for a stated reason."""
    out = []
    for doc in doc_files(root):
        for block in blocks(doc, root):
            if block.kind is not None and block.kind not in KINDS:
                out.append(f"{block.where}: doc-test kind '{block.kind}' is not one of {', '.join(KINDS)}")
            elif block.kind is not None and len(block.reason) < 8:
                out.append(f"{block.where}: doc-test {block.kind} needs a reason (what it needs, how long)")
            elif block.kind == "long" and not re.search(r"\d+\s*(?:s|min|minutes?|h|hours?)\b", block.reason):
                out.append(f"{block.where}: doc-test long: say how long ({block.reason})")
            for number, command in block.commands:
                text = without_comment(command).strip()
                if not text.startswith(STARTS):
                    out.append(f"{block.doc.relative_to(root)}:{number}: not a command the doc test knows how to run: {text}")
                elif block.kind == "form" and not PLACEHOLDER.search(text):
                    out.append(f"{block.doc.relative_to(root)}:{number}: marked form but has no placeholder: run it, or"
                               f" mark the block with what it needs: {text}")
                elif block.kind is None and PLACEHOLDER.search(text):
                    out.append(f"{block.doc.relative_to(root)}:{number}: a placeholder in a block the doc test runs"
                               f" (mark the block form): {text}")
                elif block.kind is None and text.startswith("sbatch "):
                    out.append(f"{block.doc.relative_to(root)}:{number}: sbatch runs on a cluster: mark the block cluster")
    return out


def runnable(root: Path = ROOT) -> dict[Path, list[Block]]:
    """Per page, the blocks the doc test runs, in order."""
    return {doc: [b for b in blocks(doc) if b.kind is None and b.commands] for doc in doc_files(root)}
