"""DeepSeek-V4 three-way reference check (dstrain's venv): the SAME tiny V4 weights run by

  (a) transformers' DeepseekV4ForCausalLM (dstrain's HFTarget, indexer ties to the lower entry index),
  (b) dstrain's megatron-core V4 target (MegatronTarget, one process, a world of one gloo rank, TP=PP=EP=1), reading
      the same release-layout copy AutoModel reads (transformers' config: transformers cannot parse the release's),
  (c) NeMo AutoModel 0.7.0's deepseek_v4 (tools/reference_check/automodel_side.py in .venv-automodel, reading a
      release-layout copy written by tools/reference_check/v4_release.py).

    OMP_NUM_THREADS=1 .venv/bin/python tools/reference_check/v4_compare.py [--case mixed] [--keep DIR]

The model is tests/integration/workers/v4_parity.py's (`hf_model(case)`, every V4 feature on: sliding / CSA / HCA
layers, hash and score-routed MoE, the indexer's top-k shorter than its candidates); inputs 2 × 70 tokens (its
seed), capture layers [0, 1, 2, 3].

What is compared (max |Δ| per pair, fp32):
  layer i   the mean over the hc streams LEAVING layer i: dstrain / transformers capture it so (HFTarget._readout,
            MegatronTarget readout); AutoModel's streams_in[i+1] (a pre-hook on block i+1) for i < last, and
            streams_out_last (a hook on the last block) for the last layer.
  final     the final-norm output after the hc head collapse (AutoModel: HFDSparkTargetModel's
            target_last_hidden_states; transformers: last_hidden_state).
  logits    final @ head.weightᵀ for ours / transformers, AutoModel's own lm_head logits.
Also `automodel_feature_vs_streams`: AutoModel's own `features` (HFDSparkTargetModel) against its streams, a check of
the mapping above. Prints one line "V4REF {json}".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
ROOT = Path(__file__).resolve().parents[2]
for p in (ROOT, ROOT / "tools" / "reference_check", ROOT / "tests", ROOT / "tests" / "integration", ROOT / "tests" / "integration" / "workers"):
    sys.path.insert(0, str(p))

CAPTURE = [0, 1, 2, 3]
AUTOMODEL_PY = ROOT / ".venv-automodel" / "bin" / "python"
AUTOMODEL_SIDE = ROOT / "tools" / "reference_check" / "automodel_side.py"


def run_automodel(release: Path, inp: Path, out: Path, extra: list[str]) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([str(AUTOMODEL_PY), str(AUTOMODEL_SIDE), "--checkpoint", str(release), "--inputs", str(inp),
                        "--out", str(out), *extra], capture_output=True, text=True, env=env, cwd=str(ROOT))
    if r.returncode != 0:
        raise SystemExit(f"v4_compare: automodel_side failed ({r.returncode}):\n{r.stdout[-4000:]}\n{r.stderr[-8000:]}")
    return r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="mixed", help="a v4_parity CASES entry without quantisation (default mixed)")
    ap.add_argument("--keep", default=None, help="write the folders / IN.pt / OUT.pt here and keep them")
    ap.add_argument("--random-norms", action="store_true",
                    help="also set every RMSNorm weight (layer, q, kv, compressor, indexer, final norms) to 1 + 0.5·N(0,1): "
                         "v4_parity's model leaves them at 1, where a norm read under a wrong name goes unseen")
    ap.add_argument("--automodel-args", default="", help="extra arguments for automodel_side.py (space separated)")
    args = ap.parse_args(argv)

    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    import v4_parity as P  # noqa: E402  (tests/integration/workers)
    from dstrain.families.deepseek_v4 import blocks as v4_blocks
    from dstrain.runtime.world import Layout, target_process_groups
    from dstrain.targets import cpu_compat
    from dstrain.targets.checkpoint import CheckpointReader
    from dstrain.targets.megatron import MegatronTarget
    from v4_release import release_copy  # tools/reference_check

    if args.case not in P.CASES or args.case.endswith("_fp8"):
        raise SystemExit(f"v4_compare: --case one of {[c for c in P.CASES if not c.endswith('_fp8')]}")
    case = P.CASES[args.case]
    v4_blocks.QUERY_BLOCK = 16  # as v4_parity: several query blocks per sequence
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="v4ref-"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir, rel_dir = work / "hf", work / "release"
    for d in (hf_dir, rel_dir):
        shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    hf = P.hf_model(case, str(hf_dir))
    if args.random_norms:
        g = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith("norm.weight"):
                    p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))
        shutil.rmtree(hf_dir)
        hf.save_pretrained(str(hf_dir), max_shard_size="20KB")
    renames = release_copy(hf_dir, rel_dir)
    ids = torch.randint(0, hf.config.vocab_size, P.SEQ, generator=torch.Generator().manual_seed(1))
    inp_path, out_path = work / "IN.pt", work / "OUT.pt"
    torch.save({"input_ids": ids, "capture_layers": CAPTURE}, inp_path)

    am_line = run_automodel(rel_dir, inp_path, out_path, args.automodel_args.split())
    am = torch.load(out_path, map_location="cpu", weights_only=False)

    ref = P.reference(hf, ids)  # transformers, indexer ties to the lower index
    dist.init_process_group("gloo", init_method="file://" + str(work / "pg"), rank=0, world_size=1)
    try:
        patches = cpu_compat.apply()
        groups = target_process_groups(Layout(tp=1, pp=1, dp=1, ep=1, drafters=0, disaggregated=True))
        torch.manual_seed(0)
        with CheckpointReader(str(rel_dir), torch.float32) as reader:  # the release copy AutoModel reads: one checkpoint
            tgt = MegatronTarget(hf.config, reader, "v4", groups, capture_layers=CAPTURE)
        with torch.no_grad():
            tgt(ids)
    finally:
        dist.destroy_process_group()

    head = hf.lm_head.weight.detach().float()
    streams = am["streams_in"]
    last = max(streams)
    am_layers = {i: (streams[i + 1] if i < last else am["streams_out_last"]).mean(2) for i in CAPTURE}
    sides = {
        "transformers": {"layers": {i: ref.captured[:, :, j].float() for j, i in enumerate(CAPTURE)},
                         "final": ref.final_hidden.float()},
        "ours": {"layers": {i: tgt.local_captured[:, :, j].float() for j, i in enumerate(CAPTURE)},
                 "final": tgt.final_hidden.float()},
        "automodel": {"layers": am_layers, "final": am["final_hidden"].float()},
    }
    for s in ("transformers", "ours"):
        sides[s]["logits"] = sides[s]["final"] @ head.T
    sides["automodel"]["logits"] = am["logits"].float()

    def d(a, b):
        return float((a - b).abs().max())

    pairs = {"transformers_vs_automodel": ("transformers", "automodel"), "ours_vs_automodel": ("ours", "automodel"),
             "ours_vs_transformers": ("ours", "transformers")}
    report = {"case": args.case, "random_norms": args.random_norms, "seq": list(P.SEQ), "capture_layers": CAPTURE}
    for name, (a, b) in pairs.items():
        A, B = sides[a], sides[b]
        report[name] = {**{f"layer{i}": d(A["layers"][i], B["layers"][i]) for i in CAPTURE},
                        "final": d(A["final"], B["final"]), "logits": d(A["logits"], B["logits"])}
    report["scale"] = {**{f"layer{i}": float(sides["transformers"]["layers"][i].abs().max()) for i in CAPTURE},
                       "final": float(sides["transformers"]["final"].abs().max()),
                       "logits": float(sides["transformers"]["logits"].abs().max())}
    feats = am["features"]
    report["automodel_feature_vs_streams"] = {
        **{f"layer{i}": d(feats[:, :, j], am_layers[i]) for j, i in enumerate(CAPTURE) if i < last},
        f"layer{last}_feature_vs_final": d(feats[:, :, CAPTURE.index(last)], am["final_hidden"])} if last in CAPTURE else {}
    m = am["meta"]
    report["automodel"] = {"line": am_line, "ignored_keys": m["ignored_keys"], "missing_keys": m["missing_keys"],
                           "missing_native": m["load"]["missing_native"],
                           "unexpected_native": m["load"]["unexpected_native"], "roles": m["roles"]}
    if hf.config.scoring_func != "sqrtsoftplus" and "--v4-score-func-from-config" not in args.automodel_args:
        report["note"] = (f"scoring_func {hf.config.scoring_func}: AutoModel's DeepseekV4Model always routes with "
                          "sqrtsoftplus; pass --automodel-args=--v4-score-func-from-config to route it as configured")
    report["renamed_keys"] = len(renames)
    report["cpu_patches"] = patches
    report["seconds"] = round(time.perf_counter() - t0, 1)
    report["workdir"] = str(work) if args.keep else None
    print("V4REF " + json.dumps(report), flush=True)
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
