"""torchrun worker: several trainings in one launch (one world, groups rebuilt per run), so a test can
compare ZeRO stages or backends without paying the multi-process start-up once per configuration.

    torchrun --nproc-per-node N tests/integration/workers/run_recipes.py RECIPE '[["a=b", ...], ["a=c", ...]]'

An entry may also be {"recipe": OTHER, "overrides": [...]}: a run of another recipe in the same launch.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from dstrain.main import train  # noqa: E402
from dstrain.config.schema import load_recipe  # noqa: E402

import faulthandler  # noqa: E402

if os.environ.get("DUMP_AFTER_S"):  # debugging a hang: every rank prints its stacks
    faulthandler.dump_traceback_later(int(os.environ["DUMP_AFTER_S"]), exit=False)
recipe_path, runs = sys.argv[1], json.loads(sys.argv[2])
for entry in runs:
    if isinstance(entry, dict):
        train(load_recipe(entry["recipe"], entry["overrides"]))
    else:
        train(load_recipe(recipe_path, entry))
