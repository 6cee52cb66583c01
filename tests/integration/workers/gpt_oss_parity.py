"""torchrun worker (4 ranks): gpt-oss on megatron-core equals transformers' GptOssForCausalLM.

Every rank builds the same random tiny gpt-oss (tiny_checkpoints.GPT_OSS: sinks, alternating sliding / full
attention, clamped SwiGLU with biases, YaRN, top-4 of 8 experts) and writes it twice: in the release layout (MXFP4
experts, `X_blocks` / `X_scales`) and as save_pretrained's fused unquantised tensors holding the same (MXFP4) values.
The reference is transformers' own fp32 load of the release folder (the hf backend's loader; transformers
dequantises MXFP4 on the CPU). MegatronTarget is built from each folder's config (the registry picks the gpt-oss
adapter; each rank reads only its plan's slices) at TP=2 × EP=2 × PP=2 on the four ranks (EP spans the two tensor
ranks of a stage; sequence parallel), with even stages [2, 2] and uneven [1, 3]; one forward of 3 × 17 tokens, and
the captured layers and final pre-LM-head states are compared with HFTarget's. Prints one JSON line after "PARITY ":
the shared layout_report per layout and case, the max |Δ| per captured layer (and "final") of the release per layout,
and the patches applied.
"""

import os
import sys
from functools import partial

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))
from tiny_configs import megatron_parity  # noqa: E402

from dstrain.targets.hf import load_hf_model  # noqa: E402
from dstrain.testing.tiny_checkpoints import gpt_oss_model, write_gpt_oss  # noqa: E402


def main() -> None:
    # written before the process group exists (each rank its own copy, as the V3 and Kimi workers do); the first
    # writer leaves the model's experts holding the MXFP4 values, which the second writes unquantised
    megatron_parity("gptossparity", gpt_oss_model(seed=7), "gpt-oss",
                    {"mxfp4_release": write_gpt_oss, "save_pretrained": partial(write_gpt_oss, mxfp4=False)},
                    reference=lambda folders: load_hf_model(folders[0]))


if __name__ == "__main__":
    main()
