"""make reference-check: NeMo AutoModel 0.7.0 against dstrain, live (tools/reference_check.py --check says what runs).

Runs in dstrain's venv; AutoModel runs in .venv-automodel through automodel_side.py. Writes record.json and record.md
to the output folder; returns 0 only when every difference is within the tolerance and AutoModel read every key.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
SIDE = HERE / "automodel_side.py"
CAPTURE = [5, 6, 7]  # the tiny release's dspark_target_layer_ids
ANCHORS = torch.tensor([[3, 17], [9, 25]])  # per row: blocks that see a full window, one near the end of the 33 tokens


def say(msg: str) -> None:
    print(f"[reference-check] {msg}", flush=True)


def env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}


def inputs(folder: Path) -> None:
    """Two batches of 2 x 33 tokens (odd: sequence parallelism pads, ratio-2 groups end mid-sequence)."""
    for dp in (0, 1):
        ids = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1 + dp))
        torch.save({"input_ids": ids, "capture_layers": CAPTURE, "dspark": {"anchors": ANCHORS}}, folder / f"in{dp}.pt")


def automodel(venv: Path, release: Path, refs: Path, quant: str, extra: list[str] = ()) -> dict:
    meta = {}
    for dp in (0, 1):
        cmd = [str(venv / "bin" / "python"), str(SIDE), "--checkpoint", str(release), "--inputs", str(refs / f"in{dp}.pt"),
               "--out", str(refs / f"batch{dp}.pt"), "--cache-quant", quant, *extra]
        subprocess.run(cmd, check=True, env=env(), capture_output=True, text=True)
        m = torch.load(refs / f"batch{dp}.pt", weights_only=False)["meta"]
        meta = {"consumed": len(m["consumed_keys"]), "ignored": m["ignored_keys"], "missing": m["missing_keys"],
                "native_missing": m["load"]["missing_native"], "native_unexpected": m["load"]["unexpected_native"]}
    return meta


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parity(release: Path, refs: Path, extra: list[str] = ()) -> dict:
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", "--master-port",
                           str(free_port()), str(ROOT / "tests" / "integration" / "workers" / "v41_parity.py"), str(release),
                           "--refs", str(refs), *extra], env=env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"reference-check: the parity launch failed:\n{proc.stderr[-3000:]}")
    report = json.loads(proc.stdout.split("PARITY ", 1)[1].splitlines()[0])
    report.pop("patches", None)
    return report


def size(value: float) -> float:
    """A difference as the check weighs it: NaN or inf is infinitely large (max() would drop a NaN after a finite
    value, and NaN > tolerance is False: a NaN passed)."""
    return float(value) if math.isfinite(value) else math.inf


def worst(tree) -> float:
    """The largest max_abs_diff / abs_diff anywhere in a report (inf when any is NaN or inf)."""
    if isinstance(tree, dict):
        own = [size(v) for k, v in tree.items() if k in ("max_abs_diff", "abs_diff") and isinstance(v, (int, float))]
        return max(own + [worst(v) for k, v in tree.items() if isinstance(v, dict)], default=0.0)
    return 0.0


def check(out: Path, tol: float, venv: Path) -> int:
    from dstrain.testing.tiny_v41 import write_release
    from v41_drafter import compare

    out.mkdir(parents=True, exist_ok=True)
    record, t0 = {"tolerance": tol, "v41": {}}, time.perf_counter()
    for case, quantised in (("fp32", False), ("release_quantised", True)):
        folder = write_release(out / case / "release", quantised=quantised)
        refs = out / case / "automodel"
        refs.mkdir(parents=True, exist_ok=True)
        inputs(refs)
        say(f"V4.1 {case}: AutoModel on 2 batches")
        row = {"automodel_keys": automodel(venv, folder, refs, "on")}
        say(f"V4.1 {case}: dstrain's target, one process and TP2 / PP2 / EP2 / TP2xEP2xPP2, against it")
        row["target"] = parity(folder, refs)
        say(f"V4.1 {case}: dstrain's drafter (the release's mtp.*) on AutoModel's features and anchors")
        row["drafter"] = compare(folder, refs / "in0.pt", refs / "batch0.pt")
        if not quantised:
            plain = out / case / "automodel_cache_off"
            plain.mkdir(exist_ok=True)
            inputs(plain)
            automodel(venv, folder, plain, "off")
            say(f"V4.1 {case}: both with the cache formats off")
            row["target_cache_off"] = parity(folder, plain, ["--cache-quant-off"])
            on, off = (torch.load(d / "batch0.pt", weights_only=False)["final_hidden"] for d in (refs, plain))
            ties = out / case / "automodel_torch_ties"
            ties.mkdir(exist_ok=True)
            inputs(ties)
            automodel(venv, folder, ties, "on", ["--torch-ties"])
            tied = torch.load(ties / "batch0.pt", weights_only=False)["final_hidden"]
            row["sensitivity"] = {"cache_formats_move_final_states_by": (on - off).abs().max().item(),
                                  "torch_tie_order_moves_final_states_by": (on - tied).abs().max().item()}
        record["v41"][case] = row
    say("V4: transformers, dstrain's megatron V4 and AutoModel on the same tiny weights")
    proc = subprocess.run([sys.executable, str(HERE / "v4_compare.py"), "--random-norms"], env=env(), capture_output=True,
                          text=True, timeout=900, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"reference-check: v4_compare failed:\n{proc.stderr[-3000:]}")
    record["v4"] = json.loads(proc.stdout.split("V4REF ", 1)[1].splitlines()[0])
    record["seconds"] = round(time.perf_counter() - t0, 1)
    bad = [f"{case}: AutoModel {k} {v}" for case, row in record["v41"].items()
           for k, v in row["automodel_keys"].items() if k != "consumed" and v]
    v4 = record["v4"]
    v4_largest = max(size(v) for p in ("transformers_vs_automodel", "ours_vs_automodel", "ours_vs_transformers")
                     for v in v4[p].values())
    bad += [f"V4: AutoModel {k} {v4['automodel'][k]}" for k in ("ignored_keys", "missing_keys") if v4["automodel"][k]]
    largest = max(worst(record["v41"]), v4_largest)
    if largest > tol:
        bad.append(f"largest difference {largest:.2e} > {tol:.0e}")
    record["verdict"] = "pass" if not bad else "; ".join(bad)
    (out / "record.json").write_text(json.dumps(record, indent=1))
    (out / "record.md").write_text(markdown(record))
    say(f"{record['verdict']}: largest |Δ| {largest:.2e} (tolerance {tol:.0e}) in {record['seconds']:.0f}s; {out}/record.md")
    return 0 if not bad else 1


def markdown(record: dict) -> str:
    lines = ["# NeMo AutoModel 0.7.0 against dstrain (make reference-check)", "",
             f"Verdict: **{record['verdict']}** (tolerance {record['tolerance']:.0e}, fp32).", "",
             "| V4.1 case | compared | max abs diff | scale |", "|---|---|---|---|"]
    for case, row in record["v41"].items():
        for name, part in (("target", row["target"]), ("target, cache formats off", row.get("target_cache_off", {}))):
            for layout, r in part.items():
                if layout == "single_vs_automodel":
                    for b, kv in r.items():
                        for k, v in kv.items():
                            lines.append(f"| {case} | {name}, one process vs AutoModel, {b} {k} | {v['max_abs_diff']:.2e} | {v['scale']:.2f} |")
                    continue
                for kind, v in r.items():
                    lines.append(f"| {case} | {name}, {layout} {kind} | {v['max_abs_diff']:.2e} | {v['scale']:.2f} |")
        d = row["drafter"]
        for k in ("draft_logits", "normalized_hidden", "confidence"):
            lines.append(f"| {case} | drafter {k} | {d[k]['max_abs_diff']:.2e} | {d[k]['scale']:.2f} |")
        for k, v in d["loss"].items():
            lines.append(f"| {case} | drafter {k} (AutoModel's definition) | {v['abs_diff']:.2e} | {v['automodel']:.4f} |")
        lines.append(f"| {case} | AutoModel keys consumed / ignored / missing | {row['automodel_keys']['consumed']} / "
                     f"{len(row['automodel_keys']['ignored'])} / {len(row['automodel_keys']['missing'])} | |")
        if "sensitivity" in row:
            for k, v in row["sensitivity"].items():
                lines.append(f"| {case} | sensitivity: {k.replace('_', ' ')} | {v:.2e} | |")
    v4 = record["v4"]
    lines += ["", "| V4 pair (same tiny weights, fp32, random norms) | " + " | ".join(v4["scale"]) + " |",
              "|---|" + "---|" * len(v4["scale"])]
    for pair in ("transformers_vs_automodel", "ours_vs_automodel", "ours_vs_transformers"):
        lines.append(f"| {pair.replace('_', ' ')} | " + " | ".join(f"{v4[pair][k]:.1e}" for k in v4["scale"]) + " |")
    lines.append("| scale | " + " | ".join(f"{v:.2f}" for v in v4["scale"].values()) + " |")
    lines.append("")
    return "\n".join(lines)
