"""The import contract (dstrain/testing/import_contract.py) holds on the tree, and fails on each kind of breach
injected into a copy of it."""

import shutil
from pathlib import Path

from dstrain.testing.import_contract import problems

ROOT = Path(__file__).resolve().parents[2]


def test_the_house_holds():
    assert problems(ROOT) == []


def _copy(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "dstrain", tmp_path / "dstrain", ignore=lambda d, names: [n for n in names if not (
        n.endswith(".py") or (Path(d) / n).is_dir()) or n in ("__pycache__", "corpus", "recipes")])
    return tmp_path


def _add(root: Path, module: str, line: str) -> None:
    path = root / (module.replace(".", "/") + ".py")
    path.write_text(path.read_text() + f"\n\ndef _injected():\n    {line}\n")


def test_injected_breaches_are_caught(tmp_path):
    root = _copy(tmp_path)
    assert problems(root) == []
    _add(root, "dstrain.packing.anchors", "from dstrain.packing.blocks import pack_blocks")  # blocks imports anchors
    _add(root, "dstrain.data.shards", "import dstrain.train.trainer")  # train imports data: a package loop
    _add(root, "dstrain.export.formats", "from dstrain.testing import tiny_checkpoints")
    found = problems(root)
    assert any(p.startswith("module cycle:") and "dstrain.packing.anchors" in p and "dstrain.packing.blocks" in p
               for p in found), found
    assert any(p.startswith("package cycle:") and "dstrain.data" in p and "dstrain.train" in p for p in found), found
    assert "dstrain.data.shards (layer 8) imports dstrain.train.trainer (layer 13): a lower layer may not import a " \
           "higher one" in found
    assert "dstrain.export.formats imports test code dstrain.testing.tiny_checkpoints" in found
    (root / "dstrain" / "newpkg").mkdir()
    (root / "dstrain" / "newpkg" / "__init__.py").write_text("")
    assert "dstrain.newpkg: its package is in no layer of dstrain/testing/import_contract.py LAYERS" in problems(root)
