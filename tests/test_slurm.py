"""slurm/train_dspark_moe.sh on a real one-node Slurm (slurmctld + slurmd on localhost, no munge, no GPUs: the
jobs are submitted with --gpus-per-node=0, which overrides the script's 8 and which Slurm accepts without gres).

1. A disaggregated tiny run (1 drafter rank + 1 target rank) is requeued by `scontrol requeue` once its first
   checkpoint exists, and must finish from that checkpoint: the sbatch script, torchrun's c10d rendezvous, per-node
   logs and the requeue path, for real.
2. The preemption notice (USR1 to the batch script, as `--signal=B:USR1@120` sends it) mid-run: the script forwards
   it, both drafter ranks save at the same step boundary, every rank exits, the script requeues, and the requeued
   job resumes from the step after the notice, drawing exactly the samples an uninterrupted run draws.
`.ci/run` installs slurm-wlm.
"""

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, free_port
from dstrain.data.shards import synthetic_shards

pytestmark = pytest.mark.distributed

CONF = """ClusterName=dstrain-test
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
MpiDefault=none
NodeName=localhost CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


@pytest.fixture
def cluster(tmp_path):
    if not shutil.which("slurmctld"):
        pytest.skip("slurm-wlm is not installed (.ci/run installs it: apt-get install slurm-wlm)")
    d = tmp_path / "slurm"
    for sub in ("state", "spool"):
        (d / sub).mkdir(parents=True)
    conf = d / "slurm.conf"
    conf.write_text(CONF.format(d=d, ctld_port=free_port(), d_port=free_port()))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
               for cmd in (["slurmctld", "-D", "-f", str(conf)], ["slurmd", "-D", "-N", "localhost", "-f", str(conf)])]
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            state = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True).stdout.strip()
            if state == "idle":
                break
            time.sleep(0.5)
        else:
            raise AssertionError(f"slurm never became idle: {(d / 'slurmctld.log').read_text()[-2000:]}")
        yield env
    finally:  # cancel jobs and wait for an empty queue before stopping the daemons (else job processes linger)
        subprocess.run(["scancel", "--full", "-u", "root"], env=env, capture_output=True)
        deadline = time.time() + 60
        while time.time() < deadline and subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
            time.sleep(0.5)
        for p in daemons:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=30)


def job_state(env, job: str) -> dict:
    out = subprocess.run(["scontrol", "show", "job", "-o", job], env=env, capture_output=True, text=True).stdout
    return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)


def early_lines(run) -> list[str]:
    return [line for line in (run / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= 10]


def test_sbatch_trains_checkpoints_and_resumes_after_requeue(cluster, tmp_path):
    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "tiny-moe", 512, 64, seed=0)
    logs, out = tmp_path / "logs", tmp_path / "runs"
    env = {**cluster, "DSTRAIN_NPROC_PER_NODE": "2", "DSTRAIN_LOG_DIR": str(logs), "DSTRAIN_MASTER_PORT": str(free_port()),
           "DSTRAIN_PYTHON": str(Path(os.sys.executable))}
    started = time.time()
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={tmp_path}/job-%j.out", "slurm/train_dspark_moe.sh",
                          "recipes/tiny_moe.yaml", f"data.shards={shards}", "world.mode=disaggregated", "world.drafter_ranks=1",
                          "train.steps=40", "train.checkpoint_every=10", "train.log_every=1", f"run.output_dir={out}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    run = out / "tiny-moe-dspark"
    requeued = False
    deadline = time.time() + 420
    while time.time() < deadline:
        state = job_state(env, job)
        if not requeued and (run / "checkpoints" / "latest").exists():
            first_ten = early_lines(run)  # steps 1-10 are logged once the step-10 checkpoint exists
            subprocess.run(["scontrol", "requeue", job], env=env, check=True, capture_output=True)
            requeued = True
        elif requeued and state.get("JobState") == "PENDING" and state.get("Reason") == "BeginTime":
            # Slurm holds a requeued job for a while before it may start again; skip the wait
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
        elif state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.5)
    elapsed = time.time() - started
    script_log = "\n".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    assert state.get("JobState") == "COMPLETED", (state, script_log[-3000:])
    assert requeued and int(state.get("Restarts", "0")) >= 1, state
    assert "node 0 localhost: ranks 0-1 (drafter+target)" in script_log
    assert (logs / "node-0.log").is_file()
    steps = [int(line.split('"step": ')[1].split(",")[0]) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps[-1] == 40 and (run / "checkpoints" / "step-40").is_dir()
    # the second start resumed from a checkpoint, not from step 0. The log alone cannot tell (the monitor drops every
    # line past the start step and training is deterministic), so: the trainer says where it resumed (node log and
    # summary), and the lines of steps 1-10 are byte for byte the first start's (wall-clock rates differ if redone).
    # Mutation caught: Trainer.resume() ignoring its checkpoint.
    node_log = (logs / "node-0.log").read_text()
    said = [line for line in node_log.splitlines() if "dstrain: resumed from step" in line]
    assert len(said) == 1, node_log[-3000:]
    resumed_from = int(said[0].split("resumed from step ")[1].split()[0])
    assert resumed_from in (10, 20, 30) and f"(checkpoint step-{resumed_from})" in said[0], said
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == resumed_from
    assert len(first_ten) == 10 and early_lines(run) == first_ten
    assert steps == list(range(1, 41)), steps
    print(f"slurm job {job}: {elapsed:.0f} s including one requeue")


def test_preemption_notice_saves_then_the_requeued_job_resumes_without_losing_or_repeating_samples(cluster, tmp_path):
    """checkpoint_every is past the end, so the only checkpoint before step 24 is the one the notice asked for."""
    from dstrain.recipe import load_recipe
    from dstrain.train.launch import make_loader

    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "tiny-moe", 512, 192, seed=0)
    logs, out = tmp_path / "logs", tmp_path / "runs"
    steps, drafters = 24, 2
    overrides = [f"data.shards={shards}", "world.mode=disaggregated", f"world.drafter_ranks={drafters}", "drafter.ffn.type=dense",
                 f"train.steps={steps}", "train.warmup_steps=1", "train.checkpoint_every=1000", "train.log_every=1",
                 f"run.output_dir={out}"]
    env = {**cluster, "DSTRAIN_NPROC_PER_NODE": "3", "DSTRAIN_LOG_DIR": str(logs), "DSTRAIN_MASTER_PORT": str(free_port()),
           "DSTRAIN_PYTHON": str(Path(os.sys.executable))}
    started = time.time()
    job = subprocess.run(["sbatch", "--parsable", "--nodes=1", "--gpus-per-node=0", f"--output={tmp_path}/job-%j.out",
                          "slurm/train_dspark_moe.sh", "recipes/tiny_moe.yaml", *overrides],
                         cwd=ROOT, env=env, capture_output=True, text=True, check=True).stdout.strip().split(";")[0]
    run = out / "tiny-moe-dspark"
    noticed_at = None
    deadline = time.time() + 480
    while time.time() < deadline:
        state = job_state(env, job)
        logged = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] if (run / "metrics.jsonl").exists() else []
        if noticed_at is None and logged and max(logged) >= 4:
            subprocess.run(["scancel", "--signal=USR1", "--batch", job], env=env, check=True, capture_output=True)
            noticed_at = max(logged)
        elif noticed_at is not None and state.get("JobState") == "PENDING" and state.get("Reason") == "BeginTime":
            subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], env=env, capture_output=True)
        elif state.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            break
        time.sleep(0.2)
    elapsed = time.time() - started
    script_log = "\n".join(p.read_text() for p in tmp_path.glob("job-*.out"))
    node_log = (logs / "node-0.log").read_text() if (logs / "node-0.log").exists() else ""
    assert state.get("JobState") == "COMPLETED", (state, script_log[-3000:], node_log[-3000:])
    assert noticed_at is not None and int(state.get("Restarts", "0")) == 1, state
    assert "USR1: asking the training processes for a checkpoint" in script_log and "requeueing job" in script_log, script_log
    saved = [line for line in node_log.splitlines() if "dstrain: preemption notice: checkpoint step-" in line]
    assert len(saved) == 1, node_log[-3000:]
    saved_at = int(saved[0].split("checkpoint step-")[1].split()[0])
    assert noticed_at <= saved_at < steps, (noticed_at, saved_at)
    # Mutations caught: no handler (USR1 kills a rank: the first job fails), no save on the notice (no resume line
    # naming that step), a save on one drafter only (a collective save that never completes: the job times out).
    resumed = [line for line in node_log.splitlines() if "dstrain: resumed from step" in line]
    assert resumed == [resumed[0]] and f"resumed from step {saved_at} (checkpoint step-{saved_at})" in resumed[0], resumed
    assert json.loads((run / "summary.json").read_text())["resumed_from"] == saved_at
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == list(range(1, steps + 1))
    # The samples: the target's channel log has one line per step it produced; the first job's target may have run
    # ahead of the drafters by the channel's depth (those lines are redone by the requeued job). The requeued job's
    # lines must run saved_at + 1 .. steps, and every step's ids must be what the drafters' loaders draw in an
    # uninterrupted run: nothing lost, nothing repeated.
    lines = [json.loads(x) for x in (run / "channel" / f"target-rank-{drafters}.jsonl").read_text().splitlines()]
    order = [x["step"] for x in lines]
    cut = next((i for i in range(1, len(order)) if order[i] <= order[i - 1]), order.index(saved_at) + 1)
    assert order[:cut] == list(range(1, order[cut - 1] + 1)) and saved_at <= order[cut - 1] <= saved_at + 3, order
    assert order[cut:] == list(range(saved_at + 1, steps + 1)), order
    recipe = load_recipe(str(ROOT / "recipes" / "tiny_moe.yaml"), overrides)
    streams = [iter(make_loader(recipe, j, drafters)) for j in range(drafters)]
    mb = recipe.train.micro_batch_size
    expected = {s: [next(streams[j]).meta["id"] for j in range(drafters) for _ in range(mb)] for s in range(1, steps + 1)}
    for x in lines:
        assert x["samples"] == expected[x["step"]], (x["step"], x["samples"], expected[x["step"]])
    print(f"preemption: notice sent at step {noticed_at}, checkpoint step-{saved_at}, requeued job resumed at step "
          f"{saved_at + 1}; {len(lines)} target step lines ({cut - saved_at} run ahead, redone) of {drafters * mb} samples"
          f" each match an uninterrupted draw; {elapsed:.0f} s")
