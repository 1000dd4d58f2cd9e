"""Trial behind docs/embedded.md, "Colour": does a per-token colour input help run 9's weights tell red,
orange and yellow apart? Run on run 9 (shipped then, without a colour input); run 10, trained from scratch with
the colour input (`train_projector --colour-input`), replaced it, and this script refuses weights that have one.

    python -m training.trial_colour_input control 40   # ~8 min + ~4 min scoring on a 2-core CPU
    python -m training.trial_colour_input colour 40
    python -m training.trial_colour_input control 0    # score the shipped weights as they are

Both arms fine-tune the shipped projector (run 9, adapters merged) for N steps of 8 on the training items
(seed 0; their features must be cached by a `train_projector` run), projector at lr 1e-4. The `colour` arm
also learns a 3 -> 576 map, zero at the start, from each visual token's cell mean colour (the processed pixels
average-pooled over its 14x14 patch, 28x28 for a pooled clip cell) added to the token beside the position
code. Scored with `train_projector.validate` (greedy-exact by teacher forcing): 50 colour questions of held-out
seeds 2 and 5, and 4 per category of seed 2.
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoProcessor, LlavaForConditionalGeneration

from glimpse.pipeline import embedded
from glimpse.pipeline.adapters import LlavaAdapter
from glimpse import tasks
from training import train_projector as tp

BATCH = 8


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("arm", choices=("control", "colour"))
    parser.add_argument("steps", type=int, help="fine-tuning steps of 8 (0: score the shipped weights)")
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    rng = random.Random(0)
    path = embedded.embedded_checkpoint(trained=True)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    model.model.language_model.set_attn_implementation("eager")  # as in training (train_projector says why)
    processor = AutoProcessor.from_pretrained(path)
    for p in model.parameters():
        p.requires_grad_(False)
    adapter = LlavaAdapter(model, processor.tokenizer, processor.image_processor)
    if adapter.colour_map is not None:
        raise SystemExit("this trial starts from weights without a colour input (run 9); the shipped ones have one. "
                         "Put run 9's in place first: git checkout ae2c6b1 -- assets/embedded_projector.safetensors "
                         "assets/embedded_adapter.safetensors assets/embedded_projector.json && "
                         "rm assets/embedded_colour.safetensors (git checkout HEAD -- assets/ restores the shipped ones)")
    config = model.config
    projector = model.model.multi_modal_projector
    colour_map = torch.nn.Linear(3, config.text_config.hidden_size, bias=False)
    torch.nn.init.zeros_(colour_map.weight)

    def code(item: tasks.Item, position: torch.Tensor | None) -> torch.Tensor | None:
        """What is added to the item's projected tokens: the position code, plus the colour map in that arm."""
        if args.arm == "control":
            return position
        colour = colour_map(tp.item_colours(item, adapter))
        return colour if position is None else position + colour

    def score(tag: str) -> None:
        for seed in (2, 5):
            pairs = tasks.heldout_set(seed, 50, ("colour",)) + (tasks.heldout_set(seed, 4) if seed == 2 else [])
            examples = [(category, example, f, code(item, position)) for (item, _), (category, example, f, position)
                        in zip(pairs, tp.question_examples(pairs, adapter, adapter.position_axes))]
            with torch.no_grad():
                accuracy = tp.validate(model, projector, examples, config.image_token_id, config.video_token_id)
            asked = {c: sum(qa.category == c for _, qa in pairs) for c in accuracy}
            print(tag, args.arm, f"seed {seed}:",
                  " ".join(f"{c} {round(a * asked[c])}/{asked[c]}" for c, a in accuracy.items()), flush=True)

    if args.steps == 0:
        score("shipped")
        return 0
    items = tasks.training_items(tasks.TRAIN_SEED, 1280, 320)  # train_projector's defaults
    features = torch.load(tp.features_cache(tasks.TRAIN_SEED, 1280, 320))
    positions = {is_video: tp.visual_code(is_video, config, adapter.position_axes) for is_video in (False, True)}
    examples = [(tp.packed_chats(item, processor.tokenizer, config, f.shape[0], rng, 0.25), f, item)
                for item, f in zip(items, features)]
    for p in projector.parameters():
        p.requires_grad_(True)
    groups = [{"params": list(projector.parameters()), "lr": 1e-4}]
    if args.arm == "colour":
        groups.append({"params": list(colour_map.parameters()), "lr": 1e-2})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    order = tp.shuffled_passes(len(examples), args.steps * BATCH, rng)
    start = time.perf_counter()
    for step in range(args.steps):
        chunk = [examples[i] for i in order[step * BATCH: (step + 1) * BATCH]]
        optimizer.zero_grad()
        loss, _ = tp.accumulate_gradient(model, projector, [e for e, _, _ in chunk], [f for _, f, _ in chunk],
                                         config.image_token_id, config.video_token_id,
                                         [code(item, positions[item.is_video]) for *_, item in chunk],
                                         bf16=tp.native_bf16())  # as train_projector's --precision auto
        optimizer.step()
        if step % 5 == 0:
            print(f"step {step} loss {loss:.3f} colour-map norm {colour_map.weight.norm():.3f} "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    score("after")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
