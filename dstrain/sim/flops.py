"""Work per step on each side of the channel, and the target:drafter rank ratio that balances them.

Matmul FLOPs (2 per multiply-add), as MFU counts them. Target, per training token: every active weight matrix but
the embedding and LM head, plus attention over the causal context (capped by a sliding window). Drafter, per
supervised position, forward and backward (3x): its layers on the block tokens, context fusion and k/v projections
on the deduplicated context rows, block attention, the three d x V vocabulary GEMMs of train/losses.py and the
Markov head's r x V one. The balancing ratio assumes equal FLOP/s per rank. The target side counts what its ranks
execute: without sequence parallelism each routed expert computes each token tp times (EP is carved from the TP
ranks), and uneven pipeline stages wait on the largest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class StepFlops:
    target_per_token: float  # the model's forward, each expert computing each token once
    target_per_sequence: float
    drafter_per_position: float
    drafter_per_sequence: float
    positions_per_sequence: int
    parts: dict[str, float]  # drafter FLOPs per supervised position by kind
    expert_work: float = 1.0  # times each routed expert computes each token on this layout (tp without SP)
    routed_per_token: float = 0.0  # routed-expert FLOPs per token, counted once
    pipeline_factor: float = 1.0  # pp * largest stage / layers: >1 when stages are uneven

    @property
    def target_executed_per_sequence(self) -> float:
        """What the target ranks spend per sequence: redundant expert work and the wait on the largest stage included."""
        seq = self.target_per_sequence / max(self.target_per_token, 1.0)
        return (self.target_per_sequence + (self.expert_work - 1) * self.routed_per_token * seq) * self.pipeline_factor

    @property
    def balanced_ratio(self) -> float:
        """Target ranks per drafter rank at which neither side waits (equal FLOP/s per rank)."""
        return self.target_executed_per_sequence / max(self.drafter_per_sequence, 1.0)


def sequence_parallel(recipe, sizes) -> bool:
    """The megatron target splits tokens over its TP ranks before the expert dispatch whenever tp > 1 with experts
    (megatron-core refuses TP with EP otherwise in training mode)."""
    return recipe.target.backend == "megatron" and recipe.world.target.tp > 1 and bool(sizes.num_experts)


def expert_work(recipe, sizes, sp: bool | None = None) -> float:
    """Times each routed expert computes each token: tp without sequence parallelism (every TP rank dispatches the
    same tokens), once with it."""
    sp = sequence_parallel(recipe, sizes) if sp is None else sp
    return 1.0 if sp or not sizes.num_experts else float(recipe.world.target.tp)


def stage_layers(recipe, num_layers: int) -> list[int]:
    """Layers per pipeline stage: world.target.pipeline_layers where the schema has it, else an equal split."""
    t = recipe.world.target
    table = getattr(t, "pipeline_layers", None)
    if table:
        return list(table)
    return [num_layers // t.pp + (1 if s < num_layers % t.pp else 0) for s in range(t.pp)]


def mean_context(seq: int, window: int | None) -> float:
    """Average number of keys a causal query sees over positions 1..seq (window-capped)."""
    if not window or window >= seq:
        return (seq + 1) / 2
    return (window * (window + 1) / 2 + (seq - window) * window) / seq


def attention_dims(cfg) -> tuple[int, int, int]:
    """(heads, q·k width, value width) per head; MLA widths where the config has them."""
    heads = cfg.num_attention_heads
    nope, rope = getattr(cfg, "qk_nope_head_dim", None), getattr(cfg, "qk_rope_head_dim", None)
    if nope and rope:
        return heads, nope + rope, getattr(cfg, "v_head_dim", nope)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return heads, hd, hd


def target_flops_per_token(cfg, sizes, seq: int) -> float:
    heads, qk, v = attention_dims(cfg)
    window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
    weights = 2 * (sizes.active_params - sizes.embed_params - sizes.vector_params)
    return weights + cfg.num_hidden_layers * 2 * mean_context(seq, window) * heads * (qk + v)


def _drafter_groups(drafter, num_experts: int, top_k: int) -> tuple[float, float, float]:
    """(per block-token weights, per context-row weights, Markov W2 numel) of a drafter built on meta. Names of both
    block backbones: the generic (fuse, k/v_proj, seq_head, ffn.w_*) and V4's (main_proj, attn.wkv, markov_w*,
    ffn.experts.*)."""
    token = ctx = w2 = 0.0
    for name, p in drafter.named_parameters():
        if not p.requires_grad:
            continue
        n = float(p.numel())
        if name.startswith("fuse.") or ".main_proj." in name:  # the context fusion: once per context row
            ctx += n
        elif name.endswith((".k_proj.weight", ".v_proj.weight", ".attn.wkv.weight")):  # context rows and block tokens
            ctx += n
            token += n
        elif name.endswith(("seq_head.w2", "seq_w2", "markov_w2.weight")):
            w2 += n
        elif "seq_head.w1" in name or "markov_w1" in name:  # an embedding lookup: no FLOPs
            continue
        elif (".ffn.w_" in name or ".ffn.experts." in name) and num_experts:  # routed experts: top-k of them per token
            token += n * top_k / num_experts
        elif p.dim() >= 2:
            token += n
    return token, ctx, w2


def _drafter_shape(drafter, dr) -> tuple[int, int, int | None, int | None]:
    """(routed experts (0: dense), top-k, attention heads, head size) of the built drafter: the V4 backbone's come from
    the target (its `dims`), the generic one's from the recipe and its layers."""
    dims = getattr(drafter, "dims", None)
    if dims is not None:
        return dims.experts, dims.topk, dims.heads, dims.head_dim
    experts = dr.ffn.num_experts if dr.ffn.type == "moe" else 0
    layer = drafter.layers[0] if hasattr(drafter, "layers") else None
    return experts, dr.ffn.top_k, getattr(layer, "heads", None), getattr(layer, "head_dim", None)


