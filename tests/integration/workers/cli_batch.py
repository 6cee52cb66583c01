"""Several dstrain commands in one process (no interpreter and import start-up per command):

    python tests/integration/workers/cli_batch.py '[["export", "RUN", "OUT", "--format", "speculators"], ["eval", ...]]'

Each list is what follows `dstrain` on a command line; the first that fails ends the batch with its exit status.
"""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from dstrain.cli import COMMANDS, _dispatch  # noqa: E402
from dstrain.errors import cli_main  # noqa: E402


@cli_main
def main() -> int:
    for argv in json.loads(sys.argv[1]):
        print(f"cli_batch: dstrain {' '.join(argv)}", flush=True)
        rc = _dispatch(COMMANDS, ["dstrain"], list(argv))
        if rc:
            return rc
    return 0


main()
