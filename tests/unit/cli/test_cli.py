"""The `dstrain` command: every command answers --help and names its arguments, recipes resolve by name, the console
script and the packaged recipes are declared in pyproject, the licence is there, and the tools/ wrappers still run."""

import contextlib
import importlib
import io
import json
import os
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import pytest

from conftest import ROOT, run_tool

from dstrain.cli import COMMANDS, main

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SHIPPED = sorted((ROOT / "dstrain" / "recipes").glob("*.yaml"))

# Each command, and words its --help must contain: its own arguments (so a help that lost them fails).
HELP_NAMES = {
    "train": ["recipe", "overrides", "--dry-run", "--print-world", "--nproc-per-node"],
    "plan": ["recipe", "overrides"],
    "recipes": ["--path"],
    "data prompts": ["--out", "--count", "--mix"],
    "data regenerate": ["--prompts", "--target-dir", "--endpoint", "--continuous"],
    "data shards": ["--inputs", "--tokenizer", "--samples-per-shard"],
    "data synthetic": ["--recipe", "--out", "--count", "--seed"],
    "data pack": ["--recipe", "--unpack", "--resplit"],
    "data features": ["--recipe", "overrides", "--samples", "--batch-tokens"],
    "upcycle": ["--recipe", "--dense", "--experts", "--check"],
    "export": ["run", "out", "--format", "speculators"],
    "eval": ["--drafter", "--prompts", "--limit", "--threshold"],
    "calibrate": ["drafter", "--rollouts", "--count"],
    "table": ["--families", "--preset", "--quick", "--dry-run", "--set"],
    "simulate": ["--rollouts", "--sps", "--concurrency"],
    "demo": ["--recipe", "--corpus", "--fresh-prompts", "--run-dir", "--bench-prompts"],
    "docs recipes": ["usage: dstrain docs recipes"],
}