def step_flops(recipe, cfg, sizes, drafter, sp: bool | None = None) -> StepFlops:
    seq, d, vocab = recipe.data.max_length, sizes.hidden_size, sizes.vocab_size
    dr = recipe.drafter
    gamma, window, anchors = dr.block_size, dr.sliding_window, min(recipe.anchors.per_sequence, seq)
    positions = anchors * gamma
    ctx_rows = min(seq, anchors * (window or seq))  # deduplicated rows the drafter projects per sequence
    experts, top_k, heads, head_dim = _drafter_shape(drafter, dr)
    token_w, ctx_w, w2 = _drafter_groups(drafter, experts, top_k)
    heads = heads or 1
    head_dim = head_dim or d // heads
    keys = (min(window, seq) if window else mean_context(seq, None)) + gamma
    parts = {
        "vocab GEMMs (3 x d x V)": 3 * 2 * d * vocab,
        "Markov head (r x V)": 3 * 2 * w2,
        "drafter layers": 3 * 2 * token_w,
        "context rows": 3 * 2 * ctx_w * ctx_rows / positions,
        "block attention": 3 * dr.num_layers * 2 * keys * heads * head_dim * 2,
    }
    per_position = sum(parts.values())
    per_token = target_flops_per_token(cfg, sizes, seq)
    routed = 2 * sizes.expert_params * sizes.experts_per_token / sizes.num_experts if sizes.num_experts else 0.0
    stages = stage_layers(recipe, sizes.num_layers)
    return StepFlops(per_token, per_token * seq, per_position, per_position * positions, positions, parts,
                     expert_work(recipe, sizes, sp), routed, len(stages) * max(stages) / sizes.num_layers)


def meta_drafter(recipe, cfg, num_capture: int):
    from dstrain.drafters.contract import spec_from_config
    from dstrain.families.registry import build_drafter

    spec = spec_from_config(cfg, num_capture)
    with torch.device("meta"):
        return build_drafter(recipe.drafter, spec, torch.nn.Embedding(spec.vocab_size, spec.hidden_size), cfg)


def balance_verdict(flops: StepFlops, target_ranks: int, drafter_ranks: int, replicas: int = 1) -> tuple[str, str | None]:
    """A line on the layout's balance, and a warning when one side waits more than 2x on the other."""
    have = target_ranks / drafter_ranks
    want = flops.balanced_ratio
    line = (f"balanced target:drafter rank ratio {want:.2f}:1 (equal FLOP/s per rank assumed); "
            f"this layout has {target_ranks}:{drafter_ranks} = {have:.2f}:1")
    if have < want / 2:
        fix = "add target replicas (world.target.dp) or use fewer drafter ranks"
        if drafter_ranks == replicas:  # every replica feeds >= 1 drafter rank: the ratio cannot pass tp*pp
            fix = (f"each target replica feeds at least one drafter rank, so the ratio is at most tp*pp = "
                   f"{target_ranks // replicas}: raise world.target.tp/pp, or accept drafter ranks waiting")
        return line, f"WARNING: the target side is {want / have:.1f}x short of ranks: drafter ranks will wait on the channel; {fix}"
    if have > want * 2:
        return line, (f"WARNING: the drafter side is {have / want:.1f}x short of ranks: target ranks will wait on "
                      f"back-pressure; add drafter ranks (world.drafter_ranks) or use fewer target replicas")
    return line, None
