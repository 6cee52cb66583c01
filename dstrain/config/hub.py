"""`target.path` as a Hugging Face hub id (`org/name`), resolved from the local Hugging Face cache only.

Nothing is downloaded at run time (clusters often have no route out, and every rank would race for it):
the user fetches once with `hf download org/name` (`hf` is huggingface_hub 1.0's command, in place of
`huggingface-cli`) and recipes can then name the model.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from dstrain.errors import UserError

# org/name as the hub spells it: one slash, no leading '.', '/' or '~' (those are paths).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def looks_like_hub_id(path: str) -> bool:
    return bool(_HUB_ID.match(path)) and ".." not in path


def hub_cache_dir() -> Path:
    """The cache huggingface_hub itself uses, read now (not at its import) so a changed HF_HUB_CACHE counts."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def cached_snapshot(repo_id: str) -> str | None:
    """The snapshot folder of repo_id's main revision in the local cache, or None."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, cache_dir=hub_cache_dir(), local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None


def not_found_message(path: str) -> str:
    return (f"target.path={path}: not a local folder and not in the Hugging Face cache ({hub_cache_dir()}); "
            f"download it with `hf download {path}` or give a folder")


def resolve_target_path(path: str, required: bool) -> str:
    """A local folder as given; a hub id becomes its cached snapshot folder. An uncached hub id is an error when
    nothing else can stand in for the weights (`required`: no target.hf_config to size a plan from)."""
    if Path(path).expanduser().is_dir() or not looks_like_hub_id(path):
        return path
    snapshot = cached_snapshot(path)
    if snapshot:
        return snapshot
    if required:
        raise UserError(not_found_message(path))
    return path
