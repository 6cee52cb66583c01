"""Which DeepSpec settings this run keeps as DeepSpec's config has them and which it matches to protocol 2 (with
why), and how its execution differs from DeepSpec's own: the record states all three."""

from __future__ import annotations

# Why each matched setting is matched; the values come from the protocol-2 run's resolved recipe at run time.
MATCHED_WHY = {
    "seed": "the protocol-2 run's seed (DeepSpec's seed_all; also its anchor sampler's RNG)",
    "model.target_model_name_or_path": "the target the paper recipe builds (SmolLM2-135M upcycled, 8 experts)",
    "model.block_size": "protocol 2's block size",
    "model.num_draft_layers": "protocol 2's DSpark depth",
    "model.target_layer_ids": "the target layers dstrain captures (its features are read, DeepSpec's -1/+1 convention "
                              "matches: layer i's output)",
    "model.mask_token_id": "dstrain's drafter.mask_token_id (DeepSpec's is a Qwen3 token id)",
    "model.num_anchors": "dstrain's anchors.per_sequence: the same number of blocks per sample (DeepSpec samples 512 "
                         "per sequence of up to 4096 tokens)",
    "train.max_train_steps": "protocol 2's optimizer steps (the schedule's length: DeepSpec's total_steps)",
    "train.global_batch_size": "samples per optimizer step of the dstrain run (micro_batch_size x grad_accum)",
    "train.precision": "the protocol's dtype (the target and dstrain's drafter train in fp32 on CPU); DeepSpec's "
                       "BF16Optimizer keeps fp32 master weights either way",
    "train.torch_compile": "not a numerical setting: nothing is compiled here (CPU, one process)",
    "data.max_length": "dstrain's data.max_length: samples cut where the dstrain run cuts them",
}
NOT_USED = ("train.trainer_cls", "train.num_train_epochs", "train.sharding_strategy", "data.target_cache_path",
            "data.chat_template", "data.num_workers", "logging", "project_name", "exp_name")
EXECUTION = [
    "one process, no FSDP: DeepSpec's BaseTrainer needs CUDA, FSDP and its own target-cache dataset, so this tool runs "
    "its step itself: per sample (local_batch_size 1) model(...) -> compute_dspark_loss(...) / accumulation -> backward, "
    "then clip_grad_norm_(max_grad_norm) and BF16Optimizer.step(), as BaseTrainer.train does",
    "attention: on the CPU DeepSpec's flex-attention BlockMask (its own create_dspark_attention_mask) is evaluated to the "
    "dense mask and run as SDPA (flex attention has no CPU backward); fully masked rows give 0 as flex does",
    "data: dstrain's shards and loader, target features from dstrain's target forward (fp32, the feature cache), not "
    "DeepSpec's bf16 target cache",
    "evaluation: dstrain's decoder through DeepSpecDrafter; it recomputes the fused context and its keys/values every "
    "round (DeepSpec's evaluator keeps a draft KV cache cropped to the context: the same numbers, more work)",
    "library versions: this venv's torch and transformers (DeepSpec pins torch 2.9.1, transformers 5.10.2); DeepSpec's "
    "own evaluator step (eval/dspark/draft_ops.forward_dspark_draft_block) fails with transformers 5.24: it crops its "
    "draft cache with DynamicCache.crop(start), a positive argument that version refuses; the parity check makes its "
    "backbone call itself",
]


def matched_opts(recipe, frozen_capture: list[int], steps: int, target_dir: str, num_anchors: int | None) -> dict:
    """DeepSpec config key -> the value protocol 2's run gives it (read from that run's resolved recipe)."""
    d, t = recipe.drafter, recipe.train
    return {
        "seed": int(recipe.run.seed),
        "model.target_model_name_or_path": target_dir,
        "model.block_size": int(d.block_size),
        "model.num_draft_layers": int(d.num_layers),
        "model.target_layer_ids": [int(i) for i in frozen_capture],
        "model.mask_token_id": int(d.mask_token_id),
        "model.num_anchors": int(num_anchors if num_anchors is not None else recipe.anchors.per_sequence),
        "train.max_train_steps": int(steps),
        "train.global_batch_size": int(t.micro_batch_size * t.grad_accum),
        "train.precision": "fp32" if recipe.target.dtype == "float32" else "bf16",
        "train.torch_compile": False,
        "data.max_length": int(recipe.data.max_length),
    }


def _get(cfg: dict, dotted: str):
    cur = cfg
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return None
        cur = cur[part]
    return cur


def settings(original: dict, used: dict, skipped: list[str], matched: dict) -> tuple[dict, dict]:
    """(kept, matched): every DeepSpec model/train setting this run uses as DeepSpec's config has it, and every one
    changed to protocol 2's value with DeepSpec's own value beside it."""
    kept = {}
    for section in ("model", "train"):
        for key, value in sorted(used.get(section, {}).items()):
            dotted = f"{section}.{key}"
            if dotted in matched or dotted in NOT_USED or dotted.split(".")[0] in NOT_USED:
                continue
            kept[dotted] = value
    kept["model class"] = "deepspec.modeling.dspark.qwen3.Qwen3DSparkModel (built by build_draft_config; q/k-norm " \
                          "attention over [context; block], dense SwiGLU MLP of the target's intermediate size, no window)"
    kept["loss"] = "deepspec.modeling.dspark.loss.compute_dspark_loss (CE + L1 + confidence BCE, position decay " \
                   "exp(-k/loss_decay_gamma) from the anchor's slot k = 0)"
    kept["optimizer"] = "deepspec.utils.optim.BF16Optimizer: AdamW (torch defaults: betas 0.9/0.999, eps 1e-8) on fp32 " \
                        "masters, linear warmup of int(warmup_ratio x steps) then cosine to 0 at the last step"
    kept["anchor sampler"] = "DeepSpec's sample_anchor_positions (inside the model's forward, torch's global RNG)"
    kept["initialisation"] = "transformers' Qwen3PreTrainedModel init; embedding and LM head copied from the target, frozen"
    out = {k: {"deepspec": _get(original, k), "used": v, "why": MATCHED_WHY[k]} for k, v in matched.items()}
    if skipped:
        out["_not literals in DeepSpec's config (not used)"] = skipped
    return kept, out

