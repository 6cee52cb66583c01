"""Node-aware placement: whole-node worlds, TP groups inside a node, drafters on their own nodes, the node map the dry
run prints and `--print-world` hands to slurm/. Group membership is read from megatron's own HyperCommGrid, the grids
`target_process_groups` creates, not re-derived here."""

import math
import os
import random
import re
import subprocess
import sys

import pytest
from pydantic import ValidationError

from conftest import ROOT, free_port, run_tool
from dstrain.errors import UserError
from dstrain.config.schema import WorldConfig, load_recipe
from dstrain.runtime.node_map import node_lines, spans
from dstrain.runtime.world import Layout, check_node_size, layout_of, target_grids


def world(tp=1, pp=1, dp=1, ep=1, drafters=1, rpn=None, mode="disaggregated") -> WorldConfig:
    return WorldConfig(mode=mode, target={"tp": tp, "pp": pp, "dp": dp, "ep": ep}, drafter_ranks=drafters,
                       ranks_per_node=rpn)


def random_layouts(n: int, seed: int = 0):
    """Layouts the schema accepts, drawn at random (with the drafters of a second valid count beside each)."""
    rng, out = random.Random(seed), []
    while len(out) < n:
        rpn, tp = rng.choice([1, 2, 4, 8, 16]), rng.choice([1, 2, 4, 8])
        pp, dp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3, 4, 6, 8])
        ep = rng.choice([e for e in range(1, tp * dp + 1) if tp * dp % e == 0])
        drafters = rng.choice([rpn, 2 * rpn, math.lcm(rpn, dp), rng.randint(1, 32)])
        try:
            lay = layout_of(world(tp, pp, dp, ep, drafters, rpn))
        except (ValidationError, UserError):
            continue  # the schema refuses it (partial nodes, tp across nodes, drafters not a multiple of dp)
        out.append((lay, layout_of(world(tp, pp, dp, ep, drafters + math.lcm(rpn, dp), rpn))))
    return out


def rank_groups(lay: Layout, monkeypatch) -> tuple[list[list[int]], list[list[int]]]:
    """(TP groups, EP groups) exactly as target_process_groups enumerates them."""
    monkeypatch.setenv("WORLD_SIZE", str(lay.world_size))
    grid, experts = target_grids(lay)
    return grid.get_rank_enum("tp"), experts.get_rank_enum("ep")


def test_random_layouts_place_every_rank_once_and_keep_tp_groups_on_one_node(monkeypatch):
    checked = {"ep_in_node": 0, "ep_whole_nodes": 0}
    for lay, more_drafters in random_layouts(200):
        nodes = lay.node_map()
        ranks = [g["rank"] for n in nodes for g in n["gpus"]]
        assert ranks == list(range(lay.world_size)), lay  # each rank once, node by node
        assert all(len(n["gpus"]) == lay.ranks_per_node for n in nodes), lay  # whole nodes
        assert [g["gpu"] for n in nodes for g in n["gpus"]] == [lay.local_rank_of(r) for r in ranks]
        assert all(len({g["role"] for g in n["gpus"]}) == 1 for n in nodes), lay  # drafters never share a node
        where = {g["rank"]: g for n in nodes for g in n["gpus"]}
        tp_groups, ep_groups = rank_groups(lay, monkeypatch)
        for group in tp_groups:
            assert len({lay.node_of(r) for r in group}) == 1, (lay, group)
            assert [where[r]["tp"] for r in group] == list(range(lay.tp))  # the node map's tp rank is the group's
            assert len({(where[r]["replica"], where[r]["stage"]) for r in group}) == 1
        for group in ep_groups:
            assert [where[r]["ep"] for r in group] == list(range(lay.ep)), (lay, group)
            spanned = {lay.node_of(r) for r in group}
            if lay.ranks_per_node % lay.ep == 0:
                assert len(spanned) == 1, (lay, group)
                checked["ep_in_node"] += 1
            elif lay.ep % lay.ranks_per_node == 0:
                assert len(spanned) == lay.ep // lay.ranks_per_node, (lay, group)  # whole nodes, no partial one
                checked["ep_whole_nodes"] += 1
        # more drafters move the target by whole nodes only: same GPU, same groups, node index shifted
        shift = (more_drafters.drafters - lay.drafters) // lay.ranks_per_node
        target = [{**g, "rank": None, "node": g["node"] + shift} for n in nodes for g in n["gpus"] if g["role"] == "target"]
        moved = [{**g, "rank": None} for n in more_drafters.node_map() for g in n["gpus"] if g["role"] == "target"]
        assert target == moved, lay
        assert rank_groups(more_drafters, monkeypatch)[0] == [[r + shift * lay.ranks_per_node for r in g] for g in tp_groups]
    assert min(checked.values()) > 30, checked  # both EP cases were drawn


