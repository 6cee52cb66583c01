"""A paper-preset run's result record: what `dstrain table --preset paper` assembles the table from.

One JSON file per (family, seed), small enough to commit (per-prompt acceptance totals, not rollouts): the protocol
it was measured under (and its key), the code version, the learning curve, and the best checkpoint's per-prompt
totals on the full held-out set and on the benchmarks. Records made on different machines and days assemble into one
table as long as their protocol keys are equal.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from pathlib import Path

import torch

from dstrain.errors import UserError
from dstrain.reproduce import stages as S
from dstrain.reproduce.paper import run_name
from dstrain.reproduce.provenance import code_version, machine
from dstrain.reproduce.report import BENCH

SCHEMA = {"paper": 1, "paper2": 2, "paper3": 2}  # 2: evaluations keyed by temperature, per-prompt position counts, the schedule
READABLE = (1, 2)
PROTOCOL_SEED = 0  # benchmark prompts and decoding draws: the same for every run, so runs compare paired
# a run of another implementation on a dstrain run's samples, order, features, steps and evaluator (its schema names the
# tool, e.g. tools/deepspec_reference.py's "deepspec-reference/1"); `pairs_with` names that dstrain run
REFERENCE_SUFFIX = "-reference/1"


def is_reference(rec: dict) -> bool:
    return isinstance(rec.get("schema"), str) and rec["schema"].endswith(REFERENCE_SUFFIX) and "pairs_with" in rec


def recipe_key(text: str) -> str:
    """The recipe's content, parsed: a comment or layout edit leaves the protocol (and every committed record) as is."""
    import yaml

    return S.key_of(yaml.safe_load(text))


def protocol(sizes, recipe_path: str, corpus_folder: Path, target: str, depth: dict, sets: tuple[str, ...] = ()) -> dict:
    """Everything that decides what a record's numbers mean; the seeds are not part of it (a record is one seed).
    --set's recipe changes enter only when given: the protocol without them keeps its key."""
    from dstrain.data import corpus

    man = corpus.manifest(corpus_folder)
    sz = {k: v for k, v in dataclasses.asdict(sizes).items() if k != "seeds"}
    if sizes.preset == "paper":  # protocol 1's key predates these fields: its records keep mixing with new ones
        sz = {k: v for k, v in sz.items() if k not in ("preset", "temperatures", "positions")}
    return {"preset": sizes.preset, "sizes": sz, "depth": dict(depth), "target": target, "protocol_seed": PROTOCOL_SEED,
            "recipe_sha256": recipe_key(Path(recipe_path).read_text()), "corpus_sha256": man["sha256"],
            "held_out_rule": man["held_out"]["rule"], **({"set": list(sets)} if sets else {})}


def decode_totals(ev: S.Evaluator, cand, records: list[dict], batch: int, max_new: int, temperature: float = 1.0,
                  positions: bool = False) -> dict:
    """Per-prompt accepted tokens and rounds per domain; with `positions`, per prompt and draft position k the rounds
    that verified k (1..k−1 accepted) and those that accepted it."""
    from dstrain.eval.bootstrap import prompt_totals

    by_domain = ev.prompts(records)
    res, rollouts = ev.run(cand, by_domain, batch, max_new, PROTOCOL_SEED, temperature)
    totals = {}
    for domain, logs in rollouts.items():
        n = len(by_domain[domain])
        tokens, rounds = prompt_totals(logs, n)
        totals[domain] = {"tokens": tokens.tolist(), "rounds": rounds.tolist()}
        if positions:
            per_k = [S.position_totals(logs, n, k) for k in range(1, cand.gamma + 1)]
            totals[domain]["positions"] = {"reached": torch.stack([r for r, _ in per_k], 1).tolist(),
                                           "accepted": torch.stack([a for _, a in per_k], 1).tolist()}
    return {"prompt_ids": [r["id"] for r in records], "totals": totals, "trained_steps": res["trained_steps"],
            "conditional_acceptance": {d: res["domains"][d]["conditional_acceptance"] for d in totals}}


def evaluated_tag(sizes, run_dir: Path) -> str:
    """Protocol 1: the plateau's best checkpoint. Protocol 2: the last one, where the schedule ends (nothing selected)."""
    from dstrain.reproduce.paper import fixed_schedule

    return S.checkpoint_tags(run_dir)[-1] if fixed_schedule(sizes) else "best"


