"""The house's import contract: packages in layers, each importing only from layers below it or from itself; no
cycle between modules or between packages; no product module importing test code. Imports inside functions count
(they keep the command fast to start, and would otherwise hide a loop)."""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

# Lowest first. A package may import its own modules and any package of a lower layer.
LAYERS: list[tuple[str, ...]] = [
    ("dstrain", "dstrain.errors", "dstrain.once", "dstrain.devices", "dstrain.progress", "dstrain.verify", "dstrain.capabilities"),
    ("dstrain.config",),
    ("dstrain.transport",),
    ("dstrain.layers",),
    ("dstrain.packing",),
    ("dstrain.drafters",),
    ("dstrain.targets",),
    ("dstrain.families",),
    ("dstrain.data",),
    ("dstrain.runtime",),
    ("dstrain.sim",),
    ("dstrain.eval",),
    ("dstrain.export",),
    ("dstrain.train",),
    ("dstrain.plan",),
    ("dstrain.reproduce",),
    ("dstrain.testing",),
    ("dstrain.cli",),
    ("dstrain.main", "dstrain.__main__"),
]
TEST_ONLY = ("dstrain.testing",)


def modules(root: Path) -> dict[str, Path]:
    """Module name -> file, for every .py under root/dstrain."""
    found = {}
    for path in sorted((root / "dstrain").rglob("*.py")):
        name = ".".join(path.relative_to(root).with_suffix("").parts)
        found[name.removesuffix(".__init__")] = path
    return found


def imports(root: Path) -> tuple[dict[str, set[str]], int, int]:
    """Module -> the dstrain modules it imports; and how many import statements there are, and how many sit in a
    function."""
    mods = modules(root)

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    total = inside = 0
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        in_func = {id(n) for f in funcs for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                wanted = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                wanted = [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            total += 1
            inside += id(node) in in_func
            for w in wanted:
                target = resolve(w) if w.split(".")[0] == "dstrain" else None
                if target and target != name:
                    edges[name].add(target)
    return edges, total, inside


def package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def cycles(nodes, edges) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def layer_of(module: str) -> int | None:
    for depth, names in enumerate(LAYERS):
        if module in names or package(module) in names:
            return depth
    return None


def problems(root: Path) -> list[str]:
    """Every breach of the contract under root, one line each (empty: the house holds)."""
    mods = modules(root)
    edges, _, _ = imports(root)
    out = [f"module cycle: {' -> '.join(c)}" for c in cycles(mods, edges)]
    pkg_edges: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if package(a) != package(b):
                pkg_edges[package(a)].add(package(b))
    out += [f"package cycle: {' -> '.join(c)}" for c in cycles({package(m) for m in mods}, pkg_edges)]
    for a in sorted(mods):
        if layer_of(a) is None:
            out.append(f"{a}: its package is in no layer of dstrain/testing/import_contract.py LAYERS")
    for a, targets in sorted(edges.items()):
        for b in sorted(targets):
            la, lb = layer_of(a), layer_of(b)
            if package(a) == package(b) or la is None or lb is None:
                continue
            if package(b) in TEST_ONLY and package(a) not in TEST_ONLY:
                out.append(f"{a} imports test code {b}")
            elif lb > la:
                out.append(f"{a} (layer {la}) imports {b} (layer {lb}): a lower layer may not import a higher one")
    return out


def main() -> int:
    root = Path(__file__).resolve().parents[2]
    edges, total, inside = imports(root)
    found = problems(root)
    print(f"{len(modules(root))} modules, {sum(map(len, edges.values()))} edges; {total} import statements, {inside} "
          f"inside functions")
    print("\n".join(found) if found else "import contract holds: no cycles, every import points down the layers")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
