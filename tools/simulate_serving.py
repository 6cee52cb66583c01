#!/usr/bin/env python
"""`dstrain simulate` (dstrain/cli/simulate.py), kept under this name so existing commands and scripts keep working."""

from dstrain.cli import tool_main

if __name__ == "__main__":
    tool_main("simulate")
