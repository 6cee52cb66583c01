"""Which serving engine loads which export, from which release, and what each cannot load.

`dstrain export --format F` writes a file layout; `--engine E` (default: the engine that format is written for) is the
program that will load it. A format can express drafters an engine then misreads or refuses, so the export checks the
engine too, before the target is loaded, and refuses in one line naming the setting and the fix.

Release floors are where the loading code landed, by pull request (the merge dates put them in the release named):
- vLLM reads speculators-format DSpark/DFlash from vllm-project/vllm#46995/#47093 (2026-06-29/30) and honours the
  config's `sample_from_anchor` only from #48639 (2026-07-16, after v0.25.0 of 2026-07-14): earlier releases read an
  anchor-predicting block (dstrain's default) as anchor + masks, a block shifted by one slot.
- SGLang reads DeepSpec-layout DSpark/DFlash folders (`dflash_config`) and speculators DSpark with the Qwen3 dense
  backbone only (`python/sglang/srt/configs/dspark.py`); its anchor-slot handling is sgl-project/sglang#30261.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dstrain.errors import UserError


@dataclass(frozen=True)
class Engine:
    name: str
    formats: tuple[str, ...]
    min_version: str  # the floor a user must run, stated on every export
    notes: tuple[str, ...] = field(default_factory=tuple)


ENGINES = {
    "vllm": Engine("vLLM", ("speculators",), ">= 0.26.0 (DSpark/DFlash; the first release with vllm#48639)"),
    "sglang": Engine("SGLang", ("deepspec", "sglang-eagle3", "speculators"), "a release with sglang#30261 (DeepSpec-layout DSpark)"),
    "speculators": Engine("speculators", ("speculators",), "== 0.9.0 (the model classes our exports are tested against)"),
    "dstrain": Engine("dstrain", ("dstrain", "speculators", "deepspec", "sglang-eagle3"), "this version"),
}
DEFAULT_ENGINE = {"speculators": "vllm", "deepspec": "sglang", "sglang-eagle3": "sglang", "dstrain": "dstrain"}


def format_problems(cfg, fmt: str) -> list[str]:
    """Settings the file layout itself cannot express (formats.check_exportable's list), [] for dstrain's own."""
    if fmt == "dstrain":
        return []
    from dstrain.decoding.formats import exportable_problems

    problems = exportable_problems(cfg)
    if fmt == "deepspec" and cfg.type not in ("dspark", "dflash"):
        problems.append("drafter.type=dspark or dflash (--format deepspec is the block-drafter layout: export Eagle3 / MTP-1 "
                        "with --format speculators)")
    elif fmt == "deepspec" and not cfg.sample_from_anchor:
        problems.append("drafter.sample_from_anchor=true (DeepSpec blocks predict from the anchor; a drafter trained with "
                        "drafter.sample_from_anchor=false exports with --format speculators)")
    if fmt == "sglang-eagle3" and cfg.type != "eagle3":
        problems.append(f"drafter.type=eagle3 (--format sglang-eagle3 is SGLang's Eagle3 layout; {cfg.type}: --format deepspec)")
    return problems


def engine_problems(cfg, fmt: str, engine: str) -> list[str]:
    """What `engine` cannot load among the drafters `fmt` can write."""
    problems = []
    if engine == "vllm" and cfg.type == "dspark" and cfg.head == "rnn":
        problems.append("drafter.head=markov (vLLM's DSpark proposer builds the vanilla Markov head only)")
    if engine == "sglang" and fmt == "speculators" and cfg.type != "dspark":
        problems.append("drafter.type=dspark (SGLang reads speculators folders for DSpark only; use --format deepspec or sglang-eagle3)")
    return problems


def check(cfg, fmt: str, engine: str | None = None) -> str:
    """Refuse, in one line, an export `engine` cannot load; else the line that says what to run it with."""
    engine = engine or DEFAULT_ENGINE.get(fmt, "dstrain")
    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: not an engine (choose from {', '.join(ENGINES)})")
    eng = ENGINES[engine]
    if fmt not in eng.formats:
        raise UserError(f"--engine {engine} does not read --format {fmt} (it reads {', '.join(eng.formats)}); "
                        f"the format for it is --format {eng.formats[0]}")
    problems = format_problems(cfg, fmt) + engine_problems(cfg, fmt, engine)
    if problems:
        raise UserError(f"--format {fmt} for {eng.name}: this drafter cannot be loaded; train it with " + "; ".join(problems)
                        + (", or export --format dstrain" if fmt != "dstrain" else ""))
    return f"loads in {eng.name} {eng.min_version}"


def exportable_to(cfg) -> dict[str, list[str]]:
    """Per (engine, format) the problems of this drafter: what `dstrain plan` shows before any training."""
    out = {}
    for name, fmt in (("vllm", "speculators"), ("sglang", "deepspec"), ("sglang", "sglang-eagle3")):
        if (fmt == "sglang-eagle3" and cfg.type != "eagle3") or (fmt == "deepspec" and cfg.type not in ("dspark", "dflash")):
            continue  # the layout is for other drafters
        out[f"{name}:{fmt}"] = format_problems(cfg, fmt) + engine_problems(cfg, fmt, name)
    return out
