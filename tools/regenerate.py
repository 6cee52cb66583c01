#!/usr/bin/env python
"""`dstrain data regenerate` (dstrain/cli/data_regenerate.py), kept under this name so existing commands and scripts keep working."""

from dstrain.cli import tool_main

if __name__ == "__main__":
    tool_main("data_regenerate")
