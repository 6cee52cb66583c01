"""Hugging Face backend: any transformers causal LM from a local folder (or a random tiny config).

Capture uses forward hooks on the decoder layers, so one backend serves Llama, Mixtral, Qwen3-MoE, DeepSeek-V3 and
DeepSeek-V4 without per-family code. The final states are the base model's `last_hidden_state` (after the final
norm: exactly what the LM head multiplies), so the LM head itself never runs on the target side. mHC targets
(DeepSeek-V4) carry n residual streams between layers ([B, T, n, d]): a captured layer's feature is the mean over
its streams, what vLLM and SGLang hand a V4 DSpark drafter (the megatron V4 model reads out the same).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dstrain import capabilities
from dstrain.errors import UserError
from dstrain.targets.base import TargetOutput, resolve_capture_layers

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# how a captured layer is read out; the feature cache keys on it, so features read another way are never served.
# 2: mHC streams averaged (1: through the model's hc_head)
READOUT_VERSION = 2


def full_attention(cfg) -> bool:
    """Whether every layer of a (text) config attends to its whole causal prefix: no sliding window anywhere."""
    types = getattr(cfg, "layer_types", None)
    if types:  # per-layer kinds decide where a config has them (gpt-oss's sliding_window is its sliding layers')
        return all(t == "full_attention" for t in types)
    return getattr(cfg, "sliding_window", None) is None or getattr(cfg, "use_sliding_window", True) is False


class HFTarget:
    """A frozen transformers causal LM behind the TargetBackend protocol."""

    def __init__(self, model: nn.Module, name: str, capture_layers: list[int] | None = None, num_capture: int = 3):
        self.model = model.eval().requires_grad_(False)
        self.name = name
        cfg = model.config.get_text_config()  # a vision-language release (Kimi K2.x): its text model's sizes
        self.hidden_size = cfg.hidden_size
        self.vocab_size = cfg.vocab_size
        self.num_layers = cfg.num_hidden_layers
        self.capture_layers = resolve_capture_layers(name, self.num_layers, capture_layers, num_capture)
        self._base = model.get_decoder() if hasattr(model, "get_decoder") else model.model

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self._base.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def masked_cache_ok(self) -> bool:
        """Whether speculative decoding may keep rejected drafts in a DynamicCache behind a 2-D mask
        (eval/session.py). Not where any layer slides a window (DeepSeek-V4, gpt-oss, Mistral): transformers counts a
        window in cache slots, so masked slots inside it would push real tokens out (and V4's caches also compress
        them), nor where a layer is recurrent (Qwen3.5's linear attention: its state has already taken the drafts in)
        or indexed (GLM-5's DSA: the session's bare DynamicCache has no indexer key cache);
        such a session recomputes the prefix instead."""
        return full_attention(self.model.config.get_text_config())

    @staticmethod
    def _readout(hidden: torch.Tensor) -> torch.Tensor:
        return hidden.mean(dim=2) if hidden.dim() == 4 else hidden  # [B, T, n_streams, d]: the streams' mean

    def prepare_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """A right-padded batch's [B, T] mask as the [B, 1, T, T] boolean mask transformers' SDPA path builds from it
        (causal, padded keys off). Given a 2-D mask, transformers reads it back to decide whether it can skip it
        (masking_utils._ignore_causal_mask_sdpa): a wait for the device on every target forward. A prepared mask is
        used as it is, so this applies only where it is what transformers would build: SDPA attention, full causal
        attention in every layer (no sliding windows), a family whose family.json says prepared_mask; else the mask is returned unchanged."""
        cfg = self.model.config.get_text_config()
        cap = capabilities.of(cfg.model_type)  # its family.json's prepared_mask: the decoder builds its mask with
        # masking_utils.create_causal_mask, which passes a 4-D mask through as is
        if not (full_attention(cfg) and cap is not None and cap.prepared_mask and cfg._attn_implementation == "sdpa"
                and getattr(cfg, "is_causal", True) and attention_mask.dim() == 2):
            return attention_mask
        t = attention_mask.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=attention_mask.device).tril()
        return causal[None, None] & attention_mask.bool()[:, None, None, :]

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, position_ids=None,
                past_key_values=None) -> TargetOutput:
        """Training: whole sequences, no cache. Decoding: pass a transformers Cache (extended in place),
        explicit position_ids and a 2-D mask over [cached + new] slots (0 = a slot nobody may attend to)."""
        grabbed: dict[int, torch.Tensor] = {}
        handles = []
        layers = self._base.layers
        for idx in self.capture_layers:
            def hook(_mod, _inp, out, idx=idx):
                grabbed[idx] = out[0] if isinstance(out, tuple) else out
            handles.append(layers[idx].register_forward_hook(hook))
        try:
            out = self._base(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=past_key_values, use_cache=past_key_values is not None)
        finally:
            for h in handles:
                h.remove()
        captured = torch.stack([self._readout(grabbed[i]) for i in self.capture_layers], dim=2)
        return TargetOutput(captured=captured, final_hidden=out.last_hidden_state)

    __call__ = forward


def load_hf_model(folder: str | Path, dtype: str = "float32") -> nn.Module:
    """A causal LM, or a vision-language release whose text model is one (Kimi K2.x): HFTarget runs its decoder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    folder = Path(folder)
    if not (folder / "config.json").is_file():
        raise UserError(f"target.path {folder}: no config.json there (expected a Hugging Face model folder)")
    from dstrain.targets.configs import load_config

    cap = capabilities.of_config(load_config(folder))
    if cap is not None and cap.config_class:  # a model type dstrain reads the config of, but transformers cannot run
        raise UserError(f"target.path {folder}: transformers has no {cap.model_type} model to run: use "
                        "target.backend=megatron")
    try:
        kind = type(AutoConfig.from_pretrained(folder))
        auto = AutoModelForImageTextToText if kind not in AutoModelForCausalLM._model_mapping \
            and kind in AutoModelForImageTextToText._model_mapping else AutoModelForCausalLM
        return auto.from_pretrained(folder, dtype=DTYPES[dtype])
    except (OSError, ValueError, ImportError) as exc:
        raise UserError(f"target.path {folder}: cannot load the model ({str(exc).splitlines()[0]})") from None


def random_model(hf_config: dict, seed: int, dtype: str = "float32") -> nn.Module:
    """A randomly initialised model from config kwargs (tiny CI targets)."""
    from transformers import AutoModelForCausalLM

    from dstrain.targets.configs import config_from_dict

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config_from_dict(hf_config)).to(DTYPES[dtype])
