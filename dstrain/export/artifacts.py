"""A trained drafter, from a training run folder or an exported folder, bound to the target it belongs to.

Run folder: `recipe.yaml` (written at the start of a run) + `checkpoints/latest` (DeepSpeed
model states). Export folder (`dstrain export`): `config.json` (drafter and target sections, the target's
capture layers, a fingerprint of the target's frozen embedding and LM head, STS temperatures) +
`model.safetensors`. Either loads without the training recipe; loading against a target whose
embedding or LM head differ is a one-line error.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from dstrain.errors import UserError
from dstrain.targets.fingerprint import head_fingerprint as fingerprint

EXPORT_FORMAT = "dstrain-drafter"
RUN_RECIPE = "recipe.yaml"
STS_FILE = "sts.json"


@dataclass
class DrafterArtifact:
    name: str
    source: Path
    drafter_cfg: dict
    target_cfg: dict
    state: dict[str, torch.Tensor]
    fingerprint: str | None = None  # None for a run folder: checked against the rebuilt target instead
    temperatures: list[float] | None = None
    steps: int | None = None
    target_seed: int = 0  # random test targets are built from the run's seed


def save_run_recipe(recipe, run_dir: Path) -> None:
    (run_dir / RUN_RECIPE).write_text(yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False))


def _read_sts(folder: Path) -> list[float] | None:
    f = folder / STS_FILE
    return json.loads(f.read_text())["temperatures"] if f.is_file() else None


def read_artifact(path: str | Path, name: str | None = None, recipe_path: str | None = None, need_target: bool = True) -> DrafterArtifact:
    """recipe_path: the training recipe, for a run folder without its own recipe.yaml.
    need_target=False: a serving-format folder from elsewhere is read without naming its target (--init-from)."""
    folder = Path(path)
    name = name or folder.name
    cfg_file = folder / "config.json"
    if cfg_file.is_file():
        cfg = json.loads(cfg_file.read_text())
        from dstrain.export import formats
        from dstrain.families.registry import format_of

        fam = format_of(config=cfg)
        if fam is not None:
            return _family_artifact(fam, folder, cfg, name, recipe_path, need_target)
        if formats.is_speculators(cfg) or formats.is_deepspec(cfg) or formats.is_sglang_eagle3(cfg):
            return _speculators_artifact(folder, cfg, name, recipe_path, need_target)
        if cfg.get("format") != EXPORT_FORMAT:
            raise UserError(f"{cfg_file}: not a dstrain drafter export (format {cfg.get('format')!r}); export one with dstrain export")
        from safetensors.torch import load_file

        weights = folder / "model.safetensors"
        if not weights.is_file():
            raise UserError(f"{weights}: missing; re-export the drafter with dstrain export")
        return DrafterArtifact(name, folder, cfg["drafter"], cfg["target"], load_file(str(weights)), cfg["target_fingerprint"],
                               _read_sts(folder) or cfg.get("sts_temperatures"), cfg.get("trained_steps"), cfg.get("target_seed", 0))
    if folder.parent.name == "checkpoints" and (folder / "mp_rank_00_model_states.pt").is_file():
        run, tag = folder.parent.parent, folder.name  # one checkpoint of a run: RUN/checkpoints/step-N or RUN/checkpoints/best
        if not (run / RUN_RECIPE).is_file():
            raise UserError(f"{run}: no {RUN_RECIPE}; pass the run folder with --recipe RECIPE instead")
        from dstrain.runtime.checkpoint import verify_checkpoint

        verify_checkpoint(folder)  # named directly, it has not been through a resume's check
        return run_artifact(run, yaml.safe_load((run / RUN_RECIPE).read_text()), tag, name if name != tag else run.name)
    if (folder / "checkpoints").is_dir():
        from dstrain.runtime import checkpoint

        if recipe_path is not None:
            from dstrain.config.schema import load_recipe

            tree = load_recipe(recipe_path).model_dump(mode="json")
        elif (folder / RUN_RECIPE).is_file():
            tree = yaml.safe_load((folder / RUN_RECIPE).read_text())
        else:
            raise UserError(f"{folder}: no {RUN_RECIPE} (a run from before runs kept their recipe): pass --recipe RECIPE")
        tag = checkpoint.latest(folder / "checkpoints")
        if tag is None:
            raise UserError(f"{folder}/checkpoints: no finished checkpoint to load")
        return run_artifact(folder, tree, tag, name)
    raise UserError(f"{folder}: neither a training run folder (checkpoints/) nor an exported drafter (config.json)")


def _speculators_artifact(folder: Path, cfg: dict, name: str, recipe_path: str | None, need_target: bool = True) -> DrafterArtifact:
    """A speculators-format DFlash/DSpark folder (ours, or trained elsewhere): its own config names the drafter; the
    target comes from our section when we wrote it, else from the recipe given (--recipe)."""
    from safetensors.torch import load_file

    from dstrain.export import formats

    weights = folder / "model.safetensors"
    if not weights.is_file():
        raise UserError(f"{weights}: missing")
    read = (formats.from_deepspec if formats.is_deepspec(cfg) else
            formats.from_sglang_eagle3 if formats.is_sglang_eagle3(cfg) else formats.from_speculators)
    drafter_cfg, capture, state = read(cfg, load_file(str(weights)), folder)
    ours = cfg.get(formats.DSTRAIN_KEY) or {}
    if recipe_path is not None:
        target_cfg, seed = _recipe_target(recipe_path)
    elif "target" in ours:
        target_cfg, seed = ours["target"], ours.get("target_seed", 0)
        trained = target_cfg.get("capture_layers")
        if trained is not None and drafter_cfg["type"] == "mtp" and trained[-1] == capture[-1]:
            capture = list(trained)  # MTP-1 reads only the last; the others were captured but unused
        if trained is not None and list(trained) != capture:
            raise UserError(f"{folder}: the file's layer ids read as capture layers {capture}, but the drafter was trained on "
                            f"{list(trained)} (speculators ids must be ours + 1, DeepSpec target_layer_ids and SGLang Eagle3 ids ours)")
    elif not need_target:
        target_cfg, seed = {}, 0
    else:
        raise UserError(f"{folder}: a speculators drafter not exported by dstrain: pass --recipe RECIPE naming its target")
    target_cfg = {**target_cfg, "capture_layers": capture}
    return DrafterArtifact(name, folder, drafter_cfg, target_cfg, state, ours.get("target_fingerprint"), _read_sts(folder),
                           ours.get("trained_steps"), seed)


def _recipe_target(recipe_path: str) -> tuple[dict, int]:
    """--recipe: the target section and the run seed (random test targets are built from it) of the named recipe."""
    from dstrain.config.schema import load_recipe

    recipe = load_recipe(recipe_path).model_dump(mode="json")
    return recipe["target"], recipe.get("run", {}).get("seed", 0)


def _family_artifact(fam, folder: Path, cfg: dict, name: str, recipe_path: str | None, need_target: bool
                     ) -> DrafterArtifact:
    """A folder in a family's own layout (e.g. families/deepseek_v4/export_format.py): our export in that format, or a
    released checkpoint shipping its drafter beside the target's layers. The target: the recipe's (--recipe), ours
    when we wrote it, else the checkpoint folder itself when it holds the target's layers."""
    drafter_cfg, capture, state, ours = fam.read(folder, cfg)
    if recipe_path is not None:
        target_cfg, seed = _recipe_target(recipe_path)
    elif "target" in ours:
        target_cfg, seed = ours["target"], ours.get("target_seed", 0)
        trained = target_cfg.get("capture_layers")
        if trained is not None and list(trained) != capture:
            raise UserError(f"{folder}: dspark_target_layer_ids {capture} in config.json, but the drafter was trained on "
                            f"capture layers {list(trained)}: a damaged export, re-export it")
    elif fam.holds_target(folder, cfg):
        target_cfg, seed = {"name": folder.name, "source": "path", "path": str(folder)}, 0
    elif not need_target:
        target_cfg, seed = {}, 0
    else:
        raise UserError(f"{folder}: {fam.DRAFTER} without its target: pass --recipe RECIPE naming its target")
    return DrafterArtifact(name, folder, drafter_cfg, {**target_cfg, "capture_layers": capture}, state,
                           ours.get("target_fingerprint"), _read_sts(folder) or ours.get("sts_temperatures"),
                           ours.get("trained_steps"), seed)


