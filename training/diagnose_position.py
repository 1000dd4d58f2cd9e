"""Where the embedded model reads an object's position from: two measurements behind docs/embedded.md's
account of why runs 1-7 answered top/bottom and not left/right (run 8 adds the position code to every
token's content, and the code moves with its token when the grid is transposed).

    python -m training.diagnose_position            # about 6 min on a 2-core CPU

1. Answers on one-object scenes (so the question names the only thing there), asked "at the top or the
   bottom?" and "on the left or the right?", first with the 256 visual tokens in their row-major order, then
   with the grid transposed (token (row, column) sent to slot (column, row); every token's content is
   unchanged). A model that reads the row from the tokens' content answers top/bottom the same both ways; one
   that reads it from where the tokens sit in the sequence falls to chance.
2. A linear probe on the language model's hidden state at the position that predicts the answer, layer by
   layer: from which layer on does that position know the object's side?
"""

from __future__ import annotations

import argparse
import random

import torch

from glimpse.pipeline import load_engine
from glimpse.pipeline.visual_codes import position_code
from glimpse import tasks
from training.train_projector import (inference_projector, item_colours, precompute, single_turn_chat,
                                      tokenize)

GRID = 16


def one_object_scenes(seed: int, count: int) -> list[tuple[tasks.Item, tasks.Thing]]:
    rng = random.Random(seed)
    scenes = [tasks.sample_scene(rng, count=1) for _ in range(count)]
    return [(tasks.Item([tasks.render(s)], [], "", s), s.things[0]) for s in scenes]


def transposed(tokens: torch.Tensor) -> torch.Tensor:
    """(256, hidden) row-major grid tokens -> the same tokens in column-major order."""
    return tokens.reshape(GRID, GRID, -1).transpose(0, 1).reshape(GRID * GRID, -1)


def visual_tokens(adapter, item: tasks.Item, features: torch.Tensor) -> torch.Tensor:
    """(256, hidden): the tokens the chat path makes of the item's picture (``LlavaAdapter.encode``): the projected
    features, plus the shipped colour input where the weights have one, plus the position code. (The colour input
    was left out until an outside pass measured it: the tokens differed from inference's by 14% of their size.)"""
    rows = features.float()
    if adapter.colour_map is not None:  # `inference_projector` then takes the cells' colours as 3 more columns
        rows = torch.cat([rows, item_colours(item, adapter)], -1)
    tokens = inference_projector(adapter)(rows)
    if adapter.position_axes is not None:
        tokens = tokens + position_code(adapter.position_axes, 1, GRID, GRID)
    return tokens


@torch.no_grad()
def answer_states(adapter, item: tasks.Item, features: torch.Tensor, question: str,
                  transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states of every layer at the position that predicts the answer's first token (layers + 1, hidden),
    and the logits there."""
    model = adapter.model
    ids, _ = tokenize(single_turn_chat(item, question, "Left."), adapter.tokenizer, adapter.image_token_id,
                      features.shape[0])
    ids = torch.tensor(ids)[None]
    answer = len(adapter.tokenizer("Left.<|im_end|>\n", add_special_tokens=False)["input_ids"])
    at = ids.shape[1] - answer - 1
    tokens = visual_tokens(adapter, item, features)  # the code and colour belong to their cell: a transposed grid
    embeds = model.model.language_model.embed_tokens(ids)
    embeds[ids == adapter.image_token_id] = transposed(tokens) if transpose else tokens
    out = model.model.language_model(inputs_embeds=embeds, output_hidden_states=True)
    states = torch.stack([h[0, at] for h in out.hidden_states])
    return states, model.lm_head(out.last_hidden_state[0, at])


def probe_accuracy(x: torch.Tensor, y: torch.Tensor, train_share: float = 0.7) -> float:
    """Held-out accuracy of a logistic-regression probe (standardised inputs, L2 1e-2, 300 Adam steps)."""
    train = torch.arange(len(y)) < int(train_share * len(y))
    x = (x - x[train].mean(0)) / (x[train].std(0) + 1e-5)
    w = torch.zeros(x.shape[1], 2, requires_grad=True)
    b = torch.zeros(2, requires_grad=True)
    optimizer = torch.optim.Adam([w, b], lr=0.05)
    for _ in range(300):
        loss = torch.nn.functional.cross_entropy(x[train] @ w + b, y[train]) + 1e-2 * (w ** 2).sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return ((x[~train] @ w + b).argmax(1) == y[~train]).float().mean().item()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=11, help="scene draw (0 and 2 are training and validation)")
    parser.add_argument("--scenes", type=int, default=160)
    args = parser.parse_args(argv)

    adapter = load_engine("embedded", device="cpu").adapter
    scenes = one_object_scenes(args.seed, args.scenes)
    features = precompute([item for item, _ in scenes], adapter)
    words = {w: adapter.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in ("Top", "Bottom", "Left", "Right")}

    right = {(axis, t): 0 for axis in ("top/bottom", "left/right") for t in (False, True)}
    states, sides = [], []
    for (item, thing), f in zip(scenes, features):
        vertical, horizontal = thing.quadrant.split()
        for transpose in (False, True):
            for axis, question, options, truth in (
                    ("top/bottom", f"Is the {thing.name} at the top or the bottom?", ("Top", "Bottom"), vertical),
                    ("left/right", f"Is the {thing.name} on the left or the right?", ("Left", "Right"), horizontal)):
                hidden, logits = answer_states(adapter, item, f, question, transpose)
                said = max(options, key=lambda w: logits[words[w]].item())
                right[(axis, transpose)] += said.lower() == truth
                if axis == "left/right" and not transpose:
                    states.append(hidden)
                    sides.append((int(horizontal == "right"), int(vertical == "bottom")))
    n = len(scenes)
    print(f"{n} one-object scenes (seed {args.seed}); the answer is the likelier of the two options")
    for (axis, transpose), hits in right.items():
        print(f"  {axis:10s} {'transposed grid' if transpose else 'row-major grid '}  {hits}/{n} right")
    states = torch.stack(states).float()
    y = torch.tensor(sides)
    print("probe on the hidden state that predicts the answer to the left/right question (held-out 30%):")
    for layer in range(0, states.shape[1], 3):
        print(f"  layer {layer:2d}  left/right {probe_accuracy(states[:, layer], y[:, 0]):.0%}  "
              f"top/bottom {probe_accuracy(states[:, layer], y[:, 1]):.0%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
