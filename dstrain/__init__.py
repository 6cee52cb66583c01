"""dstrain: distributed training of speculative-decoding drafters against frozen MoE targets."""

import os as _os

__version__ = "0.1.0"


def _quiet_cpu_accelerator() -> None:
    # transformers imports DeepSpeed, which warns on every start that it fell back to the CPU when no
    # accelerator is named. Name it on CUDA-less machines only; GPU machines keep DeepSpeed's detection.
    if "DS_ACCELERATOR" in _os.environ:
        return
    import torch

    if not torch.cuda.is_available():
        _os.environ["DS_ACCELERATOR"] = "cpu"


_quiet_cpu_accelerator()
