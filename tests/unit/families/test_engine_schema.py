"""The engine schema of a DeepSeek-V4 DSpark drafter: tests/fixtures/engine_schema/
deepseek_v4_dspark.json lists the weight names, shapes and config keys that vLLM's DSparkDeepseekV4ForCausalLM and
SGLang's DeepseekV4ForCausalLMDSpark read under `mtp.{i}.`, transcribed from their code.

Transcribed from (stored copies; the fixture's `sources` names each file and what was read in it):
  vLLM   vllm-project/vllm  vllm/models/deepseek_v4/nvidia/dspark.py @ 03435722dc3b
                            vllm/models/deepseek_v4/nvidia/model.py @ 0101ca23ef36
                            vllm/models/deepseek_v4/attention.py @ 0484480bc730
                            vllm/model_executor/models/qwen3_dspark.py @ 0302ff404394
  SGLang sgl-project/sglang python/sglang/srt/models/deepseek_v4_dspark.py @ 00e5caa819f3
                            python/sglang/srt/speculative/dspark_components/dspark_config.py @ 01f476234ab4
                            python/sglang/srt/models/deepseek_v4.py @ 000328a8cd54 (older than the one dspark imports)
                            python/sglang/srt/models/dspark.py @ 01f476234ab4
No engine was run: this checks names and shapes against the transcription, not a live load.

What is checked: the fixture is well formed (every weight says which engines read it, every source has repo, path and
commit), and V4DraftLayer's state_dict() keys are exactly the per-layer names (`{e}` over the routed experts), each
shape equal to its formula evaluated on a tiny DeepseekV4Config (n_shared_experts 1 and 2); --format deepseek-v4's
storage rules (what stays fp32, what may be quantised) are the fixture's. The export itself is checked against the fixture in test_v4_format.py.
"""

import json
from pathlib import Path

import pytest
from transformers import DeepseekV4Config

from dstrain.families.deepseek_v4.draft_layer import V4DraftDims, V4DraftLayer
from dstrain.families.deepseek_v4.target import rope_of

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "engine_schema" / "deepseek_v4_dspark.json"
ENGINES = {"vllm", "sglang"}
TINY = dict(hidden_size=64, num_attention_heads=4, head_dim=32, partial_rotary_factor=0.5, q_lora_rank=32,
            o_groups=2, o_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            moe_intermediate_size=48, hc_mult=4, hc_sinkhorn_iters=5, sliding_window=8, num_hidden_layers=1,
            layer_types=["sliding_attention"], mlp_layer_types=["moe"], vocab_size=128)


@pytest.fixture(scope="module")
def schema() -> dict:
    return json.loads(FIXTURE.read_text())


def evaluate(formula: str, cfg: DeepseekV4Config) -> int:
    """A shape formula ("num_attention_heads * head_dim // o_groups") over the config's keys."""
    return int(eval(formula, {"__builtins__": {}}, cfg.to_dict()))


def test_fixture_is_well_formed(schema):
    assert schema["sources"]
    for src in schema["sources"]:
        assert src["repo"] and src["path"] and src["commit"] and src["what"], src
    for table in ("layer_weights", "drafter_weights"):
        for name, entry in schema[table].items():
            assert entry["shape"] and all(isinstance(f, str) for f in entry["shape"]), name
            assert entry["dtype"] and entry["quantised"], name
            assert entry["engines"] and set(entry["engines"]) <= ENGINES, name
    for key, entry in schema["config_keys"].items():
        assert entry["engines"] and "default" in entry and entry["use"], key
    keys = schema["config_keys"]
    assert {"dspark_target_layer_ids", "dspark_markov_rank", "hc_mult", "hc_eps", "expert_dtype"} <= set(keys)


@pytest.mark.parametrize("shared", [1, 2])
def test_draft_layer_state_dict_is_the_engines_layer_schema(schema, shared):
    """With n_shared_experts = 2 the engines' shared MLP is moe_intermediate_size * 2 wide (one fused MLP)."""
    cfg = DeepseekV4Config(**{**TINY, "n_shared_experts": shared})
    layer = V4DraftLayer(V4DraftDims.from_config(cfg), rope_of(cfg)["main"])
    want = {}
    for name, entry in schema["layer_weights"].items():
        shape = tuple(evaluate(f, cfg) for f in entry["shape"])
        names = [name.format(e=e) for e in range(cfg.n_routed_experts)] if "{e}" in name else [name]
        want.update(dict.fromkeys(names, shape))
    got = {k: tuple(v.shape) for k, v in layer.state_dict().items()}
    assert sorted(set(got) - set(want)) == [], "names the engines do not read"
    assert sorted(set(want) - set(got)) == [], "names the engines read that the layer lacks"
    assert {k: s for k, s in got.items() if s != want[k]} == {}, "shapes unlike the engines'"


def test_export_storage_rules_are_the_fixtures(schema):
    """families/deepseek_v4/export_format.py's lists say which tensors --format deepseek-v4 keeps fp32 and which it may quantise: they
    must be the fixture's (dtype "float32"; `quantised` "per quant_config" or the experts' expert_dtype), no more."""
    from dstrain.families.deepseek_v4 import export_format as v4_format

    entries = {**schema["layer_weights"], **schema["drafter_weights"]}
    fp32 = {n for n, e in entries.items() if e["dtype"] == "float32"}
    assert {n for n in entries if v4_format._keeps_fp32(n)} == fp32
    per_config = {n for n, e in entries.items() if e["quantised"].startswith("per quant_config")}
    assert set(v4_format.LINEARS) | {"main_proj.weight"} == per_config
    experts = {n for n, e in entries.items() if e["dtype"] == "expert_dtype"}
    assert experts == {n for n in entries if v4_format.EXPERT.search(n.replace("{e}", "0"))}
