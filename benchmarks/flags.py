"""What every benchmark script checks of its flags before it builds or loads anything: a count that must be at
least 1 (``--runs 0`` ended in a StatisticsError after the model was built), and ``--device`` (``cuda`` on a
machine without one ended in torch's own words). Found by an outside pass; each script says which flags are
counts. Scripts import it from beside them (``python benchmarks/NAME.py`` puts this folder on ``sys.path``)."""

from __future__ import annotations

import argparse


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, counts: tuple[str, ...] = (),
                or_none: tuple[str, ...] = (), device: bool = False) -> None:
    """``parser.error`` (a usage line, exit 2) for a flag in ``counts`` under 1 (each of a list), one in ``or_none``
    under 0 (0 switches that part off), and a ``--device`` this machine cannot compute on."""
    for names, low in ((counts, 1), (or_none, 0)):
        for name in names:
            value = getattr(args, name)
            if any(v < low for v in (value if isinstance(value, list) else [value])):
                parser.error(f"--{name.replace('_', '-')} must be at least {low}, got {value}")
    if device and args.device is not None:
        from glimpse.pipeline.loading import ModelLoadError, resolve_device

        try:
            resolve_device(args.device)
        except ModelLoadError as error:
            parser.error(str(error))
