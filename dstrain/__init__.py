"""dstrain: distributed training of speculative-decoding drafters against frozen MoE targets."""

import os as _os

__version__ = "0.1.0"


# Device files of a loaded GPU driver (NVIDIA, AMD ROCm, WSL): without any, torch.cuda cannot be available.
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")


def _quiet_cpu_accelerator() -> None:
    # transformers imports DeepSpeed, which warns on every start that it fell back to the CPU when no
    # accelerator is named. Name it on machines without a GPU driver only; GPU machines keep DeepSpeed's
    # detection. Asked of the file system, not torch.cuda: importing torch here cost every command
    # (`dstrain --help` included) two seconds.
    if "DS_ACCELERATOR" in _os.environ:
        return
    if not any(_os.path.exists(p) for p in _GPU_DEVICE_FILES):
        _os.environ["DS_ACCELERATOR"] = "cpu"


_quiet_cpu_accelerator()
