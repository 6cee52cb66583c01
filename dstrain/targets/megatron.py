"""megatron-core backend: a frozen GPTModel sharded tensor × pipeline × expert parallel.

Built from a Hugging Face folder (or a random tiny config) through megatron_weights' mapping, on the
target ranks' own process groups (a ProcessGroupCollection, so drafter ranks can share the world).
Forward hooks capture the chosen layers on the stage that owns them; the final pre-LM-head states
are the output of the last stage's final norm, where the forward stops: the LM head never runs on
the target side. Pipeline stages are chained with megatron's P2PCommunicator, one micro-batch at
a time, forward only.

Every target rank ends a forward holding `local_captured` (its stage's capture layers, [B, T, m_s, d])
and, on the last stage, `final_hidden`. Tensor ranks of a stage hold identical copies.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dstrain.errors import UserError
from dstrain.targets.base import TargetOutput, resolve_capture_layers
from dstrain.targets.hf import DTYPES


class _StopAtFinalNorm(Exception):
    pass


class MegatronTarget:
    def __init__(self, hf_model, name: str, groups, capture_layers: list[int] | None = None, num_capture: int = 3,
                 dtype: str = "float32"):
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        from dstrain.targets import cpu_compat
        from dstrain.targets import megatron_weights as mw

        cpu_compat.apply()
        cfg = hf_model.config
        self.name, self.hidden_size, self.vocab_size = name, cfg.hidden_size, cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        self.capture_layers = resolve_capture_layers(name, self.num_layers, capture_layers, num_capture)
        tp, pp, ep = groups.tp.size(), groups.pp.size(), groups.ep.size()
        mw.check_layout(cfg, tp, pp, ep)
        self.tp_rank, self.stage, self.stages = groups.tp.rank(), groups.pp.rank(), pp
        per_stage = self.num_layers // pp
        self.layer_offset = self.stage * per_stage
        self.first, self.last = self.stage == 0, self.stage == pp - 1
        self.local_layers = [i for i in self.capture_layers if self.layer_offset <= i < self.layer_offset + per_stage]

        tcfg = mw.transformer_config(cfg, tp, pp, ep, DTYPES[dtype])
        if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
            parallel_state._set_global_memory_buffer()  # the local attention borrows scratch space from it
        spec = get_gpt_layer_local_spec(num_experts=tcfg.num_moe_experts, qk_layernorm=tcfg.qk_layernorm)
        self.model = GPTModel(tcfg, spec, pre_process=self.first, post_process=self.last, pg_collection=groups,
                              **mw.gpt_kwargs(cfg))
        weights = mw.rank_state_dict(hf_model.state_dict(), cfg, tp=tp, tp_rank=self.tp_rank, ep=ep, ep_rank=groups.ep.rank(),
                                     layer_offset=self.layer_offset, num_local_layers=per_stage,
                                     first_stage=self.first, last_stage=self.last)
        own = {k for k in self.model.state_dict() if not k.endswith("_extra_state")}
        skipped = {k for k in own if k.startswith("output_layer.")}  # the LM head runs on the drafter side
        missing, unexpected = own - skipped - set(weights), set(weights) - own
        if missing or unexpected:
            raise UserError(f"target {name}: HF→megatron mapping mismatch (missing {sorted(missing)[:3]}, "
                            f"unexpected {sorted(unexpected)[:3]}); this checkpoint layout is not supported")
        self.model.load_state_dict(weights, strict=False)
        self.model.eval().requires_grad_(False)
        self.dtype = DTYPES[dtype]
        self.p2p = P2PCommunicator(groups.pp, tcfg) if pp > 1 else None
        self.local_captured: torch.Tensor | None = None
        self.final_hidden: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetOutput | None:
        """Right-padded batches (causal attention keeps real positions exact). Returns a full TargetOutput
        when one stage holds everything (pp = 1); otherwise fills local_captured / final_hidden."""
        B, T = input_ids.shape
        grabbed: dict[int, torch.Tensor] = {}
        handles = []
        for idx in self.local_layers:
            def hook(_mod, _inp, out, idx=idx):
                grabbed[idx] = (out[0] if isinstance(out, tuple) else out).transpose(0, 1)  # megatron is [T, B, d]
            handles.append(self.model.decoder.layers[idx - self.layer_offset].register_forward_hook(hook))
        final: dict[str, torch.Tensor] = {}
        if self.last:
            def stop(_mod, _inp, out):
                final["h"] = out.transpose(0, 1)
                raise _StopAtFinalNorm
            handles.append(self.model.decoder.final_layernorm.register_forward_hook(stop))
        try:
            if not self.first:
                self.model.set_input_tensor(self.p2p.recv_forward((T, B, self.hidden_size), is_first_stage=False))
            position_ids = torch.arange(T).unsqueeze(0).expand(B, -1)
            try:
                out = self.model(input_ids if self.first else None, position_ids, attention_mask=None)
            except _StopAtFinalNorm:
                out = None
            if not self.last:
                self.p2p.send_forward(out, is_last_stage=False)
        finally:
            for h in handles:
                h.remove()
        self.local_captured = torch.stack([grabbed[i] for i in self.local_layers], 2) if self.local_layers else None
        self.final_hidden = final.get("h")
        if self.stages == 1:
            return TargetOutput(captured=self.local_captured, final_hidden=self.final_hidden)
        return None

    __call__ = forward


def load_megatron_target(target_cfg, groups, seed: int):
    """Load the HF checkpoint (or random tiny config) on this target rank and shard it for megatron."""
    from dstrain.targets import target_folder
    from dstrain.targets.hf import load_hf_model, random_model

    if target_cfg.source == "random":
        hf = random_model(target_cfg.hf_config, seed, "float32")
    else:
        hf = load_hf_model(target_folder(target_cfg), "float32")
    torch.manual_seed(seed)  # megatron's CPU init draws from the global RNG before our weights overwrite it
    target = MegatronTarget(hf, target_cfg.name, groups, target_cfg.capture_layers, target_cfg.num_capture, target_cfg.dtype)
    del hf
    dist.barrier(group=groups.mp)
    return target