@pytest.mark.parametrize("overrides, needle, fixed", [
    (["world.ranks_per_node=8", "world.drafter_ranks=4"], "world.drafter_ranks=4 is not whole nodes", "world.drafter_ranks=8"),
    (["world.ranks_per_node=8", "world.drafter_ranks=12", "world.target.dp=3", "world.target.ep=8"],
     "world.drafter_ranks=12 is not whole nodes", "world.drafter_ranks=24"),
    (["world.ranks_per_node=8", "world.drafter_ranks=24", "world.target.dp=3", "world.target.tp=2", "world.target.ep=2"],
     "tp\\*pp\\*dp=6 ranks are not whole nodes", "world.target.dp=4"),
    (["world.ranks_per_node=4"], "world.target.tp=8 does not divide world.ranks_per_node=4", None),
    (["world.ranks_per_node=16", "world.drafter_ranks=8"], "world.drafter_ranks=8 is not whole nodes",
     "world.drafter_ranks=16"),
])
def test_layouts_that_leave_nodes_partial_are_refused_in_one_line_with_a_fix_that_works(overrides, needle, fixed):
    with pytest.raises(UserError, match=needle) as err:
        load_recipe("v4_flash", overrides)
    assert "\n" not in str(err.value)
    if fixed:
        assert fixed in str(err.value)
        load_recipe("v4_flash", [*overrides, fixed])  # the suggested setting is accepted


def test_colocated_worlds_are_whole_nodes_too():
    with pytest.raises(ValidationError, match="set world.target.dp=8 and world.drafter_ranks=8"):
        world(dp=6, drafters=6, rpn=8, mode="colocated")
    lay = layout_of(world(dp=16, drafters=16, rpn=8, mode="colocated"))
    assert node_lines(lay) == ["node 0: GPUs 0-7 colocated replicas 0-7", "node 1: GPUs 0-7 colocated replicas 8-15"]


def test_node_lines_name_roles_per_node_and_collapse_large_worlds():
    lay = Layout(tp=8, pp=1, dp=4, ep=32, drafters=8, disaggregated=True, ranks_per_node=8)
    assert node_lines(lay) == ["node 0: GPUs 0-7 drafters 0-7"] + [
        f"node {k + 1}: GPUs 0-7 target replica {k} stage 0 tp 0-7 ep {8 * k}-{8 * k + 7}" for k in range(4)]
    assert "EP groups (ep=32) across 4 nodes" in spans(lay) and "TP groups (tp=8) inside one node" in spans(lay)
    one_node = Layout(tp=2, pp=1, dp=1, ep=2, drafters=2, disaggregated=True)  # ranks_per_node null: one node
    assert node_lines(one_node) == ["node 0: GPUs 0-1 drafters 0-1; GPUs 2-3 target replica 0 stage 0 tp 0-1 ep 0-1"]
    big = Layout(tp=8, pp=2, dp=8, ep=16, drafters=16, disaggregated=True, ranks_per_node=8)
    assert node_lines(big) == ["nodes 0-1: GPUs 0-7 each, together drafters 0-15",
                               "nodes 2-9: GPUs 0-7 each, together target replicas 0-7 stage 0 tp 0-7 ep 0-15",
                               "nodes 10-17: GPUs 0-7 each, together target replicas 0-7 stage 1 tp 0-7 ep 0-15"]


def test_launch_with_another_node_size_is_refused(monkeypatch):
    lay = layout_of(load_recipe("v4_flash").world)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(UserError, match="world.ranks_per_node=8 but this launch runs 4 process\\(es\\) per node: run"
                                        " torchrun --nproc-per-node 8 on 9 node\\(s\\)"):
        check_node_size(lay)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    check_node_size(lay)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    check_node_size(layout_of(load_recipe(ROOT / "recipes/tiny_moe.yaml").world))  # null: no node constraint


# nodes, GPU memory, drafter nodes (V4-Pro's V4-native drafter, ~77B parameters, is ZeRO-3 over two nodes)
FLAGSHIPS = {"v4_flash": (9, 140, 1), "v4_pro": (18, 140, 2), "deepseek_v3": (5, 79.6, 1), "qwen3_moe": (3, 79.6, 1)}