SEMANTIC_FIELDS = ("type", "sample_from_anchor", "mask_token_id", "qk_norm", "head", "confidence", "sliding_window")


def init_weights(drafter, cfg, frozen) -> tuple[DrafterArtifact, list[str]]:
    """drafter.init_from: load another drafter's weights into a freshly built one, after checking they mean the same
    thing here: the same target (fingerprint, when the folder carries one), the same capture layers, the same block
    semantics (SEMANTIC_FIELDS); then every weight by name and shape. Returns the artifact and what was bridged.

    Two differences are bridged, so an older drafter can move to the exportable settings: q/k norms this recipe adds
    start at weight 1 (RMSNorm's neutral scale: q and k become unit-RMS per head, which changes the attention
    temperature, so fine-tune), and a learned mask vector gives way to the target's embedding of mask_token_id."""
    from dstrain.families.registry import format_of

    art = read_artifact(cfg.init_from, need_target=False)
    src = f"drafter.init_from={cfg.init_from}"
    fam = format_of(state=art.state) or format_of(drafter=drafter)
    if fam is not None:  # a family's own layout: its own checks (V4: noise token, Markov rank, draft layers)
        fam.init(drafter, cfg, art, frozen, src)
        return art, []
    if art.fingerprint is not None and art.fingerprint != fingerprint(frozen):
        raise UserError(f"{src}: trained against a target with fingerprint {art.fingerprint}, this run's target has "
                        f"{fingerprint(frozen)}: start from a drafter of this target")
    wanted, have = art.target_cfg.get("capture_layers"), list(frozen.capture_layers)
    if wanted is not None and (list(wanted) != have and not (cfg.type == "mtp" and list(wanted)[-1:] == have[-1:])):
        raise UserError(f"{src}: trained on capture layers {list(wanted)}, this run captures {have}: set target.capture_layers={list(wanted)}")
    theirs = drafter_config(art)
    bridged, state = [], dict(art.state)
    if not theirs.qk_norm and cfg.qk_norm:
        bridged.append("q/k norms added at weight 1")
    if theirs.mask_token_id is None and cfg.mask_token_id is not None:
        state.pop("mask_embed", None)
        bridged.append(f"learned mask vector replaced by the target's embedding of token {cfg.mask_token_id}")
    differ = [f"{k}={getattr(theirs, k)!r}" for k in SEMANTIC_FIELDS if getattr(theirs, k) != getattr(cfg, k)
              and not (k == "qk_norm" and cfg.qk_norm) and not (k == "mask_token_id" and theirs.mask_token_id is None)]
    if differ:
        raise UserError(f"{src}: that drafter was trained with " + ", ".join(differ) + ": set the same in this recipe")
    own = drafter.state_dict()
    added = {k for k in own if k.endswith(("q_norm.weight", "k_norm.weight"))} if cfg.qk_norm and not theirs.qk_norm else set()
    bad = sorted((set(own) - added) ^ set(state)) + [k for k in own if k in state and own[k].shape != state[k].shape]
    if bad:
        raise UserError(f"{src}: weights do not fit this recipe's {cfg.type} drafter ({bad[:3]}): match its layers, heads and sizes")
    drafter.load_state_dict({**{k: own[k] for k in added}, **{k: v.to(own[k].dtype) for k, v in state.items()}})
    return art, bridged


