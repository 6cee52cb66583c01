"""torchrun worker (4 ranks): MiniMax-M2 on megatron-core equals transformers' MiniMaxM2ForCausalLM.

Every rank builds the same random tiny MiniMax-M2 (tiny_minimax_m2.MINIMAX_M2: whole-projection q/k norm, partial
RoPE, sigmoid routing with a score-correction bias, top-4 of 8 experts) and writes it in the release layout twice:
FP8 blocks (`weight_scale_inv`) and unquantised, holding the same (FP8) values. The reference is that transformers
model, single-process, fp32. MegatronTarget is built from each folder's config (the registry picks the MiniMax-M2
adapter; each rank reads only its plan's slices) at TP=2 × EP=2 × PP=2 on the four ranks (sequence parallel), with
even stages [2, 2] and uneven [1, 3]; one forward of 3 × 17 tokens, compared with HFTarget's captured layers and final
pre-LM-head states. Prints one JSON line after "PARITY ": the shared layout_report per layout and case, the max |Δ|
per captured layer (and "final") of the FP8 release per layout, and the patches applied.
"""

import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from tiny_configs import megatron_parity  # noqa: E402

from dstrain.testing.tiny_minimax_m2 import minimax_m2_model, write_minimax_m2  # noqa: E402


def main() -> None:
    # the first writer leaves the model holding the FP8 values, which the second writes unquantised
    megatron_parity("minimaxparity", minimax_m2_model(seed=7), "minimax-m2",
                    {"fp8_release": write_minimax_m2, "unquantised_release": partial(write_minimax_m2, fp8=False)})


if __name__ == "__main__":
    main()
