"""The `dstrain` command: one entry point with subcommands (`dstrain --help` lists them).

Each leaf command is a module here with `parser(prog)` (its arguments) and `run(args) -> int` (its body). The
dispatcher imports only the module of the command being run, and those import torch and transformers inside
run(), so `dstrain --help` and `dstrain COMMAND --help` answer without loading them. dstrain/main.py (the torchrun
entry) calls the train module through tool_main().
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Union

from dstrain import __version__
from dstrain.errors import cli_main
from dstrain.progress import quiet_library_bars_in_logs

# name -> (module under dstrain.cli, one-line help), or a group: name -> {subcommand: ...}
Table = dict[str, Union[tuple[str, str], "Table"]]

COMMANDS: Table = {
    "train": ("train", "train a drafter as a recipe says (torchrun --nproc-per-node N -m dstrain train ... for several processes)"),
    "plan": ("plan", "print a recipe's resolved plan: world layout, sizes, memory per rank (no weights loaded)"),
    "recipes": ("recipes", "list the shipped recipes (usable by name: dstrain plan v4_flash)"),
    "data": {
        "prompts": ("data_prompts", "build a training prompt mix (code, math, chat) from local sources"),
        "regenerate": ("data_regenerate", "answer prompts with the target (local model or OpenAI-compatible endpoint)"),
        "shards": ("data_shards", "tokenize conversations into webdataset shards with a manifest"),
        "synthetic": ("data_synthetic", "token shards for a random target without a tokenizer (tiny_moe)"),
        "pack": ("data_pack", "check, compress and describe a regenerated corpus for shipping"),
        "features": ("data_features", "fill a recipe's feature cache: the target runs once per sample, before training"),
    },
    "upcycle": ("upcycle", "sparse-upcycle a dense Llama-style model into a Mixtral-format MoE target"),
    "export": ("export", "export a trained drafter (dstrain, speculators/vLLM, deepspec/SGLang, sglang-eagle3, deepseek-v4, deepseek-v41 formats)"),
    "eval": ("evaluate", "speculative decoding against the target: accepted length tau per domain, speed"),
    "calibrate": ("calibrate", "Sequential Temperature Scaling of a confidence head on held-out rollouts"),
    "table": ("table", "reproduce the paper's tau table: every drafter family trained and evaluated on one budget"),
    "simulate": ("simulate", "serving simulation: throughput vs per-user speed under each speculation policy"),
    "demo": ("demo", "the default pipeline end to end on a laptop (target, data, training, held-out tau)"),
    "docs": {
        "recipes": ("docs", "print the recipe reference (markdown, generated from the schema)"),
    },
}

DESCRIPTION = ("dstrain: distributed training of speculative-decoding drafters (DSpark, DFlash, Eagle3, MTP-1) "
               "against frozen MoE targets.")


def parse_anywhere(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Options anywhere among the positionals (`dstrain train RECIPE --dry-run a.b=c`): plain parse_args stops the
    overrides list at the first option and calls the rest unrecognised."""
    if "-h" in argv or "--help" in argv:  # intermixed parsing hides positional defaults from the help text
        return ap.parse_args(argv)
    try:
        return ap.parse_intermixed_args(argv)
    except TypeError:  # a parser argparse cannot intermix (REMAINDER): its own order
        return ap.parse_args(argv)


def _listing(table: Table, words: list[str]) -> str:
    lines = ["commands:"]
    for name, entry in table.items():
        if isinstance(entry, dict):
            for sub, (_, text) in entry.items():
                lines.append(f"  {' '.join([name, sub]):<18} {text}")
        else:
            lines.append(f"  {name:<18} {entry[1]}")
    lines.append(f"\n'{' '.join(words)} COMMAND --help' describes a command's arguments.")
    return "\n".join(lines)


def _dispatch(table: Table, words: list[str], argv: list[str]) -> int:
    top = len(words) == 1
    ap = argparse.ArgumentParser(prog=" ".join(words), formatter_class=argparse.RawDescriptionHelpFormatter,
                                 description=DESCRIPTION if top else f"{' '.join(words)} subcommands.",
                                 epilog=_listing(table, words))
    if top:
        ap.add_argument("--version", action="version", version=f"dstrain {__version__}")
    ap.add_argument("command", choices=list(table), metavar="COMMAND", help=", ".join(table))
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the command's own arguments")
    if not argv:  # argparse would say only "required: COMMAND, args"; show what the commands are
        print(ap.format_help(), end="", file=sys.stderr)
        return 2
    ns = ap.parse_args(argv)
    entry = table[ns.command]
    if isinstance(entry, dict):
        return _dispatch(entry, words + [ns.command], ns.args)
    module = importlib.import_module(f"dstrain.cli.{entry[0]}")
    args = parse_anywhere(module.parser(" ".join(words + [ns.command])), ns.args)
    args.invocation = (words + [ns.command], list(ns.args))  # how it was called, for commands that record it
    return module.run(args)


@cli_main
def main(argv: list[str] | None = None) -> int:
    """The console script (`dstrain`), `python -m dstrain` and `torchrun -m dstrain`."""
    return _dispatch(COMMANDS, ["dstrain"], list(sys.argv[1:] if argv is None else argv))


def tool_main(name: str) -> None:
    """dstrain/main.py: the command module `name` with the script's own name in its usage."""
    quiet_library_bars_in_logs()  # before the command module imports transformers
    module = importlib.import_module(f"dstrain.cli.{name}")

    def run() -> int:
        args = parse_anywhere(module.parser(None), sys.argv[1:])
        args.invocation = (["python", sys.argv[0]], sys.argv[1:])
        return module.run(args)

    cli_main(run)()
