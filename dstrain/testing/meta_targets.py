"""The megatron target's forward at tp = pp = ep = 1 on `meta`, built and run as on CUDA (device "cuda:0"), for a GPT
family (Qwen3-MoE), DeepSeek-V3 and DeepSeek-V4; its host reads recorded (host_reads.py).

megatron-core asks torch.cuda itself (current_device, streams, the RNG tracker's CUDA generator) and allocates with
device="cuda": `cuda_as_meta()` answers for a one-GPU machine and sends every CUDA allocation and copy to meta. Its
MoE token dispatch reads split sizes on the host by design (the all-to-all dispatcher's `.cpu()` of tokens per
expert): the first such read of each MoE layer is listed as megatron's own and the layer's output stood in, so the
layers after it still run. Run in a process of its own (it starts a one-rank gloo world):
`python -m dstrain.testing.meta_targets --json OUT`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile

import torch
from torch.overrides import TorchFunctionMode

from dstrain.testing.host_reads import HostReads, KnownHostRead, cuda_branches

FAMILIES = ("qwen3_moe", "deepseek_v3", "deepseek_v4")
KNOWN = ("megatron/core/transformer/moe",)


def _cuda(device) -> bool:
    if isinstance(device, int):  # megatron passes torch.cuda.current_device()
        return True
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return isinstance(device, str) and device.startswith("cuda")


class _CudaAllocationsToMeta(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _cuda(kwargs.get("device")):
            kwargs["device"] = "meta"
        if func is torch.Tensor.cuda:
            return args[0].to("meta")
        if func is torch.Tensor.to and len(args) > 1 and _cuda(args[1]):
            args = (args[0], "meta", *args[2:])
        kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_as_meta():
    """One GPU that computes nothing: torch.cuda's queries answered, CUDA allocations on meta, the RNG tracker's CUDA
    generator kept as a seed, and the product's CUDA branches taken for meta tensors (host_reads.cuda_branches)."""
    from megatron.core.tensor_parallel import random as mrandom

    from dstrain.targets import cpu_compat

    gen = {"seed": 0}
    patches = {(torch.cuda, "set_device"): lambda device: None, (torch.cuda, "current_device"): lambda: 0,
               (torch.cuda, "is_available"): lambda: True, (torch.cuda, "device_count"): lambda: 1,
               (torch.cuda, "manual_seed"): lambda s: gen.update(seed=s),
               (torch.cuda, "get_rng_state"): lambda device="cuda": torch.tensor([gen["seed"]]),
               (mrandom, "_get_cuda_rng_state"): lambda *a, **k: torch.tensor([gen["seed"]]),
               (mrandom, "_set_cuda_rng_state"): lambda state, *a, **k: gen.update(seed=int(state[0]))}
    saved = {key: getattr(*key) for key in patches}
    streams = {name: getattr(torch.cuda, name) for name in ("Stream", "current_stream", "stream", "synchronize")}
    for (owner, name), fn in patches.items():
        setattr(owner, name, fn)
    cpu_compat._cuda_streams()  # CUDA streams as no-ops (megatron's dispatcher makes one at construction)
    torch.cuda.current_device = lambda: 0
    try:
        with cuda_branches("meta"), _CudaAllocationsToMeta():
            yield
    finally:
        for (owner, name), fn in saved.items():
            setattr(owner, name, fn)
        for name, fn in streams.items():
            setattr(torch.cuda, name, fn)


@contextlib.contextmanager
def _moe_layers_stood_in():
    """A MoE layer whose token dispatch reads the host (KnownHostRead) returns a stand-in of its output's shape."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    forward = MoELayer.forward

    def guarded(self, hidden_states, *args, **kwargs):
        try:
            return forward(self, hidden_states, *args, **kwargs)
        except KnownHostRead:
            return hidden_states * 1, None

    MoELayer.forward = guarded
    try:
        yield
    finally:
        MoELayer.forward = forward


def one_rank_groups():
    import torch.distributed as dist

    from dstrain.runtime.world import Layout, target_process_groups

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    return target_process_groups(Layout(1, 1, 1, 1, 0, True))


def target_forward(family: str, groups) -> dict:
    """Build `family`'s tiny random checkpoint as a megatron target on "cuda:0" (meta) in bf16 and run one forward."""
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.hf import random_model
    from dstrain.targets.megatron import MegatronTarget
    from dstrain.testing.tiny_checkpoints import FAMILIES as TINY

    hf = random_model(dict(TINY[family]), seed=7, dtype="float32")
    folder = tempfile.mkdtemp(prefix=f"meta-{family}-")
    hf.save_pretrained(folder)
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with cuda_as_meta(), _moe_layers_stood_in():
        with CheckpointReader(folder, torch.bfloat16) as reader:
            target = MegatronTarget(hf.config, reader, family, groups, capture_layers=[0, 1, 2], dtype="bfloat16",
                                    device="cuda:0")
        held = sorted({p.device.type for p in target.model.parameters()})
        ids = ids.to("cuda:0", non_blocking=True)  # the batch as the data path hands it over (train.step._to_device)
        reads = HostReads(known=KNOWN)
        with reads:
            out = target(ids)
    return {"family": family, "params_on": held, "captured": list(out.captured.shape),
            "output_on": out.final_hidden.device.type, "reads": reads.report(), "megatron_reads": reads.known_report()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help="default %(default)s")
    ap.add_argument("--json", help="write the results here (default: print them)")
    ap.add_argument("--plant", metavar="FILE", help="a Python file run first (a test planting a defect to be caught)")
    ap.add_argument("--unseeded", action="store_true", help="skip seeding megatron's CUDA RNG tracker, as before issue "
                    "38 (the forward must then fail)")
    args = ap.parse_args(argv)
    if args.plant:
        import runpy

        runpy.run_path(args.plant, run_name="plant")
    if args.unseeded:
        from dstrain.targets import megatron

        megatron.seed_rng_tracker = lambda *a, **k: None
    groups = one_rank_groups()
    results = [target_forward(f, groups) for f in args.families.split(",")]
    text = json.dumps(results, indent=1)
    if args.json:
        with open(args.json, "w") as fh:
            fh.write(text)
    else:
        print(text)
    return 1 if any(r["reads"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
