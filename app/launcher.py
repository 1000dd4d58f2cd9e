"""The ``glimpse`` command's entry point: imports the CLI (torch, transformers: seconds) under a guard, so that
Ctrl-C while they load ends with one line, as it does once the command runs (``glimpse.cli.main``).

SIGTERM stops every command as Ctrl-C does (``Terminated``, a ``KeyboardInterrupt``): what a command keeps on
Ctrl-C it keeps on SIGTERM (a caption run's finished captions, a benchmark's partial report). Without a handler of
its own a process is killed by SIGTERM, except as process 1 of a container, where the kernel drops a signal that
has no handler: ``docker stop`` waited its 10 s and killed a caption run, or a server still loading its model,
with SIGKILL (an outside pass). ``glimpse serve`` puts in its graceful handler once it serves."""

from __future__ import annotations

import signal
import sys


class Terminated(KeyboardInterrupt):
    """SIGTERM came: the command stops as on Ctrl-C, with exit status 143 (128 + SIGTERM)."""


_terminated = False  # SIGTERM came: a command that caught the stop to keep its partial result still says which


def stop_on_sigterm() -> None:
    def stop(_signum, _frame):
        global _terminated
        _terminated = True
        raise Terminated

    signal.signal(signal.SIGTERM, stop)


def stopped(stop: KeyboardInterrupt) -> int:
    """What a command says and returns when Ctrl-C (130) or SIGTERM (143) stopped it."""
    terminated = isinstance(stop, Terminated)
    print(f"glimpse: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
    return 143 if terminated else 130


def kept_stop_status() -> int:
    """The exit status of a command that caught its stop and printed what it had (``glimpse bench``'s and ``eval``'s
    partial reports): 143 when SIGTERM stopped it, as every other command's, 130 on Ctrl-C."""
    return 143 if _terminated else 130


def main() -> int:
    stop_on_sigterm()
    try:
        from glimpse.cli import main as run
    except KeyboardInterrupt as stop:
        return stopped(stop)
    return run()