def _strip(state: dict) -> dict:
    """Checkpoints hold train.step.DraftStep (drafter + loss); artifacts are the drafter alone."""
    return {k.removeprefix("drafter."): v for k, v in state.items()}


def run_artifact(folder: Path, recipe_tree: dict, tag: str, name: str) -> DrafterArtifact:
    states = folder / "checkpoints" / tag / "mp_rank_00_model_states.pt"
    if (states.parent / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file():  # ZeRO-3: each rank holds a slice
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        module = _strip(get_fp32_state_dict_from_zero_checkpoint(str(folder / "checkpoints"), tag=tag))
    elif states.is_file():
        module = _strip(torch.load(states, map_location="cpu", weights_only=False)["module"])
    else:
        raise UserError(f"{states}: missing (damaged checkpoint); delete {states.parent} to fall back to an older one")
    steps = int(tag.split("-")[-1]) if tag.startswith("step-") else None
    if (states.parent / "best.json").is_file():  # checkpoints/best (evaluation during training): the step it was taken at
        steps = json.loads((states.parent / "best.json").read_text())["step"]
    return DrafterArtifact(name, folder, recipe_tree["drafter"], recipe_tree["target"], module, None, _read_sts(folder), steps,
                           recipe_tree.get("run", {}).get("seed", 0))


def load_target_for(artifact: DrafterArtifact, target_path: str | Path | None = None):
    """The target a drafter decodes against, through transformers: `target_path` (an hf folder) when given, else the
    one its recipe names. A megatron-backend recipe's target is its checkpoint folder — a transformers folder, the one
    its megatron ranks read (written once for a random test target) — loaded whole on one process."""
    from dstrain.config.schema import TargetConfig
    from dstrain.targets import checkpoint_folder, load_target

    cfg = TargetConfig(**artifact.target_cfg)
    if target_path is not None and not Path(target_path).is_dir():
        raise UserError(f"--target {target_path}: not a folder; give the target's Hugging Face folder")
    if target_path is not None or cfg.backend != "hf":
        path = str(target_path) if target_path is not None else checkpoint_folder(cfg, artifact.target_seed)
        cfg = cfg.model_copy(update={"backend": "hf", "source": "path", "path": path})
    if transformers_lacks(cfg):  # a megatron-only family: one whole megatron replica in this process
        from dstrain.runtime.one_process import OneProcessTarget

        return OneProcessTarget(cfg.model_copy(update={"backend": "megatron"}), artifact.target_seed)
    return load_target(cfg, seed=artifact.target_seed)


def transformers_lacks(cfg) -> bool:
    """Whether the target's family brings its own config because transformers has no model for it (V4.1)."""
    from dstrain import capabilities
    from dstrain.targets.configs import load_config

    if cfg.source != "path" or not (Path(cfg.path) / "config.json").is_file():
        return False
    cap = capabilities.of_config(load_config(cfg.path))
    return cap is not None and cap.config_class is not None


def frozen_target_for(artifact: DrafterArtifact):
    """What binds a drafter to its target — config, embedding, LM head, capture layers — read from the target's
    checkpoint alone (targets/frozen.py: those tensors and nothing else), whatever backend trained it."""
    from dstrain.config.schema import TargetConfig
    from dstrain.targets.frozen import load_frozen_parts

    return load_frozen_parts(TargetConfig(**artifact.target_cfg), artifact.target_seed)


def drafter_config(artifact: DrafterArtifact):
    """The artifact's DrafterConfig. A DSpark drafter saved before drafter.backbone existed has no such key: its
    weights say which backbone trained it (V4's own layout is mtp.{i}.*), so `auto` does not rebuild it otherwise."""
    from dstrain.config.schema import DrafterConfig

    raw = dict(artifact.drafter_cfg)
    if "backbone" not in raw and raw.get("type") == "dspark":
        raw["backbone"] = "v4" if any(k.startswith("mtp.") for k in artifact.state) else "generic"
    return DrafterConfig(**raw)


def _config(target):
    """A loaded target's model config (HFTarget) or a frozen-parts one's (FrozenParts)."""
    return target.config if hasattr(target, "config") else target.model.config


def build(artifact: DrafterArtifact, target):
    """The drafter module with its trained weights, after checking it belongs to this target."""
    from dstrain.drafters.contract import spec_from_config
    from dstrain.families.registry import build_drafter

    if artifact.fingerprint is not None and artifact.fingerprint != fingerprint(target):
        raise UserError(f"{artifact.source}: this drafter was trained against a target with fingerprint {artifact.fingerprint}, "
                        f"but {target.name} has {fingerprint(target)}: evaluate it with the target it was trained for")
    wanted = artifact.target_cfg.get("capture_layers") or None
    if wanted is not None and list(wanted) != list(target.capture_layers):
        raise UserError(f"{artifact.source}: trained on capture layers {wanted}, the target captures {target.capture_layers}")
    cfg = drafter_config(artifact)
    drafter = build_drafter(cfg, spec_from_config(_config(target), len(target.capture_layers)), target.embedding,
                            _config(target))
    missing, unexpected = drafter.load_state_dict(artifact.state, strict=False)
    if missing or unexpected:
        raise UserError(f"{artifact.source}: weights do not fit a {cfg.type} drafter (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return drafter.eval()


FORMATS = ("dstrain", "speculators", "deepspec", "sglang-eagle3")  # and each family's own (families/registry.py)


def check_export(artifact: DrafterArtifact, fmt: str, engine: str | None = None) -> str:
    """Refuse before any weights load what `fmt` cannot express or `engine` cannot load (export/engines.py);
    returns the line naming the engine release to serve it with."""
    from dstrain.export import engines
    from dstrain.families.registry import family_formats, format_of

    families = family_formats()
    if fmt not in FORMATS and fmt not in families:
        raise UserError(f"--format {fmt}: not a format (choose from {', '.join((*FORMATS, *families))})")
    theirs = format_of(state=artifact.state)
    fam = families.get(fmt)
    if fam is not None:
        if theirs is not fam:
            raise UserError(f"--format {fmt}: this {artifact.drafter_cfg.get('type')} drafter is not {fam.DRAFTER} "
                            f"({fam.LAYOUT}, {fam.TRAINED_ON}): export it with --format speculators, deepspec or dstrain")
        if engine not in (None, *fam.ENGINES):
            raise UserError(f"--engine {engine} does not read --format {fmt} ({fam.ENGINE_NAMES} do): drop --engine or "
                            f"name {' or '.join(fam.ENGINES)}")
        capture = artifact.target_cfg.get("capture_layers")
        if capture:
            fam.check_layers(int(artifact.drafter_cfg.get("num_layers", len(capture))), capture)
        return fam.WRITTEN_FOR
    if theirs is not None and fmt != "dstrain":
        raise UserError(f"--format {fmt}: {theirs.DRAFTER} ({theirs.LAYOUT}) has no place in that layout: export it with "
                        f"--format {theirs.FORMAT}")
    return engines.check(drafter_config(artifact), fmt, engine)


def export(artifact: DrafterArtifact, target, out: Path, fmt: str = "dstrain", engine: str | None = None) -> Path:
    """Write config.json + model.safetensors atomically (staging folder, then rename).
    fmt: dstrain (our own folder) or an engine layout (dstrain/export/formats.py), checked against `engine`."""
    import shutil

    from safetensors.torch import save_file

    from dstrain.drafters.contract import spec_from_config

    from dstrain.families.registry import family_formats

    check_export(artifact, fmt, engine)
    drafter = build(artifact, target)
    fam = family_formats().get(fmt)
    if fam is not None:
        return _export_family(fam, artifact, target, drafter, out)
    spec = spec_from_config(_config(target), len(target.capture_layers))
    binding = {"target": {**artifact.target_cfg, "capture_layers": list(target.capture_layers)}, "target_name": target.name,
               "target_fingerprint": fingerprint(target), "target_seed": artifact.target_seed, "trained_steps": artifact.steps}
    if fmt != "dstrain":
        from dstrain.export import formats

        # name_or_path: the target's folder when it has one (engines load it by that name); none for built targets
        # (random, upcycled), whose binding is our fingerprint in the dstrain section
        verifier = {"name_or_path": artifact.target_cfg.get("path"),
                    "architectures": list(getattr(_config(target), "architectures", None) or [type(getattr(target, "model", target)).__name__])}
        dcfg = drafter_config(artifact)
        if fmt == "speculators":
            config, tensors = formats.to_speculators(drafter, dcfg, spec, list(target.capture_layers), verifier, target.num_layers)
        elif fmt == "deepspec":
            config, tensors = formats.to_deepspec(drafter, dcfg, spec, list(target.capture_layers), target.num_layers)
        else:
            config, tensors = formats.to_sglang_eagle3(drafter, dcfg, spec, list(target.capture_layers), target.num_layers)
        config[formats.DSTRAIN_KEY] = {**binding, "drafter": artifact.drafter_cfg}
    staging = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    if fmt != "dstrain":
        formats.write_speculators(staging, config, tensors)
        if artifact.temperatures:
            (staging / STS_FILE).write_text(json.dumps({"temperatures": artifact.temperatures}))
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
        return out
    save_file({k: v.contiguous() for k, v in drafter.state_dict().items()}, str(staging / "model.safetensors"))

    config = {"format": EXPORT_FORMAT, "version": 1, "drafter": artifact.drafter_cfg,
              "target": {**artifact.target_cfg, "capture_layers": list(target.capture_layers)},
              "target_name": target.name, "target_fingerprint": fingerprint(target),
              "target_spec": asdict(spec),
              "sts_temperatures": artifact.temperatures, "trained_steps": artifact.steps, "target_seed": artifact.target_seed,
              "exported_from": str(artifact.source)}
    (staging / "config.json").write_text(json.dumps(config, indent=2))
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out


def _export_family(fam, artifact: DrafterArtifact, target, drafter, out: Path) -> Path:
    """A family's own format (e.g. --format deepseek-v4), written to sit beside the target checkpoint it is served
    with (quantised like it)."""
    from dstrain.config.schema import TargetConfig
    from dstrain.targets import checkpoint_folder

    host = checkpoint_folder(TargetConfig(**artifact.target_cfg), artifact.target_seed)
    binding = {"target": {**artifact.target_cfg, "capture_layers": list(target.capture_layers)}, "target_name": target.name,
               "target_fingerprint": fingerprint(target), "target_seed": artifact.target_seed,
               "trained_steps": artifact.steps, "drafter": artifact.drafter_cfg, "exported_from": str(artifact.source)}
    path, _ = fam.export(drafter, host, out, list(target.capture_layers), binding, artifact.temperatures)
    return path


def export_lines(artifact, target, out, fmt: str) -> list[str]:
    """What `dstrain export` prints after writing: each engine's verdict on the written folder and this target."""
    from dstrain.export.engines import target_architecture, verdicts

    if fmt == "dstrain":
        return ["dstrain's own folder: dstrain eval, dstrain calibrate and drafter.init_from read it; no engine does"]
    host = json.loads((out / "config.json").read_text()) if fmt == "deepseek-v4" else None  # the keys as written
    arch = target_architecture(_config(target))
    served = artifact.target_cfg.get("path") or target.name
    found = verdicts(drafter_config(artifact), fmt, arch, host, str(out), served)
    return [line for v in found for line in v.line().splitlines()]
