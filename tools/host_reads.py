"""The meta-device CUDA check's report: every drafter configuration's step, Trainer.train_step, the trainer's whole
step (colocated source with no cache, the in-memory cache and the on-disk store, then train_step), the channel's row
handling and the megatron target's forward (GPT family, DeepSeek-V3, V4; in a child process) run on `meta` with the
CUDA branches taken (dstrain/testing/host_reads.py); one line each with its host reads, and every read's kind and
dstrain file:line; megatron's own reads listed apart. Exits 1 when any dstrain code reads from the host.

    python tools/host_reads.py                 # the table
    python tools/host_reads.py --json out.json # and the reads as JSON
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _megatron():
    """The megatron check in a child process (it starts a one-rank process group)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "dstrain.testing.meta_targets", "--json", f"{tmp}/out.json"],
                              capture_output=True, text=True, timeout=600,
                              cwd=os.path.join(os.path.dirname(__file__), ".."))
        if not os.path.exists(f"{tmp}/out.json"):
            tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            return [{"kind": "error", "what": tail[0][:300], "site": "dstrain.testing.meta_targets", "count": 1}], []
        results = json.load(open(f"{tmp}/out.json"))
    reads = [{**r, "what": f"{x['family']}: {r['what']}"} for x in results for r in x["reads"]]
    known = [{**r, "what": f"{x['family']}: {r['what']}"} for x in results for r in x["megatron_reads"]]
    return reads, known


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="also write every configuration's reads here (default: none)")
    args = ap.parse_args(argv)
    from dstrain.testing import meta_steps as M, meta_trainer as T

    def whole(cfg, cache):
        reads = T.whole_step(cfg, cache)
        return reads.report(), reads.known_report()

    checks = [(f"drafter step  {c.name}", lambda c=c: M.drafter_step(c)) for c in M.drafter_configs()]
    checks += [(f"trainer step  {c.name}", lambda c=c: M.trainer_step(c)) for c in M.trainer_configs()]
    checks += [(f"whole step    {c.name} cache={cache}", lambda c=c, cache=cache: whole(c, cache))
               for c, cache in T.whole_step_configs()]
    checks.append(("channel rows  target side and drafter side", M.channel_rows))
    checks.append(("megatron target forward  qwen3_moe, deepseek_v3, deepseek_v4 at tp = 1, bf16", _megatron))
    out, width = {}, max(len(name) for name, _ in checks)
    for name, run in checks:
        t0 = time.perf_counter()
        result = run()
        reads, known = result if isinstance(result, tuple) else (result.report(), [])
        out[name] = reads
        total = sum(r["count"] for r in reads)
        print(f"{name:<{width}}  {total:>3} host reads  ({time.perf_counter() - t0:.1f} s)")
        for r in reads:
            print(f"    {r['count']} x {r['kind']:<8} {r['what']} at {r['site']}")
        for r in known:
            print(f"    the library's own: {r['count']} x {r['kind']} {r['what']} at {r['site']}")
    bad = sum(1 for v in out.values() if v)
    print(f"{len(checks)} configurations on meta with the CUDA branches taken: "
          + ("no host reads" if not bad else f"{bad} read from the host"))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
