"""The node map as the dry run prints it: one line per node (runs of alike nodes collapsed on large worlds), and
which groups cross nodes. Reads only `Layout` arithmetic (runtime/world.py), so it needs no processes."""

from __future__ import annotations

COLLAPSE_ABOVE = 12  # nodes: more than this and runs of alike nodes share one line


def ranges(values) -> str:
    """Sorted distinct ints as compact ranges: [0, 1, 2, 3, 8] -> '0-3,8'."""
    vals = sorted(set(values))
    out, start = [], None
    for i, v in enumerate(vals):
        start = v if start is None else start
        if i + 1 == len(vals) or vals[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v > start else f"{v}")
            start = None
    return ",".join(out)


def _plural(word: str, values) -> str:
    return f"{word}{'s' if len(set(values)) > 1 else ''} {ranges(values)}"


def _what(gpus: list[dict]) -> str:
    """What a run of same-role GPUs does."""
    role = gpus[0]["role"]
    if role == "drafter":
        return _plural("drafter", [g["drafter"] for g in gpus])
    if role == "colocated":
        return "colocated " + _plural("replica", [g["drafter"] for g in gpus])
    return ("target " + _plural("replica", [g["replica"] for g in gpus]) + " " + _plural("stage", [g["stage"] for g in gpus])
            + f" tp {ranges(g['tp'] for g in gpus)} ep {ranges(g['ep'] for g in gpus)}")


def _runs(gpus: list[dict]) -> list[list[dict]]:
    out: list[list[dict]] = []
    for g in gpus:
        if out and out[-1][-1]["role"] == g["role"]:
            out[-1].append(g)
        else:
            out.append([g])
    return out


def _gpus(run: list[dict]) -> str:
    first, last = run[0]["gpu"], run[-1]["gpu"]
    return f"GPUs {first}-{last}" if last > first else f"GPU {first}"


def node_line(node: dict) -> str:
    return f"node {node['node']}: " + "; ".join(f"{_gpus(r)} {_what(r)}" for r in _runs(node["gpus"]))


def _shape(node: dict) -> tuple:
    """What two nodes must share to be printed as one line: roles, and for target nodes stages and tp ranks."""
    g = node["gpus"]
    if g[0]["role"] != "target" or len(_runs(g)) > 1:
        return (tuple(x["role"] for x in g), len(g))
    return ("target", len(g), tuple(sorted({x["stage"] for x in g})), tuple(sorted({x["tp"] for x in g})))


def node_lines(layout) -> list[str]:
    nodes = layout.node_map()
    if len(nodes) <= COLLAPSE_ABOVE:
        return [node_line(n) for n in nodes]
    lines, i = [], 0
    while i < len(nodes):
        j = i
        while j + 1 < len(nodes) and _shape(nodes[j + 1]) == _shape(nodes[i]):
            j += 1
        if j == i:
            lines.append(node_line(nodes[i]))
        else:
            gpus = [g for n in nodes[i:j + 1] for g in n["gpus"]]
            lines.append(f"nodes {i}-{j}: {_gpus(nodes[i]['gpus'])} each, together {_what(gpus)}")
        i = j + 1
    return lines


def spans(layout) -> str:
    """How many nodes the widest TP and EP group crosses: the traffic that leaves a node."""
    if not layout.ranks_per_node:
        return f"one node holds all {layout.world_size} rank(s) (world.ranks_per_node=null)"
    if not layout.disaggregated:
        return f"{layout.nodes} node(s) of {layout.node_size} GPUs; one whole target replica + drafter per GPU"
    tp_groups: dict = {}
    ep_groups: dict = {}
    for r in range(layout.target_offset, layout.world_size):
        tp, dp, pp = layout.coords(r)
        tp_groups.setdefault((pp, dp), set()).add(layout.node_of(r))
        ep_groups.setdefault((pp, layout.ep_coords(r)[1]), set()).add(layout.node_of(r))
    t, e = (max(map(len, g.values())) for g in (tp_groups, ep_groups))
    d = -(-layout.drafters // layout.node_size)
    return (f"{layout.nodes} nodes of {layout.node_size} GPUs: drafters on {d} node(s) of their own, target on"
            f" {layout.nodes - d}; TP groups (tp={layout.tp}) " + ("inside one node" if t == 1 else f"across {t} nodes")
            + f"; EP groups (ep={layout.ep}) " + ("inside one node" if e == 1 else f"across {e} nodes (the all-to-all"
                                                   " leaves the node)"))
