"""A resume with another drafter architecture: name the recipe keys that changed, not DeepSpeed's state_dict error.

Each checkpoint's manifest records the recipe keys that shape the drafter's tensors (`architecture`); before a
resume loads one, they are compared with the running recipe's. Keys a resume may change (steps, lr, logging,
data, the world) are not recorded.
"""

from __future__ import annotations

import json
from pathlib import Path

from dstrain.errors import UserError

# drafter.* shapes the weights (but init_from only seeds a fresh run, and the MoE balance rates are no tensor);
# the target decides the drafter's input width, vocabulary and captured layers (target.path may move: not compared;
# target.hf_config only for random targets, where it is the weights' shape)
SECTIONS = ("drafter", "target.name", "target.hf_config", "target.capture_layers", "target.num_capture")
IGNORED = {"drafter.init_from", "drafter.ffn.aux_loss_coef", "drafter.ffn.bias_update_rate"}


def _flat(tree, prefix: str, out: dict) -> None:
    if isinstance(tree, dict) and tree:
        for key, value in tree.items():
            _flat(value, f"{prefix}.{key}", out)
    elif prefix not in IGNORED:
        out[prefix] = tree


def architecture(recipe) -> dict:
    """The architecture keys of `recipe`, dotted, with JSON values (as the manifest stores them)."""
    tree = json.loads(json.dumps(recipe.model_dump(mode="json")))
    out: dict = {}
    for dotted in SECTIONS:
        if dotted == "target.hf_config" and tree["target"]["source"] != "random":
            continue  # only sizes the plan: the weights come from the folder, named by target.name
        node = tree
        for part in dotted.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        _flat(node, dotted, out)
    return out


def check_architecture(folder: Path, recipe) -> None:
    """One line naming every changed key when checkpoint `folder` was saved with another architecture."""
    try:
        saved = json.loads((folder / "manifest.json").read_text()).get("architecture")
    except (OSError, ValueError, AttributeError):
        return  # no readable manifest: verification has already spoken, the load reports the rest
    if not isinstance(saved, dict):
        return  # a checkpoint from before manifests recorded it
    now, unset = architecture(recipe), object()

    def shown(value) -> str:
        return "(unset)" if value is unset else json.dumps(value)

    changed = [f"{k} {shown(saved.get(k, unset))} -> {shown(now.get(k, unset))}"
               for k in sorted(set(saved) | set(now)) if saved.get(k, unset) != now.get(k, unset)]
    if changed:
        run = folder.parent.parent
        raise UserError(f"checkpoint {folder} was saved with another drafter architecture: {', '.join(changed)}; resume"
                        f" with the recipe it was trained with, or start a new run (another run.name or run.output_dir"
                        f" than {run})")
