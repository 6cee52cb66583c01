#!/bin/bash
# Train a DSpark drafter on a Slurm cluster: one torchrun per node, rendezvous from the Slurm environment.
#
#   sbatch --nodes 4 slurm/train_dspark_moe.sh qwen3_moe [section.key=value ...]   # a shipped recipe name, or a YAML path
#
# Layout: the recipe's world (world.drafter_ranks + world.target tp*pp*dp, or the colocated replicas) must equal
# nodes x DSTRAIN_NPROC_PER_NODE. Ranks are numbered node by node and drafters come first, so the first
# ceil(drafters / nproc) nodes run DeepSpeed drafter workers and the rest serve the megatron target; the
# script prints which node does what before launching.
# GPUs: 8 per node requested (the header's default); override at submission, e.g. `sbatch --gpus-per-node=4`, and
# `sbatch --gpus-per-node=0` on a CPU-only cluster (Slurm refuses any GPU request where no gres is configured).
# Logs: submit from the repository root: this script's own output goes to logs/%x-%j.out (logs/ is in the
# repository, so it exists when Slurm opens the file, before the script runs); each node's training output to
# $DSTRAIN_LOG_DIR (default logs/slurm-JOBID)/node-N.log.
# Rendezvous: torchrun's c10d rendezvous on the first node, keyed by the job id.
# Preemption / time limit: the job is requeueable. 120 s before the limit Slurm sends USR1 to this script (and on
# preemption SIGTERM, or USR1 where the cluster sets PreemptParameters=send_user_signal); the script forwards USR1
# to every training process, the drafters save a checkpoint at the next step boundary (all at the same step), every
# process exits, and the script requeues the job. The requeued job resumes from that checkpoint, at the sample
# where it stopped — nothing to pass. A SIGTERM that Slurm sends to the training processes themselves ends them at
# once (the last periodic checkpoint counts): give preemption a GraceTime and send_user_signal to save instead.
# A rank that dies or gets stuck inside the job: dstrain's watchdog names it, every rank exits, and torchrun restarts
# the node's workers from the latest good checkpoint, up to DSTRAIN_MAX_RESTARTS times (default 2) before the job fails.
# Environment: DSTRAIN_NPROC_PER_NODE (default: the job's GPUs on the node, else 1), DSTRAIN_PYTHON (default .venv/bin/python),
# DSTRAIN_MASTER_PORT (default 29500 + JOBID % 20000), DSTRAIN_MAX_RESTARTS (default 2).
#SBATCH --job-name=dstrain-dspark
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120
#SBATCH --output=logs/%x-%j.out
set -euo pipefail

# The notice handler comes first: a USR1 that arrives while the script is still starting must not kill it.
NOTICE= FORWARD=
notice() {  # Slurm's warning: every training process saves at its next step boundary, then the job is requeued
  [[ -n "$NOTICE" ]] && return
  NOTICE=$1
  echo "$1: asking the training processes for a checkpoint (USR1 to job $SLURM_JOB_ID's steps)"
  # in the background and bounded: a job Slurm is already ending refuses signals and scancel retries
  timeout 20 scancel --signal=USR1 "$SLURM_JOB_ID" >/dev/null 2>&1 &
  FORWARD=$!
}
trap 'notice USR1' USR1
trap 'notice SIGTERM' TERM

RECIPE=${1:?usage: sbatch slurm/train_dspark_moe.sh RECIPE [section.key=value ...]}
shift
REPO=${SLURM_SUBMIT_DIR:-$(pwd)}
cd "$REPO"
PY=${DSTRAIN_PYTHON:-$REPO/.venv/bin/python}
if [[ -z "${DSTRAIN_NPROC_PER_NODE:-}" ]]; then
  # the GPUs Slurm gave this job on the node (nvidia-smi may list the node's others too)
  DSTRAIN_NPROC_PER_NODE=${SLURM_GPUS_ON_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | grep -c '^GPU' || true)}
  [[ "$DSTRAIN_NPROC_PER_NODE" -ge 1 ]] || DSTRAIN_NPROC_PER_NODE=1
fi
NNODES=${SLURM_JOB_NUM_NODES:-1}
NODES=($(scontrol show hostnames "${SLURM_JOB_NODELIST:-localhost}"))
LOG_DIR=${DSTRAIN_LOG_DIR:-$REPO/logs/slurm-${SLURM_JOB_ID:-local}}
mkdir -p "$LOG_DIR"

