"""dstrain's V4.1 DSpark drafter against AutoModel's on one batch (runs in dstrain's venv, after automodel_side.py).

The drafter is read from the release folder's own mtp.* (families/deepseek_v41/export_format.read, as
drafter.init_from reads a release) and fed AutoModel's captured features and AutoModel's anchors, so the drafter alone
is compared: draft logits (lm_head(norm(h)) + the Markov bias), confidence logits, and AutoModel's loss
(compute_dspark_loss: 0.1 CE + 0.9 L1 + 1.0 BCE(confidence, clamp(1 - L1/2)), eval-mask means) computed from ours.
AutoModel's trainer feeds the confidence head the normed state, the engines the pre-norm one (drafter.py): the check
runs ours the AutoModel way and reports how far the engines' input moves the confidence.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F


def load_release_drafter(folder: Path):
    """(drafter, lm_head weight, embedding weight) from a V4.1 release's own mtp.* and its embed / head."""
    from dstrain.drafters.contract import TargetSpec
    from dstrain.families.deepseek_v41 import export_format
    from dstrain.families.deepseek_v41.drafter import V41BlockDrafter
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.configs import load_config
    from dstrain.targets.shard_plan import full

    cfg = load_config(folder)
    t = cfg.get_text_config()
    section, ids, state, _ = export_format.read(folder, json.loads((folder / "config.json").read_text()))
    with CheckpointReader(folder, torch.float32) as reader:
        embed = reader.read(full("embed.weight", (t.vocab_size, t.hidden_size)))
        head = reader.read(full("head.weight", (t.vocab_size, t.hidden_size)))
    spec = TargetSpec(t.hidden_size, t.vocab_size, len(ids), t.num_attention_heads, 1, t.moe_intermediate_size)
    drafter = V41BlockDrafter(SimpleNamespace(**section, ffn=None), spec, torch.nn.Embedding.from_pretrained(embed), cfg)
    drafter.load_state_dict({k: v.float() for k, v in state.items()})
    return drafter.eval(), head


def automodel_loss(logits, targets, mask, aligned, conf) -> dict:
    w = mask.float()
    ce = (F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none").view_as(w) * w).sum() / (w.sum() + 1e-6)
    l1 = (logits.float().softmax(-1) - aligned.float().softmax(-1)).abs().sum(-1)
    l1_loss = (l1 * w).sum() / (w.sum() + 1e-6)
    bce = F.binary_cross_entropy_with_logits(conf.float(), (1 - 0.5 * l1).clamp(0, 1), reduction="none")
    conf_loss = (bce * w).sum() / (w.sum() + 1e-6)
    return {"ce_loss": ce, "l1_loss": l1_loss, "confidence_loss": conf_loss,
            "loss": 0.1 * ce + 0.9 * l1_loss + 1.0 * conf_loss}


@torch.no_grad()
def compare(folder: str | Path, inputs: str | Path, reference: str | Path) -> dict:
    from dstrain.packing.blocks import pack_blocks

    folder = Path(folder)
    inp = torch.load(inputs, weights_only=False)
    ref = torch.load(reference, weights_only=False)
    d = ref["dspark"]
    drafter, head = load_release_drafter(folder)
    ids, anchors = inp["input_ids"], inp["dspark"]["anchors"]
    B, T = ids.shape
    K = d["draft_logits"].shape[2]
    packed = pack_blocks(list(ids), [torch.ones(T, dtype=torch.bool)] * B, list(anchors), K, drafter.mask_token_id,
                         drafter.dims.window)
    feats = ref["features"].reshape(B * T, *ref["features"].shape[2:])
    out = {}
    for how in ("normed", "pre_norm"):
        drafter.confidence_input = how
        o = drafter(packed, feats[packed.ctx_rows])
        out[how] = (o.hidden, o.seq_factor, o.confidence_logits)
    hidden, factor, conf = out["normed"]
    logits = (hidden @ head.t() + factor @ drafter.seq_w2).view(B, -1, K, head.shape[0])
    conf = conf.view(B, -1, K)
    mask = d["eval_mask"]
    ours = automodel_loss(logits, d["target_ids"], mask, d["aligned_target_logits"], conf)
    theirs = {k: float(d["loss_terms"][k]) for k in ours}
    scale = d["draft_logits"].abs().max().item()
    return {
        "draft_logits": {"max_abs_diff": (logits - d["draft_logits"]).abs().max().item(), "scale": scale},
        "normalized_hidden": {"max_abs_diff": (hidden.reshape(B, -1, hidden.shape[-1]) - d["normalized_hidden"]).abs().max().item(),
                              "scale": d["normalized_hidden"].abs().max().item()},
        "confidence": {"max_abs_diff": (conf - d["confidence"]).abs().max().item(), "scale": d["confidence"].abs().max().item()},
        "loss": {k: {"ours": float(ours[k]), "automodel": theirs[k], "abs_diff": abs(float(ours[k]) - theirs[k])} for k in ours},
        "engines_confidence_input_moves_confidence_by": (out["pre_norm"][2] - out["normed"][2]).abs().max().item(),
        "blocks": int(mask.any(-1).sum()), "slots_scored": int(mask.sum()),
    }
