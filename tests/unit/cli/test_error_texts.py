"""The error lines docs/troubleshooting.md documents are the ones the code prints: every literal stretch of each
documented message stands in one of dstrain's string literals (an f-string's fields may stand for a stretch of up
to half of it: the doc writes `dstrain data shards` where the code says {make_with}). Lines other programs print
(sbatch's) are not ours to check."""

import ast
import re
from functools import lru_cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
DOC = ROOT / "docs" / "troubleshooting.md"
FIELD = "\x00"  # an f-string's {…}: any text
# what the doc writes for a variable part: capitals (PATH, N, F1), an ellipsis
PLACEHOLDER = re.compile(r"…|\.\.\.|(?<!\w)[A-Z][A-Z0-9_]*(?:\.[A-Z][A-Z0-9_]*)*(?!\w)|: |\s*[()]\s*")  # ": " and brackets: where messages join parts
MIN_STRETCH = 12
OTHER_PROGRAMS = ("sbatch:",)


def documented_messages(path: Path = DOC) -> list[tuple[int, str]]:
    """(line, message) for each code span in the first cell of the doc's tables."""
    found = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.startswith("| `"):
            continue
        cell = re.split(r"(?<!\\)\|", line)[1]
        for m in re.finditer(r"`((?:\\`|[^`])+)`", cell):
            found.append((number, m.group(1).replace("\\`", "`")))
    return found


def _text(node, constants: dict) -> str | None:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else constants.get(getattr(v.value, "id", None), FIELD)
                       for v in node.values)
    return None


def _module_constants(tree) -> dict[str, str]:
    return {a.targets[0].id: a.value.value for a in tree.body
            if isinstance(a, ast.Assign) and len(a.targets) == 1 and isinstance(a.targets[0], ast.Name)
            and isinstance(a.value, ast.Constant) and isinstance(a.value.value, str)}


@lru_cache(maxsize=None)
def code_strings(root: Path = ROOT) -> tuple[str, ...]:
    paths = sorted((root / "dstrain").rglob("*.py"))
    trees = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): ast.parse(p.read_text(
        encoding="utf-8")) for p in paths}
    own = {module: _module_constants(tree) for module, tree in trees.items()}
    out = []
    for module, tree in trees.items():
        # an f-string's {NAME} prints the module-level NAME = "text" of its own module, or of the one it came from
        constants = dict(own[module])
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in own:
                constants.update({a.asname or a.name: own[node.module][a.name] for a in node.names
                                  if a.name in own[node.module]})
        for node in ast.walk(tree):
            text = _text(node, constants)
            if text and len(text.replace(FIELD, "")) >= 8:
                out.append(" ".join(text.split()))
    return tuple(out)


def field_chars_needed(stretch: str, code: str) -> int | None:
    """The fewest characters of `stretch` that f-string fields must stand for so that it appears inside `code`."""
    inf = len(stretch) + 1
    row = [0] * (len(code) + 1)  # row[j]: cost of matching stretch[:i] ending just before code[j]
    for i, ch in enumerate(stretch):
        nxt = [inf] * (len(code) + 1)
        for j, c in enumerate(code):
            if row[j] >= inf:
                continue
            if c == FIELD:
                nxt[j] = min(nxt[j], row[j] + 1)  # the field takes this character
                row[j + 1] = min(row[j + 1], row[j])  # or ends here (a later field or literal goes on)
            elif c == ch:
                nxt[j + 1] = min(nxt[j + 1], row[j])
        row = nxt
    best = min(row)
    return None if best >= inf else best


def stretches(message: str) -> list[str]:
    return [s.strip() for s in PLACEHOLDER.split(message) if len(s.strip()) >= MIN_STRETCH]


def unbacked(message: str, strings=None) -> list[str]:
    """The stretches of a documented message that no code string says."""
    strings = code_strings() if strings is None else strings
    missing = []
    for stretch in stretches(" ".join(message.split())):
        grams = {stretch[k:k + 6] for k in range(0, max(1, len(stretch) - 5))}
        allowed = len(stretch) // 2
        if not any(any(g in s for g in grams) and (cost := field_chars_needed(stretch, s)) is not None and cost <= allowed
                   for s in strings):
            missing.append(stretch)
    return missing


def test_every_documented_error_is_one_the_code_prints():
    messages = documented_messages()
    assert len(messages) >= 40, "the troubleshooting tables were not read"
    problems = [f"docs/troubleshooting.md:{n}: `{m}`: no code says {unbacked(m)}" for n, m in messages
                if not m.startswith(OTHER_PROGRAMS) and unbacked(m)]
    assert problems == [], "\n".join(problems)


def test_the_check_catches_a_message_the_code_does_not_print():
    code = ("data.shards \x00: no manifest.json there; build shards with \x00", "recipe \x00: \x00")
    assert unbacked("data.shards DIR: no manifest.json there; build shards with dstrain data shards", code) == []
    assert unbacked("recipe PATH: no such file (shipped recipes are in recipes/)", code) == [
        "no such file", "shipped recipes are in recipes/"]
    assert unbacked("data.shards DIR: nothing there; build shards by hand please", code) == ["nothing there; build shards by hand please"]
