"""NeMo AutoModel 0.7.0 as a numerical reference: runs INSIDE .venv-automodel (make automodel-venv), never in dstrain's venv.

    OMP_NUM_THREADS=1 .venv-automodel/bin/python tools/reference_check/automodel_side.py \\
        --checkpoint DIR --inputs IN.pt --out OUT.pt [--cache-quant on|off]

DIR: a checkpoint folder in DeepSeek's release layout: config.json (model_type deepseek_v41, composite text_config +
vision_config with num_hidden_layers 0; or deepseek_v4), *.safetensors with the release names (embed.weight,
layers.{i}.attn.wq_a.weight, layers.{i}.ffn.experts.{j}.w1.weight, mtp.{s}.*, quantised weights with .scale companions)
and, for Engram, the fast tokenizer files. AutoModel's model is built on the CPU in fp32 with its eager/torch backend,
and the file's tensors go through AutoModel's OWN state-dict adapter (from_hf: FP8 32x32 / 128x128 blocks, FP4 experts,
Engram FP8 per-row dequantisation, expert stacking, renames), so a naming or dequantisation disagreement shows up.

IN.pt (torch.save'd dict):
  input_ids       LongTensor [B, T]
  capture_layers  list[int]: the drafter's target layers (V4.1: dspark_target_layer_ids)
  attention_mask  optional [B, T] (1 = token, right padding only; default all ones)
  loss_mask       optional [B, T] (default all ones; DSpark's anchor validity and eval mask)
  dspark          optional (V4.1 only) dict:
                    anchors      LongTensor [B, N] anchor positions (the block's slot 0 is the token AT the anchor)
                    keep         optional BoolTensor [B, N] (default all True): AutoModel's block_keep_mask
                    loss_weights optional {ce_loss_alpha, l1_loss_alpha, confidence_head_alpha, loss_decay_gamma}
                                 (default: the train_dspark recipe's 0.1, 0.9, 1.0, None)
OUT.pt (torch.save'd dict, every tensor fp32 unless noted, on the CPU):
  streams_in      {layer: [B, T, hc, H]} residual streams entering each block (before its Engram), AutoModel's
                  output_hidden_states (V4.1) / a forward pre-hook on each block (V4)
  streams_post_engram  (V4.1) {layer: [B, T, hc, H]} for Engram layers: the streams after the Engram update, i.e. the
                  attn_hc input the DSpark capture sees
  streams_out_last [B, T, hc, H] the streams leaving the last block (before the final collapse)
  features        [B, T, len(capture_layers), H] as HFDSparkTargetModel.generate_batch builds them (its
                  target_hidden_states [B, T, L*H] reshaped): V4.1 = mean over hc of the attn_hc INPUT of layer i (the
                  streams entering i, after i's Engram); V4 (no feature provider) = mean over hc of layer i's OUTPUT, and
                  the final-norm output for the last layer
  final_hidden    [B, T, H] after the final collapse + norm (HFDSparkTargetModel's target_last_hidden_states)
  logits          [B, T, V] fp32 lm_head
  dspark (V4.1 with IN dspark) dict:
    draft_logits       [B, N, K, V] = lm_head(final-norm draft hidden) + Markov transition logits (K = dspark_block_size)
    confidence         [B, N, K] confidence logits (pre-sigmoid)
    target_ids         [B, N, K] labels: token at anchor+1+k (k = slot), clamped to T-1 and 0 for dropped blocks
    eval_mask          [B, N, K] bool (label < T, loss_mask at the label, block kept; cumprod along k)
    block_keep_mask    [B, N] bool
    aligned_target_logits [B, N, K, V] the target's logits at the label's predicting position (label index - 1)
    accept_rate        [B, N, K] clamp(1 - 0.5*L1(softmax(draft), softmax(target)), 0, 1): the confidence target
    noise_ids          [B, N*K] draft input ids (slot 0 = anchor token, rest dspark_noise_token_id)
    previous_token_ids [B, N*K] Markov-head inputs (anchor token, label_0 .. label_{K-2})
    position_ids       [B, T + N*K] (context 0..T-1, then anchor+k)
    attention_visible  [B, 1, N*K, T + N*K] bool (True = visible)
    normalized_hidden  [B, N*K, H] the last stage's final-norm output
    loss               scalar compute_dspark_loss (world size 1) and loss_terms {ce_loss, l1_loss, confidence_loss, ...}
    loss_weights       the weights used;  slot_layout: a sentence saying which slot is which
  meta: automodel version, model_type, config (text) dict, per-layer roles, cache_quant, the checkpoint keys consumed /
        ignored (read by neither the backbone nor the DSpark adapter) / expected-but-missing, load_state_dict's
        missing/unexpected native keys, timings.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

T0 = time.perf_counter()
with contextlib.redirect_stderr(io.StringIO()):  # torchao's GPU .so and megatron_fsdp's TE/Apex notices
    import torch
    from safetensors import safe_open

    from nemo_automodel.components.models.common import BackendConfig

torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
T_IMPORTS = time.perf_counter() - T0

RECIPE_LOSS_WEIGHTS = {"ce_loss_alpha": 0.1, "l1_loss_alpha": 0.9, "confidence_head_alpha": 1.0, "loss_decay_gamma": None}


def backend() -> BackendConfig:
    # AutoModel's default is tilelang/hybridep (GPU only): eager attention and torch everything else
    return BackendConfig(attn="eager", linear="torch", rms_norm="torch_fp32", experts="torch", dispatcher="torch",
                         rope_fusion=False, enable_hf_state_dict_adapter=True)


def read_release(folder: Path) -> dict[str, torch.Tensor]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"automodel_side: no *.safetensors in {folder}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for k in fh.keys():
                if k in out:
                    raise SystemExit(f"automodel_side: {k} appears in two shards")
                out[k] = fh.get_tensor(k)
    return out


def with_scales(names) -> set[str]:
    names = set(names)
    return names | {n.removesuffix(".weight") + ".scale" for n in names if n.endswith(".weight")}


def load_native(model: torch.nn.Module, adapter, hf: dict[str, torch.Tensor]) -> dict:
    native = adapter.from_hf(dict(hf))
    native = {k: (v.float() if torch.is_floating_point(v) else v) for k, v in native.items()}
    res = model.load_state_dict(native, strict=False)
    return {"missing_native": sorted(res.missing_keys), "unexpected_native": sorted(res.unexpected_keys)}


def patch_cache_quant(mods) -> None:
    for m in mods:
        m.quantize_cache = lambda values, **_: values


def f32(x):
    if isinstance(x, torch.Tensor):
        return x.detach().float().cpu().contiguous() if torch.is_floating_point(x) else x.detach().cpu().contiguous()
    return x


# ------------------------------------------------------------------------------------------------------------ V4.1
def run_v41(folder: Path, cfg_json: dict, hf: dict, inp: dict, cache_quant: bool) -> dict:
    from nemo_automodel.components.models.deepseek_v41 import attention as v41_attention
    from nemo_automodel.components.models.deepseek_v41 import dspark as v41_dspark
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from nemo_automodel.components.speculative.dspark.loss import compute_dspark_loss
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    if not cache_quant:
        patch_cache_quant([v41_attention, v41_dspark])
    cfg = json.loads(json.dumps(cfg_json))
    cfg.setdefault("vision_config", {"num_hidden_layers": 0})
    cfg["text_config"]["dtype"] = "float32"  # the reference runs in fp32 whatever the release's storage dtype
    cfg["dtype"] = "float32"
    config = DeepseekV41Config.from_dict(cfg)
    t = config.text_config
    tokenizer = None
    if any(i < t.num_hidden_layers for i in t.engram_layer_ids):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(folder))
        if not getattr(tokenizer, "is_fast", False):
            raise SystemExit("automodel_side: Engram needs the checkpoint's FAST tokenizer (tokenizer.json)")
    model = DeepseekV41ForCausalLM(config, backend=backend(), tokenizer=tokenizer).eval()
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    backbone_keys = with_scales(model.state_dict_adapter.get_hf_state_dict_keys(model.state_dict()))
    load = load_native(model, model.state_dict_adapter, hf)

    roles = {}
    for i, layer in model.model.layers.items():
        a = layer.attn
        kind = "SWA" if not a.compress_ratio else ("Full" if a.is_kv_source else ("Reindex" if a.is_index_source else "Reuse"))
        cand = None
        if a.indexer is not None:
            cand = "source" if a.indexer.is_candidate_source else ("uses" if a.indexer.uses_candidates else None)
        roles[int(i)] = {"role": kind, "compress_ratio": int(a.compress_ratio), "candidates": cand,
                         "engram": layer.engram is not None, "rope_theta": float(a.rotary_emb.theta),
                         "yarn_factor": float(a.rotary_emb.factor)}

    ids = inp["input_ids"].long()
    B, T = ids.shape
    am = inp.get("attention_mask", torch.ones(B, T, dtype=torch.long)).long()
    loss_mask = inp.get("loss_mask", torch.ones(B, T, dtype=torch.long))
    capture = [int(i) for i in inp["capture_layers"]]

    post_engram: dict[int, torch.Tensor] = {}
    handles = [model.model.layers[str(i)].attn_hc.register_forward_pre_hook(
        lambda _m, args, i=int(i): post_engram.__setitem__(i, args[0].detach().clone()))
        for i, layer in model.model.layers.items() if layer.engram is not None]
    last_out: dict[str, torch.Tensor] = {}
    n_layers = t.num_hidden_layers
    handles.append(model.model.layers[str(n_layers - 1)].register_forward_hook(
        lambda _m, _a, out: last_out.__setitem__("h", (out[0] if isinstance(out, tuple) else out).detach().clone())))
    with torch.no_grad():
        out = model(ids, attention_mask=am, output_hidden_states=True)
    for h in handles:
        h.remove()
    target = HFDSparkTargetModel(model, target_layer_ids=capture)
    with torch.no_grad():
        batch = target.generate_batch(ids, am, loss_mask)
    H = t.hidden_size
    result = {
        "streams_in": {i: f32(s) for i, s in enumerate(out.hidden_states)},
        "streams_post_engram": {i: f32(s) for i, s in post_engram.items()},
        "streams_out_last": f32(last_out.get("h")),
        "features": f32(batch.target_hidden_states.reshape(B, T, len(capture), H)),
        "final_hidden": f32(batch.target_last_hidden_states),
        "logits": f32(out.logits),
    }

    consumed_draft: set[str] = set()
    if inp.get("dspark") is not None:
        result["dspark"], consumed_draft, dload = run_v41_dspark(
            v41_dspark, compute_dspark_loss, t, model, hf, ids, loss_mask, batch, inp["dspark"])
        load.update({f"dspark_{k}": v for k, v in dload.items()})
    meta_keys(result, hf, backbone_keys, consumed_draft, load)
    result["meta"].update(roles=roles, text_config=t.to_dict())
    return result


def run_v41_dspark(v41_dspark, compute_dspark_loss, t, model, hf, ids, loss_mask, batch, spec: dict):
    B, T = ids.shape
    anchors = spec["anchors"].long()
    keep = spec.get("keep", torch.ones_like(anchors, dtype=torch.bool)).bool()
    weights = {**RECIPE_LOSS_WEIGHTS, **(spec.get("loss_weights") or {})}
    draft = v41_dspark.DeepseekV41DSparkModel(t, backend(), num_anchors=anchors.shape[1],
                                              enable_confidence_head=weights["confidence_head_alpha"] > 0).eval()
    draft_hf = {k: v for k, v in hf.items() if k.startswith("mtp.") or k in ("embed.weight", "head.weight")}
    draft_keys = with_scales(draft.state_dict_adapter.get_hf_state_dict_keys(draft.state_dict()))
    dload = load_native(draft, draft.state_dict_adapter, draft_hf)
    # the deterministic path: AutoModel's own forward with its anchor sampler replaced by the given anchors
    orig_sampler, orig_backbone = v41_dspark.sample_anchor_positions, v41_dspark.DeepseekV41DSparkBackbone.forward
    seen: dict = {}

    def fixed_sampler(*, seq_len, loss_mask, num_anchors, device, doc_remaining=None):
        return anchors.to(device), keep.to(device)

    def recording_backbone(self, noise_embeddings, target_hidden_states, **kw):
        seen.update(kw)
        res = orig_backbone(self, noise_embeddings, target_hidden_states, **kw)
        seen["out"] = res
        return res

    v41_dspark.sample_anchor_positions = fixed_sampler
    v41_dspark.DeepseekV41DSparkBackbone.forward = recording_backbone
    try:
        with torch.no_grad():
            dout = draft(ids, batch.target_hidden_states, loss_mask, batch.target_last_hidden_states)
            loss, terms = compute_dspark_loss(outputs=dout, loss_decay_gamma=weights["loss_decay_gamma"],
                                              ce_loss_alpha=weights["ce_loss_alpha"],
                                              l1_loss_alpha=weights["l1_loss_alpha"],
                                              confidence_head_alpha=weights["confidence_head_alpha"], return_terms=True)
    finally:
        v41_dspark.sample_anchor_positions, v41_dspark.DeepseekV41DSparkBackbone.forward = orig_sampler, orig_backbone
    K = t.dspark_block_size
    from nemo_automodel.components.speculative.dspark.loss import _compute_accept_rate_3d, _compute_l1_dist_per_token

    accept = _compute_accept_rate_3d(_compute_l1_dist_per_token(draft_logits=dout.draft_logits,
                                                                aligned_target_logits=dout.aligned_target_logits))
    noise_ids = torch.full((B, anchors.shape[1] * K), t.dspark_noise_token_id, dtype=torch.long)
    noise_ids[:, ::K] = torch.where(keep, torch.gather(ids, 1, anchors), torch.full_like(anchors, t.dspark_noise_token_id))
    res = {
        "draft_logits": f32(dout.draft_logits), "confidence": f32(dout.confidence_pred), "target_ids": f32(dout.target_ids),
        "eval_mask": f32(dout.eval_mask), "block_keep_mask": f32(dout.block_keep_mask),
        "aligned_target_logits": f32(dout.aligned_target_logits), "accept_rate": f32(accept), "noise_ids": noise_ids,
        "previous_token_ids": f32(seen["previous_token_ids"]), "position_ids": f32(seen["position_ids"]),
        "attention_visible": f32(seen["attention_mask"] == 0), "normalized_hidden": f32(seen["out"].normalized_hidden_states),
        "loss": f32(loss), "loss_terms": {k: f32(v) for k, v in terms.items()}, "loss_weights": weights,
        "loss_definition": "ce_loss_alpha*CE(draft_logits, target_ids) + l1_loss_alpha*L1(softmax draft, softmax "
                           "aligned target) + confidence_head_alpha*BCEwithlogits(confidence, accept_rate.detach()); "
                           "each term a mean weighted by eval_mask (times exp(-k/gamma) if loss_decay_gamma)",
        "slot_layout": f"block of K={K} slots per anchor a: slot 0 input = token at a, slots 1..K-1 input = noise token "
                       f"{t.dspark_noise_token_id}; positions a..a+K-1; slot k predicts the token at a+1+k; queries see "
                       f"target features [a-{t.sliding_window}, a) and their own block (bidirectional)",
        "anchors": anchors, "keep": keep,
    }
    return res, draft_keys, dload


# ------------------------------------------------------------------------------------------------------------ V4
def run_v4(folder: Path, cfg_json: dict, hf: dict, inp: dict, score_func_from_config: bool = False) -> dict:
    from nemo_automodel.components.models.deepseek_v4.config import DeepseekV4Config
    from nemo_automodel.components.models.deepseek_v4.model import DeepseekV4ForCausalLM
    from nemo_automodel.components.speculative.dspark.target import HFDSparkTargetModel

    cfg = {**cfg_json, "torch_dtype": "float32", "dtype": "float32"}
    config = DeepseekV4Config.from_dict(cfg)
    # AutoModel's DeepseekV4Model builds its MoEConfig with score_func="sqrtsoftplus" whatever the config's
    # scoring_func (the release's choice); --v4-score-func-from-config passes the config's through moe_overrides
    overrides = {"score_func": cfg.get("scoring_func", "sqrtsoftplus")} if score_func_from_config else None
    model = DeepseekV4ForCausalLM(config, backend=backend(), moe_overrides=overrides).eval()
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    model.float()
    expected = with_scales(model.state_dict_adapter.to_hf(model.state_dict()).keys())
    load = load_native(model, model.state_dict_adapter, hf)
    roles = {int(i): {"compress_ratio": int(layer.self_attn.compress_ratio),
                      "indexer": bool(layer.self_attn.compress_ratio == 4),
                      "hash_routing": bool(layer.is_hash_routing_layer)} for i, layer in model.model.layers.items()}

    ids = inp["input_ids"].long()
    B, T = ids.shape
    am = inp.get("attention_mask", torch.ones(B, T, dtype=torch.long)).long()
    loss_mask = inp.get("loss_mask", torch.ones(B, T, dtype=torch.long))
    capture = [int(i) for i in inp["capture_layers"]]
    streams: dict[int, torch.Tensor] = {}
    outs: dict[int, torch.Tensor] = {}
    handles = []
    for i, layer in model.model.layers.items():
        handles.append(layer.register_forward_pre_hook(
            lambda _m, args, kwargs, i=int(i): streams.__setitem__(i, (kwargs.get("x") if "x" in kwargs else args[0]).detach().clone()),
            with_kwargs=True))
        handles.append(layer.register_forward_hook(lambda _m, _a, o, i=int(i): outs.__setitem__(i, o.detach().clone())))
    with torch.no_grad():
        out = model(ids, attention_mask=am)
    for h in handles:
        h.remove()
    target = HFDSparkTargetModel(model, target_layer_ids=capture)
    with torch.no_grad():
        batch = target.generate_batch(ids, am, loss_mask)
    H = config.hidden_size
    result = {
        "streams_in": {i: f32(s) for i, s in sorted(streams.items())},
        "streams_out_last": f32(outs[max(outs)]),
        "features": f32(batch.target_hidden_states.reshape(B, T, len(capture), H)),
        "final_hidden": f32(batch.target_last_hidden_states),
        "logits": f32(out.logits),
    }
    meta_keys(result, hf, expected, set(), load)
    result["meta"].update(roles=roles, text_config=config.to_dict(),
                          feature_rule="layer i < last: mean over hc of layer i's OUTPUT (= streams_in[i+1]); "
                                       "last layer: final_hidden (post hc_head + norm)")
    return result


def meta_keys(result: dict, hf: dict, backbone_keys: set, draft_keys: set, load: dict) -> None:
    from importlib.metadata import version

    present = set(hf)
    consumed = present & (backbone_keys | draft_keys)
    result["meta"] = {
        "automodel_version": version("nemo-automodel"), "torch": torch.__version__,
        "consumed_keys": sorted(consumed), "ignored_keys": sorted(present - consumed),
        "missing_keys": sorted((backbone_keys | draft_keys) - present - {k for k in backbone_keys | draft_keys
                                                                          if k.endswith(".scale")}),
        "load": load,
    }


def lower_index_ties() -> None:
    """`Tensor.topk` with ties to the lower index (the indexer's and the candidate blocks' selection call it as a
    method): ReLU index scores tie at exactly 0 where no indexer head fires, and torch leaves their order unspecified."""
    def topk(self, k, dim=-1, largest=True, sorted=True):
        idx = torch.sort(self, dim=dim, descending=largest, stable=True).indices.narrow(dim, 0, k)
        return torch.return_types.topk((self.gather(dim, idx), idx))

    torch.Tensor.topk = topk


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", required=True, help="release-layout checkpoint folder")
    ap.add_argument("--inputs", required=True, help="IN.pt")
    ap.add_argument("--out", required=True, help="OUT.pt")
    ap.add_argument("--cache-quant", choices=["on", "off"], default="on",
                    help="AutoModel's forward-time cache quantisation (fp8 window KV, mxfp4 index q/k, nvfp4 "
                         "compressed KV; V4.1 only, it has no switch: off patches quantize_cache to identity)")
    ap.add_argument("--torch-ties", action="store_true",
                    help="keep torch's own order among equal scores at the indexer's top-k boundary (default: the lower "
                         "entry first, dstrain's rule: torch leaves the order of equal values unspecified)")
    ap.add_argument("--v4-score-func-from-config", action="store_true",
                    help="V4 only: route with the config's scoring_func (AutoModel itself always uses sqrtsoftplus, "
                         "the release's; a config asking for sigmoid is otherwise silently scored by sqrtsoftplus)")
    args = ap.parse_args(argv)
    if not args.torch_ties:
        lower_index_ties()
    folder = Path(args.checkpoint)
    cfg_json = json.loads((folder / "config.json").read_text())
    inp = torch.load(args.inputs, map_location="cpu", weights_only=False)
    t = time.perf_counter()
    hf = read_release(folder)
    t_read = time.perf_counter() - t
    mt = cfg_json.get("model_type")
    t = time.perf_counter()
    if mt == "deepseek_v41":
        result = run_v41(folder, cfg_json, hf, inp, args.cache_quant == "on")
    elif mt == "deepseek_v4":
        if inp.get("dspark") is not None:
            raise SystemExit("automodel_side: dspark inputs are for deepseek_v41 (V4's own drafter is MTP)")
        result = run_v4(folder, cfg_json, hf, inp, args.v4_score_func_from_config)
    else:
        raise SystemExit(f"automodel_side: model_type {mt!r}: deepseek_v41 or deepseek_v4")
    result["meta"].update(model_type=mt, cache_quant=args.cache_quant,
                          v4_score_func_from_config=args.v4_score_func_from_config, capture_layers=list(inp["capture_layers"]),
                          seconds={"imports": T_IMPORTS, "read": t_read, "build_load_forward": time.perf_counter() - t})
    torch.save(result, args.out)
    m = result["meta"]
    print(f"automodel_side: {mt} {tuple(inp['input_ids'].shape)} -> {args.out}: {len(m['consumed_keys'])} keys consumed, "
          f"{len(m['ignored_keys'])} ignored, {len(m['missing_keys'])} missing; "
          f"native missing {len(m['load']['missing_native'])} unexpected {len(m['load']['unexpected_native'])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
