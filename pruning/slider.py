"""The speed/quality slider as the UI and the docs show it.

``speed`` in [0, 1] maps, per policy, to parameters through that policy's ``from_speed`` (a pure
function, monotone: more speed never means more FLOPs). Layer numbers depend on the model's depth,
so the description is for a given number of decoder layers.

    python -m glimpse.pruning.slider --layers 28        # the table in docs/slider.md
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from glimpse.common import Modality
from glimpse.pruning import NAMES, make_policy

SPEEDS = (0.0, 0.25, 0.5, 0.75, 1.0)


def describe(name: str, speed: float, num_layers: int, video: bool = False) -> str:
    """What ``name`` runs at ``speed`` on a model with ``num_layers`` decoder layers, in one line,
    e.g. "DASH rho=0.48 at layer 11"."""
    policy = make_policy(name, speed)
    # A dry plan: the depth and a visual/text split are all the policies' plans look at.
    modality = torch.tensor([Modality.VIDEO if video else Modality.IMAGE] * 8 + [Modality.TEXT] * 8)
    policy.plan(SimpleNamespace(num_layers=num_layers, modality=modality))
    return policy.summary()


def table(num_layers: int, speeds=SPEEDS) -> str:
    """One row per speed, one column per policy. ``auto`` depends on the model's calibration: the
    column shows the uncalibrated default (a calibrated model's choices: ``glimpse calibrate slider``)."""
    names = [n for n in NAMES if n != "none"]
    header = [n if n != "auto" else "auto (uncalibrated default)" for n in names]
    lines = ["| speed | " + " | ".join(header) + " |", "|---" * (len(names) + 1) + "|"]
    for speed in speeds:
        cells = [describe(n, speed, num_layers) for n in names]
        video = describe("zipvl", speed, num_layers, video=True)
        if video != "ZipVL off":
            cells[names.index("zipvl")] += f" (video: tau {video.split('=')[1].split(',')[0]})"
        lines.append(f"| {speed:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=28, help="decoder layers (Qwen2-VL-7B: 28, LLaVA-1.5-7B: 32)")
    args = parser.parse_args()
    print(table(args.layers))


if __name__ == "__main__":
    main()
