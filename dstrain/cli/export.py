"""Export a trained drafter as a self-describing Hugging Face style folder: config.json (drafter and target
sections, the target's capture layers, a fingerprint of its frozen embedding and LM head, STS temperatures)
and model.safetensors (trainable weights only: the embedding and LM head stay the target's). --format speculators
writes the layout vLLM's speculators loader reads (DSpark / DFlash drafters trained with drafter.qk_norm=true,
drafter.mask_token_id set, a dense FFN and no mHC); dstrain eval and dstrain calibrate read either. --engine names the
program that will load it (vLLM, SGLang, or the speculators library): what no release of it can load is refused in one
line before any weights load; then each engine's verdict on this drafter and this target is printed (loads / refuses /
version-bound, each with the rule and its source, dstrain/export/engines.py) with vLLM's --speculative-config.

  dstrain export runs/smollm2-dspark exports/smollm2-dspark

--format deepseek-v4 writes a V4 DSpark drafter (one trained on a DeepSeek-V4 target) in DeepSeek-V4's own layout:
mtp.{i}.* safetensors shards + model.safetensors.index.json + config.json (the target's, with dspark_target_layer_ids,
dspark_markov_rank, dspark_noise_token_id, n_mtp_layers, ...), quantised like the target checkpoint (FP8 e4m3 in its
blocks, 128x128 for V4-Flash, with ue8m0 `.scale`; FP4 experts where its experts are FP4; or bf16), to drop beside
the target's checkpoint (shards named mtp-*, so they can also be copied into it, index entries merged). It is written for vLLM
DSparkDeepseekV4ForCausalLM (vllm/models/deepseek_v4/nvidia/dspark.py @ 03435722) and SGLang
DeepseekV4ForCausalLMDSpark (python/sglang/srt/models/deepseek_v4_dspark.py @ 00e5caa8) as transcribed from their
loaders; no engine was run here. The reference to compare a served drafter with: the released drafter's greedy
acceptance, 4.42 tokens/round on the V4-Flash preview at gamma=5. Other formats refuse a V4 drafter, and
deepseek-v4 refuses any other.

--format deepseek-v41 writes a V4.1 DSpark drafter (one trained on a DeepSeek-V4.1 target) in V4.1's own mtp.* layout,
the names vLLM's V4.1 DSpark loader (vllm/models/deepseek_v41/nvidia/dspark.py @ 0f6c0f5a) and NeMo AutoModel 0.7.0's
DSpark adapter read (make reference-check loads one into AutoModel), its keys in the host's text_config; a drafter
warm-started from a release's own mtp.* (drafter.init_from) and not moved since goes back bit-exact.

dstrain eval and dstrain calibrate load the folder without the training recipe; loading it against
another target is a one-line error. Of the target, export reads its config and the two tensors a drafter is bound to
(embedding and LM head, straight from its safetensors), whatever backend trained the drafter.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def parser(prog: str | None) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", help="training run folder (or an export folder, to re-export)")
    ap.add_argument("out", help="folder to write (replaced atomically)")
    from dstrain.families.registry import family_formats

    ap.add_argument("--format", default="dstrain", choices=["dstrain", "speculators", "deepspec", "sglang-eagle3",
                                                          *family_formats()],  # each family's own layout
                    help="dstrain: our own folder; speculators: the format vLLM loads (DSpark, DFlash, Eagle3, MTP-1); deepspec: "
                         "the DSpark layout SGLang's DSparkDraftModel reads; sglang-eagle3: SGLang's own Eagle3 layout "
                         "(see dstrain/export/formats.py); deepseek-v4: a V4 DSpark drafter as vLLM "
                         "DSparkDeepseekV4ForCausalLM (@ 03435722) and SGLang DeepseekV4ForCausalLMDSpark (@ 00e5caa8) "
                         "load it, quantised like the target (dstrain/families/deepseek_v4/export_format.py); deepseek-v41: the same "
                         "for V4.1 (dstrain/families/deepseek_v41/export_format.py). Default: %(default)s")
    ap.add_argument("--engine", choices=["vllm", "sglang", "speculators", "dstrain"],
                    help="the program that will load the export (default: the format's: speculators -> vllm, deepspec and "
                         "sglang-eagle3 -> sglang, deepseek-v4 and deepseek-v41 -> vllm); what it cannot load is refused before any weights "
                         "load; every engine's verdict on the target is printed after (dstrain/export/engines.py)")
    ap.add_argument("--recipe", help="training recipe, for run folders written before runs kept their recipe.yaml")
    return ap


def run(args: argparse.Namespace) -> int:
    from dstrain.export import artifacts

    art = artifacts.read_artifact(args.run, None, args.recipe)
    written_for = artifacts.check_export(art, args.format, args.engine)
    target = artifacts.frozen_target_for(art)  # embedding and LM head only: never the target's layers
    out = artifacts.export(art, target, Path(args.out), args.format, args.engine)
    params = sum(v.numel() for v in art.state.values())
    sts = "STS temperatures " + ", ".join(f"{t:.2f}" for t in art.temperatures) if art.temperatures else "not calibrated yet"
    print(f"exported {art.drafter_cfg['type']} drafter ({params / 1e6:.2f}M weights, step {art.steps}) for {target.name} "
          f"[fingerprint {artifacts.fingerprint(target)}; {target.bytes_read / 2**20:.1f} MiB of the target read: embedding"
          f" and LM head], {sts} -> {out} ({args.format} format; {written_for})")
    from dstrain.export.artifacts import export_lines

    for line in export_lines(art, target, out, args.format):
        print("  " + line)
    return 0