@pytest.mark.parametrize("name", FLAGSHIPS)
def test_shipped_flagships_fill_whole_8_gpu_nodes_and_fit_their_gpus(name):
    from dstrain.plan import build_plan, format_plan, memory_verdict

    plan = build_plan(load_recipe(name))
    text = format_plan(plan, name)
    nodes, gpu, drafter_nodes = FLAGSHIPS[name]
    w = plan.recipe.world
    assert (w.ranks_per_node, w.gpu_memory_gib, w.world_size) == (8, gpu, 8 * nodes)
    assert f"{nodes} nodes of 8 GPUs: drafters on {drafter_nodes} node(s) of their own" in text and "inside one node; EP" in text
    listed = [line.strip() for line in text.splitlines() if re.match(r"nodes? \d", line.strip())]  # past 12: runs merge
    first = "node 0: GPUs 0-7 drafters 0-7" if drafter_nodes == 1 else f"nodes 0-{drafter_nodes - 1}: GPUs 0-7 each, together drafters 0-"
    assert len(listed) == nodes if nodes <= 12 else listed[0].startswith(first), listed
    assert "expert work per token: 1.00x (sequence parallel)" in text
    assert memory_verdict(plan) is None and "OVER" not in text
    assert all(sum(parts.values()) < gpu for parts in plan.memory.values())


def test_dry_run_prints_the_whole_plan_then_refuses_a_rank_over_its_gpu_in_one_line():
    proc = run_tool("-m", "dstrain", "plan", "deepseek_v3", "world.gpu_memory_gib=40", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "node 4: GPUs 0-7 target replica 3 stage 0 tp 0-7 ep 24-31" in proc.stdout
    assert "OVER]" in proc.stdout and "memory per rank (estimate) against world.gpu_memory_gib=40 GiB" in proc.stdout
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "a target rank needs ~44.0 GiB (dry-run estimate) but world.gpu_memory_gib=40: widen" \
        " world.target.ep" in err[0], proc.stderr


def test_colocated_ranks_hold_target_and_drafter_against_one_gpu():
    from dstrain.plan import build_plan, format_plan, memory_verdict

    parts = [sum(p.values()) for p in build_plan(load_recipe(ROOT / "recipes/tiny_moe.yaml")).memory.values()]
    gpu = (max(parts) + sum(parts)) / 2  # each role's estimate fits, the rank holding both does not
    plan = build_plan(load_recipe(ROOT / "recipes/tiny_moe.yaml", [f"world.gpu_memory_gib={gpu}"]))
    assert memory_verdict(plan).startswith("a colocated rank needs ~")
    assert "each colocated rank holds both" in format_plan(plan, "tiny")


@pytest.mark.distributed
def test_torchrun_with_another_node_size_stops_before_any_process_group():
    """The check is wired into the launch: torchrun puts 2 processes on the node, the recipe says 1 per node."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(free_port()), "dstrain/main.py", "recipes/tiny_moe.yaml", "world.target.dp=2",
                           "world.drafter_ranks=2", "world.ranks_per_node=1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode != 0
    assert "world.ranks_per_node=1 but this launch runs 2 process(es) per node" in proc.stderr, proc.stderr[-2000:]


def test_sequence_parallel_splits_the_target_activations_and_dispatch_over_tp():
    """Under SP (megatron, tp > 1, experts) a TP rank holds 1/tp of the residual stream, captured layers and expert
    dispatch; without it (the hf backend's planned tp) each rank holds them whole."""
    from dstrain.plan import BYTES, build_plan

    layout = ["world.mode=disaggregated", "world.target.tp=2", "world.target.ep=2", "world.drafter_ranks=1"]
    sp = build_plan(load_recipe(ROOT / "recipes/tiny_moe.yaml", [*layout, "target.backend=megatron"]))
    whole = build_plan(load_recipe(ROOT / "recipes/tiny_moe.yaml", layout))
    a, b = sp.memory["target rank"], whole.memory["target rank"]
    assert a["expert dispatch"] * 2 == pytest.approx(b["expert dispatch"]) and a["expert dispatch"] > 0
    r, m = sp.recipe, len(sp.capture_layers)
    stream = r.train.micro_batch_size * r.data.max_length * sp.sizes.hidden_size * BYTES[r.target.dtype] * (m + 1) / 2**30
    assert b["activations"] - a["activations"] == pytest.approx(stream / 2)
