"""DeepSeek-V4.1's config: transformers 5.24 has no `deepseek_v41`, so the family brings its own, registered with
AutoConfig (`register`, through family.json's `config_class`) before any config is read.

The release is composite (`text_config` + `vision_config`); dstrain serves text only and reads the text config's
sizes. Defaults are the released V4.1-Flash text config. The checks are the release's rules for a layer schedule
(which layers own compressed caches, which reuse them): a config that breaks one is refused on load, in one line.
"""

from __future__ import annotations

import math

from transformers import PretrainedConfig

TEXT_TYPE = "deepseek_v41_text"
MODEL_TYPE = "deepseek_v41"
RELEASE_SCHEDULE = [0, 0] + [2] * 18 + [1] * 20 + [0] * 3  # 40 target layers, then the 3 DSpark layers (window only)
RELEASE_YARN = {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                "original_max_position_embeddings": 65536}

TEXT_DEFAULTS = dict(
    vocab_size=129280, hidden_size=5120, moe_intermediate_size=2304, num_hidden_layers=40, num_attention_heads=64,
    num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, q_lora_rank=1280, o_lora_rank=1024, o_groups=8,
    hidden_act="silu", swiglu_limit=10.0, rms_norm_eps=1e-20, attention_bias=False, max_position_embeddings=1048576,
    rope_theta=10000.0, n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=6,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
    sliding_window=128, compress_ratios=None, compress_rope_theta=160000.0, kv_source_layer_ids=None,
    index_source_layer_ids=None, index_n_heads=32, index_head_dim=128, index_topk=512, candidate_source_layer_id=20,
    candidate_topk_blocks=2048, candidate_block_size=8, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
    engram_layer_ids=None, engram_num_embeddings=None, engram_max_ngram_size=4, engram_vocab_size=16000000,
    engram_n_heads=8, engram_head_dim=256, engram_pad_token_id=2, engram_compressed_vocab_size=99092,
    num_nextn_predict_layers=3, dspark_block_size=5, dspark_noise_token_id=128799, dspark_target_layer_ids=None,
    dspark_markov_rank=256, dspark_n_routed_experts=128, dspark_num_experts_per_tok=3, initializer_range=0.02,
)
LIST_DEFAULTS = dict(compress_ratios=RELEASE_SCHEDULE, kv_source_layer_ids=[2, 8, 14, 20],
                     index_source_layer_ids=[2, 8, 14, 20, 24, 28, 32, 36], engram_layer_ids=[1, 14],
                     dspark_target_layer_ids=[37, 38, 39])


class DeepseekV41TextConfig(PretrainedConfig):
    model_type = TEXT_TYPE
    base_config_key = "text_config"

    def __init__(self, **kwargs):
        own = {k: kwargs.pop(k, v) for k, v in TEXT_DEFAULTS.items()}
        for key, default in LIST_DEFAULTS.items():
            own[key] = list(default if own[key] is None else own[key])
        if own["engram_num_embeddings"] is None:
            own["engram_num_embeddings"] = [384006168, 384016682] if own["engram_layer_ids"] else []
        own["engram_num_embeddings"] = list(own["engram_num_embeddings"])
        # the release's `rope_scaling` is the compressed branch's YaRN; transformers 5 would rename and validate it as
        # the model's one rope (rope_parameters), so it is kept as `yarn` and written back under its own name
        scaling = kwargs.pop("rope_scaling", None) or kwargs.pop("rope_parameters", None)
        kwargs.pop("rope_parameters", None)
        own["yarn"] = dict(RELEASE_YARN if scaling is None else scaling)
        for key, value in own.items():
            setattr(self, key, value)
        kwargs.setdefault("pad_token_id", 2)
        kwargs.setdefault("bos_token_id", 0)
        kwargs.setdefault("eos_token_id", 1)
        super().__init__(**kwargs)
        check(self)

    def to_dict(self):
        out = super().to_dict()
        out.pop("rope_parameters", None)
        out["rope_scaling"] = out.pop("yarn")
        return out

    # the layer roles the release derives from its schedule
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def role(self, layer: int) -> str:
        """window (ratio 0) | full (owns a compressor and the index keys) | reindex (own top-k over a full layer's
        cache) | reuse (the previous layer's cache and picks, unchanged)."""
        if not self.compress_ratios[layer]:
            return "window"
        if layer in self.kv_source_layer_ids:
            return "full"
        return "reindex" if layer in self.index_source_layer_ids else "reuse"

    def uses_candidates(self, layer: int) -> bool:
        """An index layer after the candidate source restricts its top-k to the source's candidate blocks."""
        return 0 <= self.candidate_source_layer_id < layer and layer in self.index_source_layer_ids


