"""megatron-core backend: a frozen GPTModel (DeepSeek-V4: its own megatron model) sharded tensor × pipeline × expert
parallel.

Built from a checkpoint folder through its family's adapter (adapters.py), on the target ranks' own process groups,
each rank reading only the slices its shard plan names (sharded_load.py, checkpoint.py). Forward hooks capture the
chosen layers on the stage that owns them; the forward stops at the last stage's final norm (the LM head never runs
on the target side). Every target rank ends a forward holding `local_captured` ([B, T, m_s, d]) and, on the last
stage, `final_hidden`. MoE at tp > 1 runs sequence parallel, so a forward pads the batch to a multiple of tp and
gathers the outputs along the tensor group. Details: dstrain/targets/README.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from dstrain.targets.base import TargetOutput, resolve_capture_layers
from dstrain.targets.hf import DTYPES


class _StopAtFinalNorm(Exception):
    pass


class MegatronTarget:
    def __init__(self, cfg, reader, name: str, groups, capture_layers: list[int] | None = None, num_capture: int = 3,
                 dtype: str = "float32", device: torch.device | str = "cpu", pipeline_layers: list[int] | None = None,
                 seed: int = 0):
        """Build this rank's GPTModel for transformers config `cfg` on `device` and fill it from `reader` (a
        CheckpointReader over the checkpoint folder) with exactly the slices its shard plan names."""
        from megatron.core import parallel_state
        from megatron.core.models.gpt import GPTModel
        from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

        from dstrain.targets import cpu_compat, mcore_patches
        from dstrain.targets.adapters import adapter_for
        from dstrain.targets.shard_plan import RankCoords
        from dstrain.targets.sharded_load import load_plan

        self.device = torch.device(device)
        if self.device.type == "cuda":  # megatron allocates parameters and p2p buffers on torch.cuda.current_device()
            torch.cuda.set_device(self.device)
        seed_rng_tracker(self.device, groups, seed)
        cpu_compat.apply(self.device)  # on the CPU, current_device() answers "cpu": p2p buffers follow the model
        mcore_patches.apply_without_te()
        adapter = adapter_for(cfg)  # given the whole config: a composite release's adapter unwraps it itself
        text = cfg.get_text_config()  # the sizes are the text model's (the config itself but for composites: Kimi K2.x)
        self.name, self.hidden_size, self.vocab_size = name, text.hidden_size, text.vocab_size
        self.num_layers = text.num_hidden_layers
        self.capture_layers = resolve_capture_layers(name, self.num_layers, capture_layers, num_capture)
        tp, pp, ep = groups.tp.size(), groups.pp.size(), groups.ep.size()
        adapter.check_layout(cfg, tp, pp, ep, pipeline_layers)
        self.coords = RankCoords(tp=tp, tp_rank=groups.tp.rank(), ep=ep, ep_rank=groups.ep.rank(), pp=pp,
                                 stage=groups.pp.rank(), num_layers=self.num_layers,
                                 pipeline_layers=tuple(pipeline_layers) if pipeline_layers else None)
        self.tp_rank, self.stage, self.stages = self.coords.tp_rank, self.coords.stage, pp
        per_stage = self.coords.layers_per_stage
        self.layer_offset = self.coords.layer_offset
        self.first, self.last = self.coords.first, self.coords.last
        self.local_layers = [i for i in self.capture_layers if self.layer_offset <= i < self.layer_offset + per_stage]

        tcfg = adapter.transformer_config(cfg, tp, pp, ep, DTYPES[dtype], pipeline_layers)
        tcfg.use_cpu_initialization = self.device.type == "cpu"  # on CUDA: built on the GPU, never moved
        self.tp_group, self.sequence_parallel = groups.tp, tcfg.sequence_parallel
        if self.sequence_parallel:
            from dstrain.targets import mcore_patches

            mcore_patches.apply_for_sequence_parallel()
        if getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None) is None:
            parallel_state._set_global_memory_buffer()  # the local attention borrows scratch space from it
        build = getattr(adapter, "build_model", None)  # a family whose model is not a GPTModel (DeepSeek-V4)
        if build is not None:
            self.model = build(tcfg, cfg, self.coords, groups)
        else:
            self.model = GPTModel(tcfg, adapter.layer_spec(tcfg, cfg), pre_process=self.first, post_process=self.last,
                                  pg_collection=groups, **adapter.gpt_kwargs(cfg))
        # what a stage sends its successor per token (V4: all n mHC streams), and whether every stage needs the ids
        self.stage_width = getattr(self.model, "stage_width", text.hidden_size)
        self.ids_everywhere = getattr(self.model, "needs_input_ids", False)
        self.readout = getattr(self.model, "readout", None)  # V4: a captured layer's feature, the mean of its streams
        self.model.to(self.device)  # no-op for megatron's own parameters; moves any a family module made on the CPU
        if self.last and getattr(self.model, "output_layer", None) is not None:
            self.model.output_layer.weight = None  # the LM head runs on the drafter side: never read, never held
        self.load_stats = load_plan(self.model, adapter.rank_plan(cfg, self.coords), reader, f"target {name}")
        self.model.eval().requires_grad_(False)
        self.dtype = DTYPES[dtype]
        self.p2p = P2PCommunicator(groups.pp, tcfg) if pp > 1 else None
        self.pp_group = groups.pp
        self.local_captured: torch.Tensor | None = None
        self.final_hidden: torch.Tensor | None = None

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetOutput | None:
        """Right-padded batches (causal attention keeps real positions exact). Returns a full TargetOutput
        when one stage holds everything (pp = 1); otherwise fills local_captured / final_hidden."""
        B, T = input_ids.shape
        pad = -T % self.tp_group.size() if self.sequence_parallel else 0
        if pad:  # right padding: causal attention keeps every real position exact; cut back below
            input_ids = torch.nn.functional.pad(input_ids, (0, pad))
        rows = (T + pad) // self.tp_group.size() if self.sequence_parallel else T  # sequence rows between layers
        grabbed: dict[int, torch.Tensor] = {}
        handles = []
        for idx in self.local_layers:
            def hook(_mod, _inp, out, idx=idx):
                h = out[0] if isinstance(out, tuple) else out
                grabbed[idx] = self._whole(h if self.readout is None else self.readout(h), T)
            # a family may capture elsewhere than a layer's output (V4.1: the streams entering it)
            capture = getattr(self.model, "capture_module", None)
            point = capture(idx - self.layer_offset) if capture else self.model.decoder.layers[idx - self.layer_offset]
            handles.append(point.register_forward_hook(hook))
        final: dict[str, torch.Tensor] = {}
        if self.last:
            def stop(_mod, _inp, out):
                final["h"] = self._whole(out, T)
                raise _StopAtFinalNorm
            handles.append(self.model.decoder.final_layernorm.register_forward_hook(stop))
        try:
            if not self.first:
                self.model.set_input_tensor(self.p2p.recv_forward((rows, B, self.stage_width), is_first_stage=False))
                self._recv_side(rows, B, T + pad)
            input_ids = input_ids.to(self.device)
            position_ids = torch.arange(T + pad, device=self.device).unsqueeze(0).expand(B, -1)
            try:
                ids = input_ids if self.first or self.ids_everywhere else None
                out = self.model(ids, position_ids, attention_mask=None)
            except _StopAtFinalNorm:
                out = None
            if not self.last:
                self.p2p.send_forward(out, is_last_stage=False)
                self._send_side()
        finally:
            for h in handles:
                h.remove()
        self.local_captured = torch.stack([grabbed[i] for i in self.local_layers], 2) if self.local_layers else None
        self.final_hidden = final.get("h")
        if self.stages == 1:
            return TargetOutput(captured=self.local_captured, final_hidden=self.final_hidden)
        return None

    __call__ = forward

    def _recv_side(self, rows: int, B: int, T: int) -> None:
        """Tensors a family sends beside the streams (V4.1: the fp32 pre-mix and the CSA-2 cache), from the previous
        stage, in the order its `side_in` lists them."""
        side_in = getattr(self.model, "side_in", None)
        if side_in is None:
            return
        src = dist.get_global_rank(self.pp_group, self.stage - 1)
        got = []
        for shape, dtype in side_in(rows, B, T, self.dtype):
            t = torch.empty(shape, dtype=torch.uint8 if dtype == torch.bool else dtype, device=self.device)
            dist.recv(t, src=src, group=self.pp_group)
            got.append(t.bool() if dtype == torch.bool else t)
        self.model.set_side(got)

    def _send_side(self) -> None:
        side_out = getattr(self.model, "side_out", None)
        if side_out is None:
            return
        dst = dist.get_global_rank(self.pp_group, self.stage + 1)
        for t in side_out():
            dist.send(t.to(torch.uint8) if t.dtype == torch.bool else t, dst=dst, group=self.pp_group)

    def _whole(self, h: torch.Tensor, T: int) -> torch.Tensor:
        """megatron's [T, B, …] (this rank's rows under sequence parallelism) -> [B, T, …] of the whole sequence."""
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False, group=self.tp_group)
        return h[:T].transpose(0, 1)


def seed_rng_tracker(device: torch.device, groups, seed: int) -> None:
    """On CUDA, megatron's attention, transformer block and (sequence parallel) embedding fork the CUDA RNG tracker's
    "model-parallel-rng" state, which only model_parallel_cuda_manual_seed adds ("cuda rng state model-parallel-rng is
    not added" otherwise); seeded from this rank's own groups (no megatron global parallel state here). On the CPU
    cpu_compat's fork needs no state."""
    if device.type != "cuda":
        return
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed, tp_rank=groups.tp.rank(), ep_rank=groups.ep.rank(),
                                    etp_rank=groups.expt_tp.rank())


def load_megatron_target(target_cfg, groups, seed: int, device: torch.device | str = "cpu",
                         pipeline_layers: list[int] | None = None):
    """Build this target rank's shard of the recipe's target, reading only its own slices of the checkpoint."""
    from dstrain.targets.folders import checkpoint_folder
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.configs import apply_run_switches, load_config

    folder = checkpoint_folder(target_cfg, seed)
    cfg = apply_run_switches(load_config(folder), target_cfg)
    torch.manual_seed(seed)  # megatron's CPU init may draw from the global RNG before our weights overwrite it
    with CheckpointReader(folder, DTYPES[target_cfg.dtype]) as reader:
        target = MegatronTarget(cfg, reader, target_cfg.name, groups, target_cfg.capture_layers, target_cfg.num_capture,
                                target_cfg.dtype, device, pipeline_layers, seed)
    dist.barrier(group=groups.mp)
    return target
