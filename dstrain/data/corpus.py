"""A shipped training corpus: a target's regenerated conversations, compressed, with a manifest.

Layout of a corpus folder (corpus/smollm2_moe):
  prompts.jsonl            the prompts (`dstrain data prompts`), the input of regeneration
  conversations.jsonl.xz   the target's answers, one record per prompt (dstrain/data/regen.py)
  manifest.json            counts, sampling parameters, target and tokenizer fingerprints, sha256s,
                           and the held-out split (data/split.py)
While regeneration runs, conversations.jsonl (uncompressed, appended to) sits beside them;
`pack` checks every record and writes the .xz and the manifest atomically, `unpack` restores it.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
from collections import Counter
from pathlib import Path

from dstrain.errors import UserError

SHIPPED = Path(__file__).resolve().parents[1] / "corpus"  # inside the package: found from any folder
DEFAULT = SHIPPED / "smollm2_moe"


def shipped() -> dict[str, Path]:
    return {p.name: p for p in sorted(SHIPPED.iterdir()) if (p / "manifest.json").is_file()}


def resolve(arg: str | Path, what: str = "--corpus") -> Path:
    """A corpus folder as given, or the name of a shipped one (smollm2_moe), so commands work from any folder."""
    path = Path(arg)
    if path.is_dir():
        return path.resolve()
    ships = shipped()
    name = path.name if str(arg).startswith("corpus/") else str(arg)  # or the repository-relative corpus/NAME
    if name in ships:
        return ships[name]
    raise UserError(f"{what} {arg}: no such folder and no shipped corpus of that name (shipped: {', '.join(ships)}); "
                    "give a folder made by dstrain data pack, or a shipped name")


def split_of(prompts_path: Path) -> dict:
    """The manifest's split section for a prompts file: held-out ids, dropped duplicates, the rule (data/split.py)."""
    from dstrain.data import split

    records = [json.loads(line) for line in Path(prompts_path).read_text().splitlines() if line.strip()]
    res = split.split(records)
    return {"rule": split.RULE, "ids": res["held_out"], "dropped_duplicates": res["dropped"],
            "clusters": res["clusters"], "largest_cluster": res["largest_cluster"], "train_prompts": len(res["train"])}


def _side(man: dict, prompt_id: str) -> str:
    """'held_out', 'train' or 'dropped' (an exact duplicate of a kept prompt) for a prompt id of this corpus."""
    held = man["held_out"]
    if prompt_id in held.get("dropped_duplicates", {}):
        return "dropped"
    return "held_out" if prompt_id in set(held["ids"]) else "train"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def manifest(folder: Path = DEFAULT) -> dict:
    path = Path(folder) / "manifest.json"
    if not path.is_file():
        raise UserError(f"{folder}: no manifest.json — not a packed corpus (run dstrain data pack {folder})")
    return json.loads(path.read_text())


def pack(folder: Path, target_folder: str, make_prompts: dict | None = None) -> dict:
    """Check conversations.jsonl against the target that made it, compress it and write the manifest."""
    from transformers import AutoTokenizer

    from dstrain.data.tokenize import tokenizer_fingerprint
    from dstrain.targets.fingerprint import weights_fingerprint

    folder = Path(folder)
    raw_path, prompts_path = folder / "conversations.jsonl", folder / "prompts.jsonl"
    if not raw_path.is_file() or not prompts_path.is_file():
        raise UserError(f"{folder}: needs prompts.jsonl and conversations.jsonl (dstrain data regenerate writes the latter)")
    raw = raw_path.read_bytes()
    keep = raw.rfind(b"\n") + 1  # a torn last line (regeneration still running) is not packed
    raw = raw[:keep]
    prompts = {json.loads(line)["id"]: json.loads(line) for line in prompts_path.read_text().splitlines() if line.strip()}
    records = [json.loads(line) for line in raw.splitlines()]
    targets = Counter(r["target"] for r in records)
    samplings = Counter(json.dumps(r["sampling"], sort_keys=True) for r in records)
    if len(targets) != 1 or len(samplings) != 1:
        raise UserError(f"{raw_path}: records from several targets {dict(targets)} or samplings {dict(samplings)}; "
                        "a corpus is one target at one sampling setting")
    ids = [r["id"] for r in records]
    if len(set(ids)) != len(ids) or not set(ids) <= set(prompts):
        raise UserError(f"{raw_path}: duplicate ids or ids not in prompts.jsonl")
    tok = AutoTokenizer.from_pretrained(target_folder)
    data = lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME)
    man = {
        "records": len(records), "prompts": len(prompts), "complete": len(records) == len(prompts),
        "domains": dict(Counter(r["domain"] for r in records)),
        "turns": sum(len(r["finish_reasons"]) for r in records),
        "new_tokens": sum(r["new_tokens"] for r in records),
        "finish_reasons": dict(Counter(f for r in records for f in r["finish_reasons"])),
        "bytes": {"compressed": len(data), "raw": len(raw), "prompts": prompts_path.stat().st_size},
        "sha256": {"conversations.jsonl": _sha256(raw), "conversations.jsonl.xz": _sha256(data),
                   "prompts.jsonl": _sha256(prompts_path.read_bytes())},
        "target": {"name": next(iter(targets)), "weights_fingerprint": weights_fingerprint(target_folder),
                   "tokenizer_fingerprint": tokenizer_fingerprint(tok)},
        "sampling": json.loads(next(iter(samplings))),
        "generators": dict(Counter(r["generator"] for r in records)),
        "make_prompts": make_prompts,
        "held_out": split_of(prompts_path),
    }
    _write_atomic(folder / "conversations.jsonl.xz", data)
    _write_atomic(folder / "manifest.json", (json.dumps(man, indent=1) + "\n").encode())
    return man