class DeepseekV41Config(PretrainedConfig):
    """The composite release config; `get_text_config()` is what every dstrain module sizes from."""

    model_type = MODEL_TYPE
    sub_configs = {"text_config": DeepseekV41TextConfig}

    def __init__(self, text_config=None, vision_config=None, image_token_id: int = 129264, **kwargs):
        if isinstance(text_config, DeepseekV41TextConfig):
            self.text_config = text_config
        else:
            self.text_config = DeepseekV41TextConfig(**(text_config or {}))
        self.vision_config = dict(vision_config or {"num_hidden_layers": 0})
        self.image_token_id = image_token_id
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def get_text_config(self, *args, **kwargs):
        return self.text_config


def check(cfg) -> None:
    """The release's rules (a ValueError naming the key: load_config turns it into one user-facing line)."""
    def no(msg: str):
        raise ValueError(f"deepseek_v41 config: {msg}")

    if cfg.num_key_value_heads != 1:
        no("num_key_value_heads must be 1 (one shared K=V latent)")
    if cfg.num_attention_heads % cfg.o_groups:
        no(f"o_groups={cfg.o_groups} must divide num_attention_heads={cfg.num_attention_heads}")
    rd = cfg.qk_rope_head_dim
    if rd <= 0 or rd % 2 or rd > min(cfg.head_dim, cfg.index_head_dim):
        no(f"qk_rope_head_dim={rd} must be even, positive and at most head_dim and index_head_dim")
    if cfg.n_shared_experts != 1:
        no("n_shared_experts must be 1")
    if cfg.num_experts_per_tok > cfg.n_routed_experts:
        no("num_experts_per_tok exceeds n_routed_experts")
    for key in ("rms_norm_eps", "hc_eps", "rope_theta", "compress_rope_theta", "routed_scaling_factor"):
        if not (math.isfinite(getattr(cfg, key)) and getattr(cfg, key) > 0):
            no(f"{key} must be finite and positive")
    n, ratios = cfg.num_hidden_layers, cfg.compress_ratios
    if len(ratios) < n or any(not isinstance(r, int) or r < 0 for r in ratios):
        no(f"compress_ratios must hold a non-negative integer for each of the {n} layers")
    for key in ("kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids"):
        ids = getattr(cfg, key)
        if ids != sorted(set(ids)) or any(i < 0 or i >= len(ratios) for i in ids):
            no(f"{key}={ids} must be strictly increasing layer ids covered by compress_ratios")
    if not set(cfg.kv_source_layer_ids) <= set(cfg.index_source_layer_ids):
        no("every kv_source_layer_id must also be an index_source_layer_id")
    owner = None
    for layer in range(n):
        ratio = ratios[layer]
        if not ratio:
            if layer in cfg.kv_source_layer_ids or layer in cfg.index_source_layer_ids:
                no(f"window-only layer {layer} (compress ratio 0) cannot be a kv or index source")
            continue
        owner = ratio if layer in cfg.kv_source_layer_ids else owner
        if owner != ratio:
            no(f"compressed layer {layer} (ratio {ratio}) has no earlier kv source of the same ratio")
    cand = cfg.candidate_source_layer_id
    if cand >= 0:
        if cand not in cfg.kv_source_layer_ids:
            no(f"candidate_source_layer_id={cand} must be a kv source")
        later_full = [i for i in cfg.kv_source_layer_ids if cand < i < n]
        if later_full:  # the release ends its kv sources at the candidate source: a later one would drop the pool
            no(f"kv source {later_full[0]} after candidate_source_layer_id={cand} would discard its candidates")
    if len(cfg.engram_layer_ids) != len(cfg.engram_num_embeddings):
        no("engram_num_embeddings needs one row count per engram_layer_ids entry")
    if cfg.engram_layer_ids and cfg.engram_max_ngram_size < 2:
        no("engram_max_ngram_size must be at least 2")
    if any(not 0 <= i < n for i in cfg.dspark_target_layer_ids):
        no(f"dspark_target_layer_ids={cfg.dspark_target_layer_ids} must be target layers (0..{n - 1})")


def register() -> None:
    """Teach AutoConfig the two model types (idempotent)."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    for model_type, cls in ((TEXT_TYPE, DeepseekV41TextConfig), (MODEL_TYPE, DeepseekV41Config)):
        if model_type not in CONFIG_MAPPING:
            AutoConfig.register(model_type, cls)
