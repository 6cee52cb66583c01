"""`--format deepseek-v41`: a V4.1 DSpark drafter (drafter.V41BlockDrafter) in DeepSeek-V4.1's own checkpoint layout
(`mtp.{i}.*`, the names AutoModel's DeepseekV41DSparkStateDictAdapter and vLLM's V4.1 DSpark loader read), and the
same layout read back (drafter.init_from a release's own drafter, dstrain evaluate).

V4's machinery (families/deepseek_v4/export_format.py: the host's quantisation scheme read from its own files,
shards, atomic writes, the init checks) with V4.1's differences: the config is composite, so the drafter's keys go
into `text_config` where the engines and AutoModel read them (`num_nextn_predict_layers` = the stages,
`dspark_n_routed_experts`, `dspark_num_experts_per_tok`, `compress_ratios` extended by one 0 per stage); fp32 also
keeps `ffn.gate.bias_vl`; the Markov head is `markov_head.{embed,head}`.
"""

from __future__ import annotations

from pathlib import Path

from dstrain.errors import UserError
from dstrain.families.deepseek_v4 import export_format as v4

FORMAT = "deepseek-v41"
ENGINES = ("vllm", "sglang")
ENGINE_NAMES = "vLLM and SGLang"
DRAFTER = "a V4.1 DSpark drafter"
LAYOUT = "mtp.* layout"
TRAINED_ON = "trained on a DeepSeek-V4.1 target"
WRITTEN_FOR = ("written for vLLM's V4.1 DSpark model (vllm/models/deepseek_v41/nvidia/dspark.py @ 0f6c0f5a: "
               "_remap_dspark_name, load_weights) and NeMo AutoModel 0.7.0's DeepseekV41DSparkStateDictAdapter, whose "
               "loader tools/reference_check.py runs on every export it checks; SGLang's V4.1 DSpark path was not found "
               "upstream (its configs/deepseek_v41.py maps V4.1 onto its V4 classes)")
FP32 = (*v4.FP32, "ffn.gate.bias_vl")
SCALES = v4.SCALES
check_layers = v4.check_layers
holds_target = v4.holds_target


def is_state(state: dict) -> bool:
    return any(k.endswith("markov_head.embed.weight") and k.startswith("mtp.") for k in state)


def is_folder(config: dict) -> bool:
    return config.get("model_type") == "deepseek_v41"


def owns(drafter) -> bool:
    return getattr(drafter, "EXPORT_FORMAT", None) == FORMAT


def _text(raw: dict) -> dict:
    return raw.get("text_config") or raw


def engine_config(raw: dict, hf, drafter, capture_layers: list[int], scheme, binding: dict | None) -> dict:
    """config.json of the drafter folder: the host's, its text_config given the drafter's keys."""
    n, dims = len(drafter.mtp), drafter.dims
    config = {k: v for k, v in raw.items() if k != "dstrain"}
    text = dict(_text(config))
    layers = int(text["num_hidden_layers"])
    text.update({
        "num_nextn_predict_layers": n,
        "dspark_target_layer_ids": [int(i) for i in capture_layers],
        "dspark_markov_rank": int(drafter.markov_head.markov_w1.weight.shape[1]),
        "dspark_noise_token_id": int(drafter.mask_token_id),
        "dspark_n_routed_experts": dims.experts, "dspark_num_experts_per_tok": dims.topk,
        "enable_confidence_head": True,
        "compress_ratios": [int(r) for r in text["compress_ratios"][:layers]] + [0] * n,
    })
    block_size = getattr(drafter.cfg, "block_size", None)
    if block_size is not None:
        text["dspark_block_size"] = int(block_size)
    if "text_config" in config:
        config["text_config"] = text
    else:
        config = text
    return v4.with_quant_and_binding(config, raw, scheme, binding)


def export(drafter, host_folder, out: Path, capture_layers, binding=None, sts=None, max_shard_bytes: int = 5 << 30):
    return v4.export(drafter, host_folder, out, capture_layers, binding, sts, max_shard_bytes, fmt=_this())


def add_to_checkpoint(folder, drafter, capture_layers):
    return v4.add_to_checkpoint(folder, drafter, capture_layers, fmt=_this())


def read(folder: Path, config: dict):
    """V4's reader on the text config (where V4.1 keeps the drafter's keys); the stage count is
    num_nextn_predict_layers."""
    text = dict(_text(config))
    if "text_config" in config:
        text["dstrain"] = config.get("dstrain")
    text.setdefault("n_mtp_layers", text.get("num_nextn_predict_layers"))
    if text.get("n_mtp_layers") is None:
        raise UserError(f"{folder}/config.json: no num_nextn_predict_layers: a V4.1 DSpark drafter's config names its "
                        "stages")
    return v4.read(folder, text)


def init(drafter, cfg, art, frozen, src: str) -> None:
    return v4.init(drafter, cfg, art, frozen, src, fmt=_this())


def _this():
    import sys

    return sys.modules[__name__]

