"""How many GPUs the frozen target needs when vLLM serves it as released, beside megatron's BF16 copy.

Weights as served: the release's bits per weight (its family.json `release_bits`: experts and the rest; embedding
and LM head BF16); megatron dequantises every weight to BF16. A replica holds its weights in at most WEIGHT_SHARE of
each GPU's memory (the rest is vLLM's KV cache and activations), in whole powers of two up to a node, then whole
nodes. The features the drafters consume set a second floor: each drafter rank works through a sequence's training
step in drafter_FLOPs / (PEAK · MFU) seconds, each target GPU prefills target_FLOPs_per_token / (PEAK · MFU) per token;
both at the same assumed utilisation, so the ratio, not the constant, decides the count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dstrain import capabilities

# The hand-over (engine → drafter ranks): each token's m captured layers and its final pre-norm state, d wide, in the
# engine's BF16 (dstrain/targets/vllm.py: vLLM's ids [i + 1 for each capture layer] + [num_layers]), and its token id.
NIC_GBPS = 400  # per GPU: one 400 Gb/s NIC (ConnectX-7) per GPU on DGX/HGX H100 and H200 nodes' compute fabric
FIELD_TOKENS_PER_S = 125_000  # speculators' GB300 run: 9 vLLM nodes serving GLM 5.2 FP8 prefilled 125k tokens/s
WEIGHT_SHARE = 0.7  # of a GPU's memory for weights; vLLM's default gpu_memory_utilization (0.9) keeps the rest for KV
PEAK_BF16 = 989e12  # H100 / H200 dense BF16 FLOP/s
MFU = 0.4  # assumed for both sides


@dataclass
class Served:
    served_gib: float  # weights as released
    bf16_gib: float  # what megatron holds
    bits: dict | None
    gpus_served: int  # GPUs per vLLM replica (memory floor)
    gpus_bf16: int  # GPUs for one BF16 replica (memory floor)
    tokens_per_s_needed: float  # features the drafter ranks consume
    tokens_per_s_per_gpu: float  # what one target GPU prefills
    gpus_for_features: int  # target GPUs that prefill as fast as the drafters consume
    handover_bytes_per_token: int  # what the engine puts in the store per token


def handover_bytes(hidden: int, captured: int) -> int:
    """Bytes a served token hands over: its captured layers and final state in BF16, and its int32 token id."""
    return (captured + 1) * hidden * 2 + 4


def _gpus(gib: float, per_gpu: float, per_node: int) -> int:
    need = max(1, math.ceil(gib / (per_gpu * WEIGHT_SHARE)))
    if need <= per_node:
        return 1 << (need - 1).bit_length()  # tensor-parallel sizes are powers of two
    return per_node * math.ceil(need / per_node)


def served(plan) -> Served | None:
    """None without world.gpu_memory_gib (nothing to size against)."""
    w, s, f = plan.recipe.world, plan.sizes, plan.flops
    if not w.gpu_memory_gib:
        return None
    cap = capabilities.of_config(plan.target_config)
    bits = cap.release_bits if cap is not None else None
    expert_bits, other_bits = (bits["experts"], bits["other"]) if bits else (16, 16)
    other = s.params - s.expert_params - s.embed_params
    served_b = s.expert_params * expert_bits / 8 + other * other_bits / 8 + s.embed_params * 2
    per_node = w.ranks_per_node or 8
    rate = PEAK_BF16 * MFU
    need = w.drafter_ranks * plan.recipe.data.max_length * rate / f.drafter_per_sequence
    per_gpu = rate / f.target_per_token
    return Served(served_b / 2**30, s.params * 2 / 2**30, bits, _gpus(served_b / 2**30, w.gpu_memory_gib, per_node),
                  _gpus(s.params * 2 / 2**30, w.gpu_memory_gib, per_node), need, per_gpu, math.ceil(need / per_gpu),
                  handover_bytes(s.hidden_size, len(plan.capture_layers)))


def served_lines(plan) -> list[str]:
    """`dstrain plan`'s `vllm` section: the target as vLLM would serve it against megatron's BF16 copy."""
    v = served(plan)
    if v is None:
        return []
    what = v.bits["source"] if v.bits else "no release_bits in its family.json: BF16 assumed"
    gpus = lambda replica: max(replica, replica * math.ceil(v.gpus_for_features / replica))  # noqa: E731
    return [f"  vllm     as served (target.backend=vllm, the release's weights: {what}): {v.served_gib:.1f} GiB -> "
            f"{v.gpus_served} GPU(s) per replica; megatron's BF16 copy {v.bf16_gib:.1f} GiB -> {v.gpus_bf16}",
            f"           the drafter ranks consume ~{v.tokens_per_s_needed:,.0f} target tokens/s, one target GPU prefills "
            f"~{v.tokens_per_s_per_gpu:,.0f} (both at {MFU:.0%} of {PEAK_BF16 / 1e12:.0f} TFLOP/s): target GPUs to keep "
            f"up: vLLM {gpus(v.gpus_served)}, megatron BF16 {gpus(v.gpus_bf16)} (whole replicas)",
            *handover_lines(plan, v)]


def handover_lines(plan, v: Served) -> list[str]:
    """The hand-over's bytes per second, per replica at its prefill rate and at the field's 125k tokens/s, against the
    NICs a replica's features leave its node through (drafter ranks on nodes of their own)."""
    per_token, m = v.handover_bytes_per_token, len(plan.capture_layers)
    replica_rate = v.tokens_per_s_per_gpu * v.gpus_served
    replica_bps, link_bps = replica_rate * per_token, v.gpus_served * NIC_GBPS * 1e9 / 8
    field_bps = FIELD_TOKENS_PER_S * per_token
    return [f"           hand-over: ({m} captured + final) x d {plan.sizes.hidden_size} x 2 B + the token id = "
            f"{per_token / 1024:.1f} KiB a token; a replica prefilling ~{replica_rate:,.0f} tokens/s puts "
            f"{replica_bps / 1e9:.2f} GB/s, {replica_bps / link_bps:.1%} of its {v.gpus_served} GPUs' NICs "
            f"({v.gpus_served} x {NIC_GBPS} Gb/s); at {FIELD_TOKENS_PER_S:,} tokens/s (speculators' GLM 5.2 run) all "
            f"replicas put {field_bps / 1e9:.2f} GB/s"]
