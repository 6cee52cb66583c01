"""What each family can do is declared in its folder (dstrain/families/*/family.json, read by dstrain/capabilities.py)
and asked for everywhere else: no module outside families/ names a family's model_type, every declared adapter or
refusal resolves, every engine fact cites its source, and the engine verdicts of the families served now follow
their facts."""

import ast
import json
import shutil
from pathlib import Path

import pytest

from dstrain import capabilities
from dstrain.errors import UserError

ROOT = Path(__file__).resolve().parents[3]
GENERIC = "gpt"  # its model_types (llama, qwen3, mixtral, ...) also name drafter layer types and the upcycled layout


def test_every_family_declares_what_the_code_asks():
    table = capabilities.table()
    folders = {p.parent.name for p in (ROOT / "dstrain" / "families").glob("*/target.py")}
    assert folders == {c.family for c in table.values()}, "a family folder without a family.json (or the reverse)"
    for model_type, cap in table.items():
        assert cap.architecture, model_type
        assert bool(cap.megatron) + bool(cap.megatron_refusal) <= 1, model_type
        for engine, fact in cap.engines.items():
            assert engine in ("vllm", "sglang") and fact["source"] and fact["read"], (model_type, fact)
            assert fact["aux_hidden_states"] in (True, False, None, "version-bound"), (model_type, fact)
        for drafter in cap.released_drafters:
            assert {"id", "kind", "format", "imports", "source"} <= set(drafter), (model_type, drafter)


def test_adapters_and_refusals_resolve():
    from dstrain.targets.adapters import adapter_for, megatron_families

    for model_type, cap in capabilities.table().items():
        if cap.megatron:
            assert adapter_for(model_type) is not None and model_type in megatron_families()
        else:
            with pytest.raises(UserError) as err:
                adapter_for(model_type)
            assert "\n" not in str(err.value) and str(err.value).endswith("use target.backend=hf"), model_type


def _named_model_types(root: Path) -> list[str]:
    """String constants equal to a non-generic family's model_type in dstrain/ outside families/ and testing/."""
    own = {m for m, c in capabilities.table(root / "dstrain" / "families").items() if c.family != GENERIC}
    found = []
    for path in sorted((root / "dstrain").rglob("*.py")):
        rel = path.relative_to(root / "dstrain").as_posix()
        if rel.startswith(("families/", "testing/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in own:
                found.append(f"{rel}:{node.lineno}: {node.value!r}")
    return found


def test_no_model_type_check_outside_the_families(tmp_path):
    assert _named_model_types(ROOT) == []
    # the check sees one: V4's old check in the speed simulator, put back into a copy
    shutil.copytree(ROOT / "dstrain", tmp_path / "dstrain", ignore=shutil.ignore_patterns("__pycache__", "corpus"))
    sps = tmp_path / "dstrain" / "sim" / "sps.py"
    sps.write_text(sps.read_text() + '\n\ndef _injected(model):\n    return model.config.model_type == "deepseek_v4"\n')
    assert _named_model_types(tmp_path) == [f"sim/sps.py:{len(sps.read_text().splitlines())}: 'deepseek_v4'"]


def test_family_file_mistakes_are_named(tmp_path):
    (tmp_path / "fam").mkdir()
    (tmp_path / "fam" / "family.json").write_text(json.dumps({"model_types": {"x": {"architecture": "X"}}, "megatorn": "m"}))
    with pytest.raises(capabilities.FamilyFileError, match="unknown keys \\['megatorn'\\]"):
        capabilities.table(tmp_path)


def test_capabilities_replace_the_old_checks():
    """V4's backbone and caches, transformers' prepared mask, the target's architecture: answered from the folders."""
    from dstrain.export.engines import target_architecture

    assert capabilities.model_types_with(draft_backbone="v4") == ["deepseek_v4", "deepseek_v41", "deepseek_v41_text"]
    assert capabilities.model_types_with(cache="from_config") == ["deepseek_v4"]
    assert "deepseek_v3" in capabilities.model_types_with(prepared_mask=True)
    assert "gpt_oss" not in capabilities.model_types_with(prepared_mask=True)
    assert target_architecture({"model_type": "glm_moe_dsa"}) == "GlmMoeDsaForCausalLM"
    assert target_architecture({"model_type": "kimi_k25"}) == "KimiK25ForConditionalGeneration"


EAGLE3 = ["drafter.ffn.type=dense", "drafter.mask_token_id=127", "drafter.type=eagle3", "drafter.num_layers=1",
          "drafter.head=none", "drafter.confidence=false", "loss.alpha_conf=0", "drafter.sliding_window=null",
          "drafter.qk_norm=false"]


@pytest.mark.parametrize("arch,vllm,sglang", [
    ("GptOssForCausalLM", "loads", "loads"),  # vLLM: SupportsEagle3; SGLang's class not read: no rule fires
    ("KimiK25ForConditionalGeneration", "version-bound", "loads"),  # vLLM: only the NVFP4 class forwards the hook
    ("MiniMaxM2ForCausalLM", "version-bound", "loads"),
    ("Qwen3_5MoeForConditionalGeneration", "loads", "version-bound"),  # SGLang: sglang#25408's capture bug
    ("GlmMoeDsaForCausalLM", "version-bound", "loads"),
])
def test_eagle3_verdicts_of_the_families_served_now(arch, vllm, sglang):
    from dstrain.config.schema import load_recipe
    from dstrain.export.engines import verdicts

    cfg = load_recipe(ROOT / "recipes" / "tiny_moe.yaml", EAGLE3).drafter
    got = {v.engine: v for fmt in ("speculators", "sglang-eagle3") for v in verdicts(cfg, fmt, arch)
           if not (fmt == "speculators" and v.engine == "sglang")}
    assert (got["vllm"].status, got["sglang"].status) == (vllm, sglang), {k: v.line() for k, v in got.items()}
    cap = capabilities.by_architecture(arch)
    if vllm == "version-bound":
        assert cap.engines["vllm"]["read"] in got["vllm"].line() and cap.engines["vllm"]["source"] in got["vllm"].line()