def evaluate_best(cfg: S.Config, ev: S.Evaluator, sizes, name: str, target: str, train_key: str, clock: S.Clock) -> dict:
    """The evaluated checkpoint on the full held-out set and on the benchmarks, at each of the protocol's
    temperatures: {temperature label: {stage: totals}}; each stage stored and reused by key."""
    from dstrain.eval.prompts import sampled_benchmark_prompts
    from dstrain.reproduce.paper import temperature_label
    from dstrain.train.live_eval import held_out_records

    run_dir = cfg.out / "runs" / name
    stages = {
        "held_out": lambda: [r for recs in held_out_records(cfg.corpus, target, sizes.held_out_per_domain).values() for r in recs],
        "benchmarks": lambda: sampled_benchmark_prompts(list(BENCH), sizes.bench_prompts, PROTOCOL_SEED)}
    shape = {"held_out": (sizes.held_out_per_domain, sizes.eval_new_tokens),
             "benchmarks": (sizes.bench_prompts, sizes.bench_new_tokens)}
    tag = evaluated_tag(sizes, run_dir)
    several = len(sizes.temperatures) > 1
    out: dict[str, dict] = {}
    cand = None
    for temp in sizes.temperatures:
        label = temperature_label(temp)
        for stage, records in stages.items():
            batch, max_new = shape[stage]
            what = {"train": train_key, "stage": stage, "batch": batch, "new": max_new, "protocol": PROTOCOL_SEED,
                    "tag": "best"}
            if sizes.preset != "paper":  # protocol 1's stored evaluations keep their keys
                what.update(tag=tag, temperature=temp, positions=sizes.positions)
            key = S.key_of(what)
            path = cfg.out / "eval" / (f"{name}.{stage}.json" if not several else f"{name}.{stage}.T{label}.json")
            stage_name = f"{stage.replace('_', '-')} {name}" + (f" T={label}" if several else "")
            done = S.reuse(path, key, cfg.resume)
            if done:
                clock.finish(stage_name, 0.0, reused=True)
                out.setdefault(label, {})[stage] = done
                continue
            t0 = time.perf_counter()
            cand = cand or ev.candidate(run_dir, name, tag)
            result = decode_totals(ev, cand, records(), batch, max_new, temp, sizes.positions)
            seconds = time.perf_counter() - t0
            out.setdefault(label, {})[stage] = S.store(path, key, {**result, "seconds": seconds, "temperature": temp})
            clock.finish(stage_name, seconds)
    return out


def write(cfg: S.Config, sizes, proto: dict, rec: dict, evals: dict, data: dict, overrides: list[str]) -> dict:
    """OUT/records/NAME.json, written whole (temporary file, then rename)."""
    from dstrain.config.schema import load_recipe
    from dstrain.reproduce.paper import fixed_schedule

    strip = lambda ev: {k: v for k, v in ev.items() if k != "key"}  # noqa: E731
    # "legs": the runs this training took (a resumed run's seconds cover every leg); a record without it timed its last
    # "trained_at": each commit a leg trained at, in order (the record's "code" is the evaluating checkout's)
    training = {"steps": rec["steps"], "epoch_steps": rec["epoch_steps"], "seconds": rec["seconds"], "legs": rec.get("legs"),
                "trained_at": rec.get("trained_at"),
                "best": (rec.get("eval") or {}).get("best"), "stopped_early": (rec.get("eval") or {}).get("stopped_early"),
                "feature_cache": rec.get("feature_cache")}
    record = {
        "schema": SCHEMA[sizes.preset], "run": run_name(rec["family"], rec["seed"]), "family": rec["family"],
        "label": rec["label"], "seed": rec["seed"], "protocol_key": S.key_of(proto), "protocol": proto,
        "table_seeds": list(sizes.seeds), "code": code_version(), "machine": machine(),
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "data": {k: data[k] for k in ("train_conversations", "samples", "held_out_prompts") if k in data},
        "overrides": [o for o in overrides if not o.startswith(("data.shards=", "run.output_dir=", "eval.corpus=",
                                                                "train.feature_cache_dir="))],
        "training": training, "curve": rec["curve"]}
    if record["schema"] == 1:
        (only,) = evals.values()
        record.update(held_out=strip(only["held_out"]), benchmarks=strip(only["benchmarks"]))
    else:
        # the schedule the run trained with: its base recipe under every override (a preset's own settings included)
        train = load_recipe(cfg.recipe, overrides).train
        training.update(fixed_schedule=fixed_schedule(sizes), evaluated_step=train.steps,
                        lr={"peak": train.lr, "min": train.min_lr, "warmup": train.warmup_steps, "steps": train.steps})
        record["evals"] = {t: {stage: strip(part) for stage, part in parts.items()} for t, parts in evals.items()}
    path = cfg.out / "records" / f"{record['run']}.json"
    S.store(path, record["protocol_key"], record)
    return json.loads(path.read_text())