def call(*argv: str) -> tuple[int, str, str]:
    """dstrain ARGV in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
        main(list(argv))
    return exit_.value.code or 0, out.getvalue(), err.getvalue()


def leaf_commands(table=COMMANDS, prefix=()):
    for name, entry in table.items():
        if isinstance(entry, dict):
            yield from leaf_commands(entry, prefix + (name,))
        else:
            yield " ".join(prefix + (name,))


def test_every_command_has_help_naming_its_arguments():
    assert sorted(leaf_commands()) == sorted(HELP_NAMES), "a command was added or removed: list its arguments here"
    code, top, _ = call("--help")
    assert code == 0 and top.startswith("usage: dstrain")
    for command, names in HELP_NAMES.items():
        assert command in top, f"dstrain --help does not list {command}"
        code, text, err = call(*command.split(), "--help")
        assert code == 0, err
        assert text.startswith(f"usage: dstrain {command}"), text[:200]
        missing = [n for n in names if n not in text]
        assert not missing, f"dstrain {command} --help lacks {missing}"
    code, text, _ = call("data", "--help")
    assert code == 0 and all(sub in text for sub in ("prompts", "regenerate", "shards", "synthetic", "pack", "features"))


def test_python_dash_m_and_help_is_fast():
    """`python -m dstrain` is the module entry torchrun uses; --help must not load torch (measured ~0.2 s)."""
    code = ("import runpy, sys, time; t = time.perf_counter(); sys.argv = ['dstrain', '--help']\n"
            "try: runpy.run_module('dstrain', run_name='__main__')\n"
            "except SystemExit as e: assert not e.code, e.code\n"
            "print('TORCH', 'torch' in sys.modules, 'SECONDS', time.perf_counter() - t)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "usage: dstrain" in proc.stdout and "TORCH False" in proc.stdout, proc.stdout[-500:]


def test_options_anywhere_among_the_overrides():
    """`dstrain train RECIPE --dry-run a.b=c` is the same command as with --dry-run last (argparse alone stopped the
    overrides at the option and called the rest unrecognised)."""
    last = call("train", "tiny_moe", "train.steps=7", "--dry-run")
    between = call("train", "tiny_moe", "--dry-run", "train.steps=7")
    assert last[0] == between[0] == 0 and last[1] == between[1] and "train    7 steps" in between[1]


def test_data_synthetic_writes_the_shards_a_random_target_trains_on(tmp_path):
    from dstrain.data.loader import load_manifest

    code, text, err = call("data", "synthetic", "--recipe", "tiny_moe", "--out", str(tmp_path / "s"), "--count", "70")
    assert code == 0, err
    man = load_manifest(tmp_path / "s", "tiny-moe")
    assert sum(s["samples"] for s in man["shards"]) == 70
    code, _, err = call("data", "synthetic", "--recipe", "smollm2_moe", "--out", str(tmp_path / "t"))
    assert code == 2 and "dstrain data shards --recipe smollm2_moe" in err and not (tmp_path / "t").exists()


def test_data_features_mistakes_are_one_line():
    """A recipe without a feature cache folder, or a count below one: one line naming the key or option, exit 2."""
    code, _, err = call("data", "features", "--recipe", "tiny_moe", "data.shards=unused")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "train.feature_cache_dir is not set" in err
    code, _, err = call("data", "features", "--recipe", "tiny_moe", "--samples", "0")
    assert code == 2 and "--samples must be at least 1" in err


def test_plan_by_name_and_unknown_names():
    code, text, err = call("plan", "tiny_moe", "train.steps=7")
    assert code == 0, err
    assert text.startswith("dstrain plan for tiny_moe") and "memory per rank" in text
    code, text, err = call("train", "v4_flash", "--print-world")
    assert code == 0, err
    world = json.loads(text)
    assert (world["world_size"], world["ranks_per_node"], world["nodes"]) == (72, 8, 9)
    assert [g["role"] for g in world["node_map"][0]["gpus"]] == ["drafter"] * 8  # slurm/ reads which node does what
    assert {(g["gpu"], g["replica"], g["tp"]) for g in world["node_map"][2]["gpus"]} == {(i, 1, i) for i in range(8)}
    for bad in ("v4_flashy", "no/such/recipe.yaml"):
        code, text, err = call("plan", bad)
        assert code == 2 and text == ""
        assert len(err.strip().splitlines()) == 1 and "v4_flash" in err, err  # one line naming the shipped recipes


def test_table_dry_run_prints_the_plan_and_writes_nothing(tmp_path):
    """`dstrain table --dry-run` resolves either preset from the recipe and the corpus manifest: every stage with its
    first-guess time and the ETA, OUT not created; a corpus that is not one ends in one line."""
    out = tmp_path / "table"
    code, text, err = call("table", "--preset", "paper", "--dry-run", "--out", str(out))
    assert code == 0, err
    for stage in ("train dspark-markov-s0", "train eagle3-s2", "held-out dflash-s1", "benchmarks dflash-s1"):
        assert stage in text
    code, text, err = call("table", "--preset", "paper", "--run", "eagle3:1", "--dry-run", "--out", str(out))
    assert code == 0 and "train eagle3-s1" in text and "dspark-markov-s0" not in text and not out.exists()
    code, _, err = call("table", "--preset", "paper", "--run", "medusa:1", "--dry-run", "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "FAMILY:SEED" in err
    train_prompts = json.loads((ROOT / "corpus" / "smollm2_moe" / "manifest.json").read_text())["held_out"]["train_prompts"]
    assert f"{train_prompts} training prompts" in text and "ETA " in text and not out.exists()
    code, text, err = call("table", "--dry-run", "--families", "eagle3,dspark-rnn", "--steps", "40", "--out", str(out))
    assert code == 0 and "train eagle3" in text and "evaluate dspark-rnn" in text and "40 steps" in text and not out.exists()
    code, _, err = call("table", "--dry-run", "--corpus", str(tmp_path / "nothing"))
    assert code == 2 and len(err.strip().splitlines()) == 1 and "--corpus" in err and "shipped corpus" in err


def test_table_refuses_a_second_process_on_one_out(tmp_path):
    """Two `dstrain table` processes on one OUT could wipe a training run mid-write (the second finds no checkpoint
    yet and starts the stage clean): the second is refused in one line naming the holder; the lock goes with it."""
    from dstrain.reproduce.out_lock import hold_out_folder

    held = hold_out_folder(tmp_path / "t", ["--out", "t"])
    for preset in ("budget", "paper"):
        code, out, err = call("table", "--preset", preset, "--quick", "--out", str(tmp_path / "t"))
        assert code == 2 and not out and len(err.strip().splitlines()) == 1, err
        assert "another dstrain table" in err and f"pid {os.getpid()}" in err
    # a mistake is refused before the folder is taken: nothing is left behind
    code, _, err = call("table", "--families", "nonesuch", "--out", str(tmp_path / "new"))
    assert code == 2 and "--families" in err and not (tmp_path / "new").exists()
    held.close()  # released (a process's exit closes it too): the folder can be taken again
    hold_out_folder(tmp_path / "t", []).close()


def test_recipes_lists_every_shipped_yaml():
    code, text, _ = call("recipes")
    assert code == 0
    listed = {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines()}
    assert set(listed) == {p.stem for p in SHIPPED} and len(SHIPPED) >= 5
    assert all(listed.values()), "every shipped recipe starts with a one-line description comment"
    code, text, _ = call("recipes", "--path", "tiny_moe")
    assert code == 0 and Path(text.strip()) == (ROOT / "dstrain" / "recipes" / "tiny_moe.yaml").resolve()
    assert (ROOT / "recipes").resolve() == (ROOT / "dstrain" / "recipes").resolve(), "recipes/ must stay a link to the package's"


def test_recipe_description_is_the_first_sentence_of_the_opening_comment(tmp_path):
    from dstrain.config.files import describe

    path = tmp_path / "r.yaml"
    path.write_text("# A target (1.6T total / 49B active; d=7168) on\n# four nodes. Second sentence.\nrun:\n  name: x\n# later\n")
    assert describe(path) == "A target (1.6T total / 49B active; d=7168) on four nodes."
    path.write_text("run:\n  name: x\n")
    assert describe(path) == ""


def test_docs_recipes_is_wired():
    """Generated by dstrain/cli/reference_docs.py; before that module exists, one line saying so."""
    code, text, err = call("docs", "recipes")
    if importlib.util.find_spec("dstrain.cli.reference_docs") is None:
        assert code == 2 and "docs_gen" in err and len(err.strip().splitlines()) == 1
    else:
        assert code == 0 and "train" in text, err


def test_console_script_and_package_data_declared():
    script = PYPROJECT["project"]["scripts"]["dstrain"]
    module, _, attr = script.partition(":")
    assert callable(getattr(importlib.import_module(module), attr))
    globs = PYPROJECT["tool"]["setuptools"]["package-data"]["dstrain"]
    for path in SHIPPED:
        rel = path.relative_to(ROOT / "dstrain").as_posix()
        assert any(fnmatch(rel, g) for g in globs), f"{rel} is not shipped by package-data {globs}"
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    assert "pytest" not in " ".join(PYPROJECT["project"]["dependencies"])
    assert any(d.startswith("pytest") for d in PYPROJECT["project"]["optional-dependencies"]["test"])
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "Copyright 2026 The dstrain authors" in text


def test_lock_pins_every_dependency_inside_its_range():
    from packaging.requirements import Requirement

    lock = {}
    for line in (ROOT / "requirements.lock").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            lock[name.strip().lower().replace("_", "-")] = version.strip()
    deps = PYPROJECT["project"]["dependencies"] + [d for ds in PYPROJECT["project"]["optional-dependencies"].values() for d in ds]
    for dep in map(Requirement, deps):
        name = dep.name.lower().replace("_", "-")
        assert name in lock, f"{name} has no tested version in requirements.lock"
        assert dep.specifier.contains(lock[name], prereleases=True), f"requirements.lock {name}=={lock[name]} is outside {dep}"


def test_installed_console_script():
    """The `dstrain` executable pip writes beside the venv's python (make install creates it; CI requires it)."""
    exe = Path(sys.executable).parent / "dstrain"
    if not exe.exists():
        ci = os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")
        assert not ci, f"{exe} missing under CI: make install must install the console script"
        pytest.skip(f"{exe} not installed here (make install creates it)")
    proc = subprocess.run([str(exe), "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: dstrain" in proc.stdout, proc.stderr


def test_main_py_is_dstrain_train_and_tools_wrap_no_command():
    """dstrain/main.py (the documented torchrun entry) takes `dstrain train`'s arguments; tools/ holds developer
    benches only, no second spelling of a command."""
    text = run_tool("dstrain/main.py", "--help", timeout=120).stdout
    assert text.startswith("usage: main.py")
    missing = [n for n in HELP_NAMES["train"] if not n.startswith("usage:") and n not in text]
    assert not missing, f"dstrain/main.py --help lacks {missing}"
    wrappers = [p.name for p in (ROOT / "tools").glob("*.py") if "tool_main" in p.read_text()]
    assert wrappers == [], f"tools/ wraps dstrain commands: {wrappers}"


# -- errors that blame the right thing ---------------------------------------------------------------------------------
def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def test_hub_hint_names_the_hf_command(monkeypatch, tmp_path):
    """huggingface_hub 1.0 dropped `huggingface-cli`; the hint must name the command that exists (`hf download`)."""
    from dstrain.config.hub import not_found_message

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert "`hf download acme/tiny-moe`" in not_found_message("acme/tiny-moe")
    for folder in ("dstrain", "docs", "tools"):
        hits = [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md", ".sh")
                and "huggingface-cli download" in p.read_text(errors="ignore")]
        assert not hits, hits


def test_data_shards_blames_the_recipe_target_not_a_missing_flag(tmp_path):
    conversations = tmp_path / "c.jsonl"
    conversations.write_text("{}\n")
    common = ["data", "shards", "--inputs", str(conversations), "--out", str(tmp_path / "out")]
    # tiny_moe's target is random: no tokenizer (it said "give --recipe", which was given)
    code, _, err = call(*common, "--recipe", "tiny_moe")
    line = one_error_line(err)
    assert code == 2 and "has no tokenizer" in line and "--tokenizer FOLDER" in line and "give --recipe," not in line
    # a copied recipe whose target.path is not edited yet: name target.path and its value, not --tokenizer
    tree = (ROOT / "dstrain" / "recipes" / "tiny_moe.yaml").read_text()
    copy = tmp_path / "mine.yaml"
    copy.write_text(tree.replace("source: random", f"source: path\n  path: {tmp_path / 'EDIT-ME'}"))
    code, _, err = call(*common, "--recipe", str(copy))
    line = one_error_line(err)
    assert code == 2 and f"target.path {tmp_path / 'EDIT-ME'}" in line and "--tokenizer /" not in line, line
    assert "point it at the target model's Hugging Face folder" in line


def test_unreadable_shards_folder_is_one_line(tmp_path, monkeypatch):
    """A folder this user may not enter made Path.is_file() raise PermissionError: a traceback out of `dstrain train`.
    Tests run as root (mode 000 still readable), so the refusal is injected."""
    import errno
    import pathlib

    shards = tmp_path / "shards"
    shards.mkdir()
    real_stat = pathlib.Path.stat

    def stat(self, *a, **k):
        if str(self).startswith(str(shards) + os.sep):
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_stat(self, *a, **k)

    monkeypatch.setattr(pathlib.Path, "stat", stat)
    out = f"run.output_dir={tmp_path / 'runs'}"
    code, _, err = call("train", "tiny_moe", f"data.shards={shards}", out)
    line = one_error_line(err)
    assert code == 2 and f"data.shards {shards}" in line and "Permission denied" in line and "readable" in line
    monkeypatch.undo()
    a_file = tmp_path / "afile"
    a_file.write_text("x")
    code, _, err = call("train", "tiny_moe", f"data.shards={a_file}", out)
    line = one_error_line(err)
    assert code == 2 and f"data.shards {a_file}: a file, not a folder" in line


def test_one_error_prefix():
    """Every message is `error: ...` (the handler's prefix); no source prints a capitalised `Error:` of its own."""
    import re

    assert 'f"error: {err}"' in (ROOT / "dstrain" / "errors.py").read_text()
    literal = re.compile(r"""(["'])Error:""")
    hits = [f"{p}:{n}" for folder in ("dstrain", "tools") for p in (ROOT / folder).rglob("*.py")
            for n, text in enumerate(p.read_text().splitlines(), 1) if literal.search(text)]
    assert not hits, hits


@pytest.mark.parametrize("words", [(), ("data",)])
def test_bare_command_lists_the_commands(words):
    """`dstrain` alone said only "required: COMMAND, args": it lists the commands on stderr and exits 2."""
    code, out, err = call(*words)
    assert code == 2 and out == "" and "required: COMMAND" not in err
    assert "commands:" in err and ("data shards" if not words else "  shards") in err
    _, listing, _ = call(*words, "--help")
    assert err == listing


def test_resume_with_another_architecture_names_the_changed_keys(tmp_path):
    """A resume with drafter.num_layers changed is not left to fail in DeepSpeed's state_dict load ("different recipe or
    damaged"): it names the key, both values and the fix; a resume changing only steps, lr or logging goes on."""
    from dstrain.data.shards import synthetic_shards

    shards = tmp_path / "shards"
    synthetic_shards(str(shards), "tiny-moe", 512, 16, seed=0)
    args = [sys.executable, "-m", "dstrain", "train", "tiny_moe", f"data.shards={shards}", "train.warmup_steps=1",
            "train.checkpoint_every=2", "train.micro_batch_size=2", "anchors.per_sequence=8", "eval.every=0",
            f"run.output_dir={tmp_path / 'runs'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}

    def train(*extra):
        return subprocess.run([*args, *extra], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)

    first = train("train.steps=2")
    assert first.returncode == 0, first.stderr[-3000:]
    changed = train("train.steps=4", "drafter.num_layers=3")
    line = changed.stderr.strip().splitlines()[-1]
    assert "Traceback" not in changed.stderr and line.startswith("error: checkpoint "), changed.stderr[-3000:]
    assert changed.returncode == 2 and "drafter.num_layers 2 -> 3" in line and "run.name" in line, changed.stderr[-3000:]
    # keys a resume may change pass (checked in process: a third training run costs ~8 s)
    from dstrain.config.schema import load_recipe
    from dstrain.train.resume_check import check_architecture

    folder = tmp_path / "runs" / "tiny-moe-dspark" / "checkpoints" / "step-2"
    check_architecture(folder, load_recipe("tiny_moe", [f"data.shards={shards}", "train.steps=9", "train.lr=0.001",
                                                        "train.log_every=3", "drafter.ffn.aux_loss_coef=0.2"]))
