"""The ``glimpse`` command's entry point: imports the CLI (torch, transformers: seconds) under a guard, so that
Ctrl-C while they load ends with one line, as it does once the command runs (``glimpse.cli.main``)."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from glimpse.cli import main as run
    except KeyboardInterrupt:
        print("glimpse: interrupted", file=sys.stderr)
        return 130
    return run()
