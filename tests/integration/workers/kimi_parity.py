"""torchrun worker (4 ranks): Kimi K2.5 on megatron-core equals transformers' Kimi_K25ForConditionalGeneration.

Every rank builds the same random tiny Kimi K2.5 (tiny_checkpoints.KIMI_K25: every V3 feature on at K2's choices;
weights ×3, random e_score_correction_bias) and writes it in the release layout (language_model.* prefix, vision
tower beside, routed experts INT4 pack-quantized); the model's experts then hold exactly the INT4 values, so the
transformers model is the reference the folder means. MegatronTarget is built over a CheckpointReader of that folder
from the composite config (the registry picks the Kimi adapter) at TP=2 × EP=2 × PP=2 on the four ranks (EP spans
the two tensor ranks of a stage), with even stages [2, 2] and uneven [1, 3]; one forward, and the captured layers
and final pre-LM-head states are compared with HFTarget's. Prints one JSON line after "PARITY ": the shared
layout_report, the max |Δ| per captured layer (and "final") per layout, and rank 0's sensitivities.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from tiny_configs import megatron_parity, parity_ids  # noqa: E402

from dstrain.targets.hf import HFTarget  # noqa: E402
from dstrain.testing.tiny_checkpoints import kimi_k25_model, write_kimi_k25  # noqa: E402


def sensitivity(hf, original: dict) -> dict:
    """How far transformers' own output moves when the INT4 rounding, the expert bias or the routed scaling is
    dropped: each must dwarf the tolerance, or the parity could not tell whether megatron honours it."""
    ids = parity_ids()
    ref = HFTarget(hf, "kimi")(ids).final_hidden
    gates = [m for name, m in hf.named_modules() if name.endswith("mlp.gate")]
    int4 = {k: v.clone() for k, v in hf.state_dict().items() if ".experts." in k}
    out = {}
    with torch.no_grad():
        hf.load_state_dict(original, strict=False)
        out["int4_values"] = (HFTarget(hf, "kimi")(ids).final_hidden - ref).abs().max().item()
        hf.load_state_dict(int4, strict=False)
    for name, attr, value in (("expert_bias", "e_score_correction_bias", None), ("routed_scaling", "routed_scaling_factor", 1.0)):
        saved = [getattr(g, attr) for g in gates]
        for g in gates:
            setattr(g, attr, torch.zeros_like(g.e_score_correction_bias) if value is None else value)
        out[name] = (HFTarget(hf, "kimi")(ids).final_hidden - ref).abs().max().item()
        for g, v in zip(gates, saved):
            setattr(g, attr, v)
    return out


def main() -> None:
    # written before the process group exists (each rank its own copy, as the V3 worker does); the writer leaves the
    # model's experts holding the INT4 values
    hf = kimi_k25_model(seed=7, widen=3.0, bias=0.3)
    original = {k: v.clone() for k, v in hf.state_dict().items() if ".experts." in k}
    megatron_parity("kimiparity", hf, "kimi", {"int4_release": write_kimi_k25}, config=lambda folder: hf.config,
                    extra=lambda: {"sensitivity": sensitivity(hf, original)})


if __name__ == "__main__":
    main()