def _records(folder: Path) -> bytes:
    man = manifest(folder)
    path = Path(folder) / "conversations.jsonl.xz"
    try:
        raw = lzma.decompress(path.read_bytes())
    except (OSError, lzma.LZMAError) as exc:
        raise UserError(f"{path}: unreadable ({exc}); restore it with `git checkout -- {path}`") from None
    if _sha256(raw) != man["sha256"]["conversations.jsonl"]:
        raise UserError(f"{path}: content does not match manifest.json; repack with dstrain data pack")
    return raw


def _check_prompts(folder: Path, man: dict) -> None:
    """prompts.jsonl as packed: an edited prompt would be evaluated under the split's name unnoticed. Under 1 MB, so
    hashed every time rather than leaving a cache file in a folder that git tracks."""
    from dstrain.verify import verify_files

    entry = {"file": "prompts.jsonl", "bytes": man["bytes"]["prompts"], "sha256": man["sha256"]["prompts.jsonl"]}
    verify_files(folder, [entry], what="corpus file", listed_in=str(folder / "manifest.json"), cache=None,
                 fix=f"restore it (git checkout -- {folder}/prompts.jsonl) or repack with dstrain data pack {folder}")


def resplit(folder: Path) -> dict:
    """Recompute the split of a packed corpus from its prompts (no target needed: the records are unchanged) and
    rewrite the manifest atomically."""
    man = manifest(folder)
    prompts_path = Path(folder) / "prompts.jsonl"
    if _sha256(prompts_path.read_bytes()) != man["sha256"]["prompts.jsonl"]:
        raise UserError(f"{prompts_path}: does not match manifest.json; repack with dstrain data pack")
    man["held_out"] = split_of(prompts_path)
    _write_atomic(Path(folder) / "manifest.json", (json.dumps(man, indent=1) + "\n").encode())
    return man


def unpack(folder: Path, out: Path, split: str = "all") -> int:
    """Write the corpus records of one split ('train', 'held_out' or 'all') as JSONL. Returns the count. 'train'
    leaves out the exact duplicates the split dropped; 'all' is every record as packed."""
    if split not in ("train", "held_out", "all"):
        raise ValueError(split)
    man = manifest(folder)
    lines = [line for line in _records(folder).splitlines()
             if split == "all" or _side(man, json.loads(line)["id"]) == split]
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out, b"".join(line + b"\n" for line in lines))
    return len(lines)


def held_out_prompts(folder: Path, out: Path) -> int:
    """The held-out prompts (any not yet answered included) as a prompts JSONL, for dstrain eval."""
    man = manifest(folder)
    _check_prompts(Path(folder), man)
    keep = set(man["held_out"]["ids"])
    lines = [line for line in (Path(folder) / "prompts.jsonl").read_text().splitlines()
             if line.strip() and json.loads(line)["id"] in keep]
    out.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(out, "".join(line + "\n" for line in lines).encode())
    return len(lines)


def check_target(folder: Path, target_folder: str, target_name: str) -> dict:
    """The corpus was made by this target (weights and tokenizer), or one line saying which differs."""
    from transformers import AutoTokenizer

    from dstrain.data.tokenize import tokenizer_fingerprint
    from dstrain.targets.fingerprint import weights_fingerprint

    man = manifest(folder)
    want = man["target"]
    have = {"name": target_name, "weights_fingerprint": weights_fingerprint(target_folder),
            "tokenizer_fingerprint": tokenizer_fingerprint(AutoTokenizer.from_pretrained(target_folder))}
    for key, value in have.items():
        if want[key] != value:
            raise UserError(f"{folder}: made by a target with {key} {want[key]}, this target ({target_folder}) has {value}; "
                            "regenerate the corpus with this target (dstrain data regenerate) or use the recipe it was made for")
    return man
