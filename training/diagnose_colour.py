"""Why the embedded model confuses red, orange and yellow: how much of an object's colour the packaged
DINOv2-S encoder keeps, measured with linear probes (docs/embedded.md, "Colour").

    python -m training.diagnose_colour            # about 1 min on a 2-core CPU

Scenes are drawn from their own seed (never the training seed 0 nor the held-out seeds 1-5). Every visual
token whose cell an object covers by a quarter or more is labelled with that object's colour; a linear
probe (multinomial logistic regression, L-BFGS) is fitted on the cells of the first 300 scenes and scored on
the cells of the last 100, on four inputs:

1. the encoder's patch features (what the projector sees),
2. the trained projector's output, and with the shipped colour input added (what the language model sees,
   before the position code; run 10 on),
3. the cell's mean RGB alone,
4. the patch features with the mean RGB beside them.

DINOv2 was pretrained with colour jitter (hue shifted by up to 0.1 of the colour circle, 36 degrees, on 80%
of the crops) so that its features ignore small hue shifts; red, orange and yellow here are 27 and 22 degrees
apart. The probes show how much of the hue that costs, and whether the pixels' own colour gives it back.
"""

from __future__ import annotations

import argparse
import collections

import numpy as np
import torch

from glimpse.pipeline import load_engine
from glimpse import tasks
from training.train_projector import inference_projector, item_colours, patch_words, precompute

GRID = 16
PROBE_SEED = 100


def labelled_cells(items: list[tasks.Item], features: list[torch.Tensor]):
    """Per labelled cell: encoder feature (with whatever columns `features` has), mean RGB (0-1), colour index,
    and the scene it comes from."""
    names = list(tasks.COLOURS)
    feats, rgb, colour, scene = [], [], [], []
    for n, (item, f) in enumerate(zip(items, features)):
        pixels = np.asarray(item.frames[0], dtype=np.float32) / 255
        cell = pixels.shape[0] // GRID
        means = pixels[: cell * GRID, : cell * GRID].reshape(GRID, cell, GRID, cell, 3).mean((1, 3)).reshape(-1, 3)
        for k, words in enumerate(patch_words(item, GRID)):
            if words and words.split()[0] in names and len(words.split()) == 2:  # an object, not the written word
                feats.append(f[k].float())
                rgb.append(torch.from_numpy(means[k]))
                colour.append(names.index(words.split()[0]))
                scene.append(n)
    return torch.stack(feats), torch.stack(rgb), torch.tensor(colour), torch.tensor(scene)


def probe(inputs: torch.Tensor, labels: torch.Tensor, train: torch.Tensor, classes: int):
    """Fit on `train`, score on the rest: accuracy and the (true, predicted) pairs of the misses."""
    mean, std = inputs[train].mean(0), inputs[train].std(0) + 1e-6
    z = (inputs - mean) / std
    weight = torch.zeros(z.shape[1], classes, requires_grad=True)
    bias = torch.zeros(classes, requires_grad=True)
    optimiser = torch.optim.LBFGS([weight, bias], max_iter=300)

    def closure():
        optimiser.zero_grad()
        loss = torch.nn.functional.cross_entropy(z[train] @ weight + bias, labels[train]) + 1e-3 * weight.pow(2).sum()
        loss.backward()
        return loss

    optimiser.step(closure)
    with torch.no_grad():
        predicted = (z[~train] @ weight + bias).argmax(-1)
    truth = labels[~train]
    misses = collections.Counter(zip(truth[predicted != truth].tolist(), predicted[predicted != truth].tolist()))
    return (predicted == truth).float().mean().item(), misses


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenes", type=int, default=400, help="scenes drawn; the last quarter is the probe's test set")
    args = parser.parse_args(argv)
    adapter = load_engine("embedded", device="cpu").adapter
    items = tasks.training_items(PROBE_SEED, args.scenes, 0)
    # each cell's processed-pixel mean colour rides along as 3 more columns (the colour input's input)
    features = [torch.cat([f.float(), item_colours(item, adapter)], -1)
                for item, f in zip(items, precompute(items, adapter))]
    cells, rgb, colour, scene = labelled_cells(items, features)
    feats = cells[:, :-3]
    train = scene < args.scenes * 3 // 4
    with torch.no_grad():
        probes = [("encoder features", feats), ("projected tokens", adapter.model.model.multi_modal_projector(feats))]
        if adapter.colour_map is not None:
            probes.append(("projected + colour input", inference_projector(adapter)(cells)))
    probes += [("cell mean RGB", rgb), ("encoder features + mean RGB", torch.cat([feats, rgb], 1))]
    names = list(tasks.COLOURS)
    print(f"{int(train.sum())} training cells, {int((~train).sum())} test cells")
    for label, inputs in probes:
        accuracy, misses = probe(inputs, colour, train, len(names))
        worst = ", ".join(f"{names[t]}->{names[p]} {n}" for (t, p), n in misses.most_common(4))
        print(f"{label:30s} {accuracy:6.1%}  misses {sum(misses.values()):4d}: {worst}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