# --------------------------------------------------------------------------------------------- reading records
def load(folders: list[Path]) -> list[dict]:
    """Every record (*.json with the record's schema) in the folders; one clear line for what cannot be read."""
    records, seen = [], {}
    for folder in folders:
        if not folder.is_dir():
            raise UserError(f"--records {folder}: no such folder; give the folder the run records were copied to "
                            "(e.g. benchmarks/paper-runs)")
        for path in sorted(folder.glob("*.json")):
            try:
                rec = json.loads(path.read_text())
            except (OSError, ValueError) as e:
                raise UserError(f"{path}: not a readable run record ({e}); remove it or copy it again") from None
            if not isinstance(rec, dict) or "protocol_key" not in rec or not (rec.get("schema") in READABLE
                                                                            or is_reference(rec)):
                continue  # another file kept beside the records (a README's JSON, a results file)
            ident = (rec["family"], rec["seed"], rec["protocol_key"])  # a recipe change's run has its base run's name
            if ident in seen:
                raise UserError(f"{path} and {seen[ident]} are both {rec['run']}: keep one of them")
            seen[ident] = path
            rec["_path"] = str(path)
            records.append(rec)
    if not records:
        raise UserError(f"--records {', '.join(map(str, folders))}: no run records there; make one with "
                        "`dstrain table --preset paper --run dspark-markov:0` (it writes OUT/records/NAME.json)")
    return records


# Protocols 2 and 3 differ only in how dstrain trains (protocol 3: the reference implementation's settings): a reference
# trainer's run, which trains with its own, means the same under both
SAME_FOR_REFERENCES = {"paper2": "paper2", "paper3": "paper2"}


def reference_view(proto: dict) -> str:
    """The key of what a reference trainer's record depends on: the protocol less dstrain's own training settings."""
    preset = SAME_FOR_REFERENCES.get(proto["preset"], proto["preset"])
    return S.key_of({**proto, "preset": preset, "sizes": {**proto["sizes"], "preset": preset}})


def check_one_protocol(records: list[dict]) -> dict:
    """The protocol every record shares, or one line naming the records and the settings that differ. A reference
    record matches a protocol by reference_view (protocol 3's runs pair with a reference run of protocol 2)."""
    first = next((r for r in records if not is_reference(r)), records[0])
    for rec in records:
        same = (rec["protocol_key"] is not None and reference_view(rec["protocol"]) == reference_view(first["protocol"])
                if is_reference(rec) else rec["protocol_key"] == first["protocol_key"])  # no key: a smoke run
        if not same:
            a, b = _flat(first["protocol"]), _flat(rec["protocol"])
            diff = [f"{k}: {a.get(k)} vs {b.get(k)}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
            raise UserError(f"{rec['_path']} was measured under another protocol than {first['_path']} "
                            f"({'; '.join(diff[:4]) or 'keys differ'}): assemble records of one protocol "
                            "(move the others to another folder)")
    return first["protocol"]


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def totals(part: dict, domain: str) -> tuple[torch.Tensor, torch.Tensor]:
    t = part["totals"][domain]
    return torch.tensor(t["tokens"], dtype=torch.float64), torch.tensor(t["rounds"], dtype=torch.float64)


def evals_of(rec: dict) -> dict:
    """{temperature: {"held_out": part, "benchmarks": part}}: schema 1 evaluated at T = 1 only."""
    if rec["schema"] == 1:
        return {"1": {"held_out": rec["held_out"], "benchmarks": rec["benchmarks"]}}
    return rec["evals"]


def schedule_of(rec: dict):
    """step → learning rate the run trained at, or None where the record cannot say: schema 2 keeps its schedule; a
    schema 1 record's is the shipped recipe's when that recipe still has the record's content key."""
    from types import SimpleNamespace

    from dstrain.config.files import resolve_recipe_path
    from dstrain.train.schedule import lr_lambda

    lr = rec["training"].get("lr")
    if lr is None:
        import yaml

        ov = dict(o.split("=", 1) for o in rec["overrides"])
        try:
            text = resolve_recipe_path("smollm2_moe", "recipe").read_text()
        except UserError:  # no longer shipped: the lr column stays empty
            return None
        if recipe_key(text) != rec["protocol"]["recipe_sha256"] or "train.steps" not in ov:
            return None
        train = yaml.safe_load(text)["train"]
        lr = {"peak": float(train["lr"]), "min": float(train["min_lr"]), "warmup": int(ov["train.warmup_steps"]),
              "steps": int(ov["train.steps"])}
    f = lr_lambda(SimpleNamespace(lr=lr["peak"], min_lr=lr["min"], warmup_steps=lr["warmup"], steps=lr["steps"]))
    return lambda step: lr["peak"] * f(step)
