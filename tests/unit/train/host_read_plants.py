"""Defects planted in the megatron target for the meta-device check (test_host_reads.py): run by
`python -m dstrain.testing.meta_targets --plant THIS_FILE`, so the planted lines sit in tests/ and the check must name
them. Which defects: the DSTRAIN_PLANT environment variable (comma-separated)."""

import os

import torch


def _synchronize_in_forward():
    from dstrain.targets.megatron import MegatronTarget

    forward = MegatronTarget.forward

    def planted(self, *args, **kwargs):
        torch.cuda.synchronize()  # planted: a wait for the device in the target's forward
        return forward(self, *args, **kwargs)

    MegatronTarget.forward = MegatronTarget.__call__ = planted


def _float_in_v4_router():
    from dstrain.families.deepseek_v4.model import V4Router

    routing = V4Router.routing

    def planted(self, logits, *args, **kwargs):
        float(logits.sum())  # planted: a scalar read in dstrain's router, called from megatron's MoE layer
        return routing(self, logits, *args, **kwargs)

    V4Router.routing = planted


for name in os.environ["DSTRAIN_PLANT"].split(","):
    {"sync": _synchronize_in_forward, "router-float": _float_in_v4_router}[name]()
