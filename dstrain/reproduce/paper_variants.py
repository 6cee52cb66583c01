"""Recipe changes beside the protocol they change: records trained with `dstrain table --set KEY=VALUE ...` (their
protocol is the base protocol plus `set`) read together with the base protocol's records. Each change is compared with
the base run of the same family and seed (change − protocol: what the change moves) and, where a reference trainer's
run pairs with that base run, with the reference (change − reference: the gap left). Both as paper_reference compares:
over prompts (paired bootstrap) and, with two seeds or more, over seeds; 95 % intervals, questions of their own. The
training τ̂ of each epoch sits beside them: where along the schedule a change starts to differ.
"""

from __future__ import annotations

from dstrain.errors import UserError
from dstrain.reproduce import paper_reference, paper_stats as PS
from dstrain.reproduce.paper_record import evals_of
from dstrain.reproduce.stages import key_of


def base_key(proto: dict) -> str:
    return key_of({k: v for k, v in proto.items() if k != "set"})


def change_label(proto: dict) -> str:
    return ", ".join(proto["set"])


def split(records: list[dict]) -> tuple[list[dict], list[dict]]:
    """(the protocol's own records, the recipe changes' records); where every record carries changes, they are the
    protocol's own (a table of that protocol alone)."""
    plain = [r for r in records if not r["protocol"].get("set")]
    return (plain, [r for r in records if r["protocol"].get("set")]) if plain else (records, [])


def assemble(variants: list[dict], base: dict, runs: dict, references: dict | None, temps: list[str], sizes: dict,
             samples: int) -> dict:
    """{change label: {set, runs, versus: {temperature: {family: comparisons}}}}; `runs` are paper_table's base runs and
    `references` paper_reference's assembly, both still holding their benchmark parts."""
    want, epochs = base_key(base), sizes["epochs"]
    out: dict[str, dict] = {}
    for rec in sorted(variants, key=lambda r: (change_label(r["protocol"]), r["family"], r["seed"])):
        if base_key(rec["protocol"]) != want:
            raise UserError(f"{rec['_path']}: its protocol less its recipe changes ({change_label(rec['protocol'])}) is "
                            "not the protocol the other records share: give the changes' records with their base "
                            "protocol's (e.g. --records benchmarks/paper2-runs benchmarks/paper2-runs/changes/...)")
        ch = out.setdefault(change_label(rec["protocol"]), {"set": rec["protocol"]["set"], "runs": {}, "versus": {}})
        ch["runs"][rec["run"]] = {"family": rec["family"], "label": rec["label"], "seed": rec["seed"], "code": rec["code"],
                                  "training": {k: rec["training"].get(k) for k in ("steps", "seconds", "legs", "trained_at")},
                                  "by_t": PS.by_temperature(evals_of(rec), sizes, samples),
                                  "training_tau": PS.epoch_taus(rec, epochs)}
    refs = (references or {}).get("runs", {})
    for ch in out.values():
        for temp in temps:
            per = ch["versus"].setdefault(temp, {})
            for fam in sorted({r["family"] for r in ch["runs"].values()}):
                mine = [(name, r) for name, r in ch["runs"].items() if r["family"] == fam and temp in r["by_t"]]
                have = [(name, r) for name, r in mine if temp in runs.get(name, {}).get("by_t", {})]
                v = {"label": mine[0][1]["label"] if mine else fam, "seeds": [r["seed"] for _, r in have],
                     "missing": [name for name, r in mine if (name, r) not in have]}
                if have:
                    v["protocol"] = {**paper_reference.compare([(r["by_t"][temp], runs[name]["by_t"][temp])
                                                                for name, r in have], samples, ("the change", "the protocol")),
                                     "seeds": v["seeds"]}
                    v["training_tau"] = {"change": PS.mean_columns([r["training_tau"] for _, r in have]),
                                         "protocol": PS.mean_columns([PS.epoch_taus(runs[name], epochs) for name, _ in have])}
                paired = [(r, ref) for name, r in have for ref in refs.values()
                          if ref["pairs_with"] == name and temp in ref["by_t"]]
                if paired and len(paired) == len(have):
                    v["reference_label"] = paired[0][1]["label"]
                    v["reference"] = {**paper_reference.compare([(r["by_t"][temp], ref["by_t"][temp]) for r, ref in paired],
                                                                samples, ("the change", "the reference")),
                                      "seeds": v["seeds"]}
                    v["training_tau"]["reference"] = PS.mean_columns([ref["training_tau"] for _, ref in paired])
                per[fam] = v
    return out
