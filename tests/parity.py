"""The parity workers' reports (tests/integration/workers/*_parity.py): one launch and one per-rank check, shared by
the megatron, DeepSeek-V3 and DeepSeek-V4 parity tests."""

import json
import os
import subprocess
import sys

from conftest import ROOT, free_port


def parity_report(worker: str, *args, timeout: int) -> dict:
    """Run a parity worker on 4 gloo ranks; its one JSON line after "PARITY "."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), f"tests/integration/workers/{worker}", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.split("PARITY ", 1)[1].splitlines()[0])


def check_ranks(what: str, r: dict, ranks: list[str], tol: float, rank_scale: float = 0.0) -> None:
    """One comparison: activations O(1) (so the tolerance is not vacuous), and on every rank of the layout some values
    compared (a MAX over ranks would let a stage that captured nothing pass as perfect), each within `tol`."""
    print(f"{what}: max |Δ| {r['max_abs_diff']:.2e} (scale {r['scale']:.1f})")
    assert r["scale"] > 1.0, (what, r)
    assert sorted(r["ranks"]) == ranks, (what, r)
    for rank, v in r["ranks"].items():
        print(f"  rank {rank}: max |Δ| {v['max_abs_diff']:.2e} over {v['compared']} values (scale {v['scale']:.2f})")
        assert v["compared"] > 0 and v["scale"] > rank_scale and v["max_abs_diff"] < tol, (what, rank, v)
