"""The DeepSpec checkout: its content verified against the commits this tool knows, its modules imported from it,
its DSpark config read (parsed, not executed)."""

from __future__ import annotations

import argparse
import ast
import hashlib
import sys
from pathlib import Path

from dstrain.errors import UserError

# DeepSpec content this tool was written against: commit -> sha256 over "path blob-sha1" lines of every
# deepspec/**/*.py and config/dspark/*.py (sorted), so a git checkout, a worktree or an exported copy can be checked
# alike, and a local edit to any file it imports is refused.
KNOWN_COMMITS = {"afdfa7c9382a3341a3e6f17756dd816da79f132c":
                 "2fe60e5c6253ac1379b4069b0183e53c1577ec3e84e21e60e2a3814f487ef0e4"}
DEEPSPEC_CONFIG = "config/dspark/dspark_qwen3_4b.py"


def _blob_sha(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def content_digest(root: Path) -> str:
    files = sorted(list(root.glob("deepspec/**/*.py")) + list(root.glob("config/dspark/*.py")))
    lines = [f"{p.relative_to(root).as_posix()} {_blob_sha(p.read_bytes())}" for p in files]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def check_checkout(path: str | None) -> dict:
    """{commit, digest, head}: the known commit whose content the checkout holds; UserError in one line otherwise."""
    import subprocess

    if not path:
        raise UserError("--deepspec: give the path of a DeepSpec checkout (e.g. git -C MIRROR worktree add /work/deepspec "
                        f"{next(iter(KNOWN_COMMITS))[:7]})")
    root = Path(path).expanduser().resolve()
    if not (root / "deepspec" / "modeling" / "dspark").is_dir() or not (root / DEEPSPEC_CONFIG).is_file():
        raise UserError(f"--deepspec {path}: no DeepSpec checkout there (deepspec/modeling/dspark/ and {DEEPSPEC_CONFIG} "
                        "missing); give the folder a DeepSpec clone or worktree was checked out to")
    digest = content_digest(root)
    head = None
    try:  # the checkout's own HEAD (not that of a repository it was copied into)
        top, head = (subprocess.run(["git", "-C", str(root), "rev-parse", what], capture_output=True, text=True,
                                    timeout=30).stdout.strip() for what in ("--show-toplevel", "HEAD"))
        head = head if top and Path(top).resolve() == root else None
    except (OSError, subprocess.SubprocessError):
        pass
    commit = next((c for c, d in KNOWN_COMMITS.items() if d == digest), None)
    if commit is None:
        at = f" (its git HEAD is {head[:12]})" if head else ""
        raise UserError(f"--deepspec {path}: its deepspec/ and {Path(DEEPSPEC_CONFIG).parent}/ files are not those of a "
                        f"DeepSpec commit this tool knows{at}; check out {', '.join(c[:12] for c in KNOWN_COMMITS)} "
                        "unmodified (git -C PATH checkout COMMIT -- deepspec config)")
    return {"commit": commit, "digest": digest, "head": head, "path": str(root)}


def import_deepspec(root: str):
    """DeepSpec's modules from the checkout (first on sys.path), checked to come from there."""
    if root not in sys.path:
        sys.path.insert(0, root)
    import deepspec

    where = Path(deepspec.__file__).resolve()
    if Path(root) not in where.parents:
        raise UserError(f"--deepspec {root}: `import deepspec` resolved to {where.parent} (another installation); "
                        "uninstall it or run from a clean environment")
    from deepspec.modeling.dspark.loss import compute_dspark_loss
    from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel, build_draft_config
    from deepspec.utils import metrics, seed_all
    from deepspec.utils.config import parse_opts_to_config, to_config_node
    from deepspec.utils.optim import BF16Optimizer

    return argparse.Namespace(compute_dspark_loss=compute_dspark_loss, Qwen3DSparkModel=Qwen3DSparkModel,
                              build_draft_config=build_draft_config, metrics=metrics, seed_all=seed_all,
                              parse_opts_to_config=parse_opts_to_config, to_config_node=to_config_node,
                              BF16Optimizer=BF16Optimizer)


def read_deepspec_config(root: Path) -> tuple[dict, list[str]]:
    """The literal settings of DeepSpec's DSpark config, read without executing it (it imports DeepSpec's trainer,
    which imports tensorboard, FSDP and CUDA-only pieces): {section: {key: value}} and the keys that are not literals."""
    tree = ast.parse((root / DEEPSPEC_CONFIG).read_text())
    out, skipped = {}, []
    for node in tree.body:
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        name, value = node.targets[0].id, node.value
        if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "dict":
            section = {}
            for kw in value.keywords:
                try:
                    section[kw.arg] = ast.literal_eval(kw.value)
                except ValueError:
                    skipped.append(f"{name}.{kw.arg}")
            out[name] = section
        else:
            try:
                out[name] = ast.literal_eval(value)
            except ValueError:
                skipped.append(name)
    return out, skipped