WORLD_JSON=$("$PY" -m dstrain train "$RECIPE" "$@" --print-world)
read -r WORLD DRAFTERS <<<"$("$PY" -c 'import json,sys; w=json.loads(sys.argv[1]); print(w["world_size"], w["drafter_ranks"])' "$WORLD_JSON")"
if (( WORLD != NNODES * DSTRAIN_NPROC_PER_NODE )); then
  echo "error: the recipe's world needs $WORLD processes but the job has $NNODES node(s) x $DSTRAIN_NPROC_PER_NODE;" \
       "submit with --nodes $(( (WORLD + DSTRAIN_NPROC_PER_NODE - 1) / DSTRAIN_NPROC_PER_NODE )) or set DSTRAIN_NPROC_PER_NODE" >&2
  exit 2
fi
for i in "${!NODES[@]}"; do
  first=$(( i * DSTRAIN_NPROC_PER_NODE )); last=$(( first + DSTRAIN_NPROC_PER_NODE - 1 ))
  role=target; (( last < DRAFTERS )) && role=drafter
  (( first < DRAFTERS && last >= DRAFTERS )) && role="drafter+target"
  grep -q '"colocated"' <<<"$WORLD_JSON" && role=colocated
  echo "node $i ${NODES[$i]}: ranks $first-$last ($role)"
done

export MASTER_ADDR=${NODES[0]}
export MASTER_PORT=${DSTRAIN_MASTER_PORT:-$(( 29500 + ${SLURM_JOB_ID:-0} % 20000 ))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export WANDB_MODE=${WANDB_MODE:-offline}
# A failed or hung NCCL collective raises instead of hanging, and dumps its flight record; Python prints every
# thread's stack on a fatal signal. Each only where the user has not set it.
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export TORCH_NCCL_DUMP_ON_TIMEOUT=${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}
export TORCH_FR_BUFFER_SIZE=${TORCH_FR_BUFFER_SIZE:-2000}  # the flight recorder that dump writes (torch 2.13 names)
export TORCH_FR_DUMP_TEMP_FILE=${TORCH_FR_DUMP_TEMP_FILE:-$LOG_DIR/nccl_trace_rank_}
export PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-1}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
echo "job ${SLURM_JOB_ID:-local} (restart ${SLURM_RESTART_COUNT:-0}): $WORLD ranks, rendezvous $MASTER_ADDR:$MASTER_PORT (c10d), logs $LOG_DIR"

# One torchrun per node; --kill-on-bad-exit ends every node when one fails (dstrain's watchdog names the rank).
# srun starts the command without a shell: bash -c reads each node's own SLURM_NODEID. USR1 reaches every process of
# the step: torchrun (and, until the trainer installs its handler, each worker) ignores it rather than dying of it.
srun --ntasks-per-node=1 --kill-on-bad-exit=1 --output="$LOG_DIR/node-%n.log" \
  bash -c 'trap "" USR1; py=$1; shift; exec "$py" -m torch.distributed.run --node-rank "$SLURM_NODEID" "$@"' _ "$PY" \
  --nnodes "$NNODES" --nproc-per-node "$DSTRAIN_NPROC_PER_NODE" \
  --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" --rdzv-id "${SLURM_JOB_ID:-local}" \
  --max-restarts "${DSTRAIN_MAX_RESTARTS:-2}" \
  -m dstrain train "$RECIPE" "$@" &
TRAIN=$!
code=0
while true; do  # a trapped signal interrupts wait: wait again until the training step has ended
  wait "$TRAIN" && code=0 || code=$?
  kill -0 "$TRAIN" 2>/dev/null || break
done
if [[ -n "$FORWARD" ]]; then  # a forwarder still retrying would signal the requeued job's next start (same job id)
  kill "$FORWARD" 2>/dev/null || true
  wait "$FORWARD" 2>/dev/null || true
fi
if [[ -n "$NOTICE" ]]; then
  echo "training stopped after the $NOTICE notice (exit $code): requeueing job $SLURM_JOB_ID; it resumes from the checkpoint"
  scontrol requeue "$SLURM_JOB_ID" || true  # already requeued where Slurm itself requeues a preempted job
fi
exit "$code"
