"""Train the embedded model's projector and attention adapters on the generated visual task set; the packaged
SmolLM2 and DINOv2 weights stay frozen.

    python -m training.train_projector            # 46.7 min on a 2-core CPU from scratch (run 10; ~85 on a slower day), writes assets/

Three stages:

1. Precompute: every training image (and every sampled clip frame) goes once through DINOv2 with the exact
   function inference uses (`LlavaAdapter.vision_features`: layer -2, CLS dropped, clip frames 2x2 pooled),
   so the frozen encoder costs nothing per step. Features are cached under `training/cache/`.
2. Align (seconds): the projector alone is fitted so that each image token lands on the word embeddings of
   what its cell shows (`align`), so the next stage starts from tokens the language model can read.
3. Train: every question of an item is a single-turn chat with the image or clip (for some items also a
   caption request), rendered with the embedded model's own chat template exactly as `glimpse ask` renders a
   prompt, and its visual tokens get the fixed 2D position code inference adds (`visual_code`,
   `--position-scale`; pipeline/embedded.py) and a learnt map of their cell's mean colour (`ColourInput`,
   `--colour-input`; it is trained in the alignment stage too). An item's chats are packed into one sequence (`pack`: the
   shared prefix with the visual tokens once, then each chat's remainder attending only to the prefix and
   itself), so each answer is trained exactly as in its own chat. Loss is next-token cross-entropy on the
   answers and their `<|im_end|>` only. The projector and rank-8 LoRA adapters on SmolLM2's attention
   projections get gradients; the packaged weights stay frozen. The forward pass runs under bfloat16
   autocast where the CPU multiplies bfloat16 in hardware (`--precision auto`: AVX512-BF16, AMX or Arm's BF16;
   about 1.6x faster there), in float32 elsewhere (on an AVX2-only CPU a bfloat16 step took 12x as long as a
   float32 one); validation, like inference, runs in float32.
   Each step backpropagates its items one at a time at their own lengths (`accumulate_gradient`: the
   padded batch's gradient without its padding), with the language model's attention eager. The LM head is
   applied to answer positions only. The `--steps` steps (default 320, 1.6 passes) take the items in
   passes, each freshly shuffled. A scene's questions cover every object in it (binding an
   attribute to the right object is the hard part; see docs/embedded.md).

With `--hidivdrop-share P` a share P of the items is trained under a HiDivDrop schedule drawn from
`--hidivdrop-speeds` (late injection, the pyramid, the early exit, exactly as the engine runs them; see
training/pruned_forward.py), the rest with every token in every layer, so the model answers both ways.
`--hidivdrop-param NAME=VALUE` sets the schedule's parameters as inference's `--param` does (e.g. no late
injection, no exit and an early, steep pyramid: run 13).
With `--divprune-share P` a share P of the items (drawn after HiDivDrop's share, never both on one item) is
trained seeing only DivPrune's most diverse `keep` of each image's (each clip frame's) vision tokens, `keep`
drawn uniformly from `--divprune-keep LOW,HIGH`: the others are masked from every row, which is what the engine's
dropping computes (tested). Run 14 fine-tuned run 10 so (docs/pruning.md, "Training with DivPrune in the loop").
`--from-assets` fine-tunes the weights in assets/ instead of starting from the seeded projector (the record
keeps theirs under "fine_tuned_from"). Runs 11 and 12 fine-tuned run 10 so; not shipped (docs/pruning.md).

Every `--validate-every` steps the log shows per-category accuracy on a validation split (`tasks.VALIDATION_SEED`,
never the reported held-out seed), scored as greedy decoding would score it (`validate`).

Outputs: `assets/embedded_projector.safetensors` (the projector's state dict), `assets/embedded_adapter.safetensors`
(the LoRA pairs, merged into the checkpoint at conversion), `assets/embedded_colour.safetensors` (the colour map),
`assets/embedded_projector.json` (seed, data recipe, hyper-parameters, the whole training log). The embedded model
picks the files up on its next load (a new cache entry, see pipeline/embedded.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pickle
import platform
import random
import re
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from glimpse.pipeline import embedded, visual_codes
from glimpse.pipeline.adapters import LlavaAdapter
from glimpse import tasks
from glimpse.cli import check_writable_file
from glimpse.common import UserError
from glimpse.pruning import make_policy, parse_params
from training import pruned_forward

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(__file__).resolve().parent / "cache"


def cached_features(cached: Path, compute, say) -> list:
    """The features stored at ``cached``, or ``compute()``'s, then stored there (whole or not at all)."""
    if cached.is_file():
        try:
            features = torch.load(cached)
            say(f"features loaded from {cached}")
            return features
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
            # A cache cut short (a run stopped while writing it, before writes were atomic; a full disk) failed every
            # later run at this load until someone found the file (an outside pass): computed again instead.
            say(f"the feature cache {cached} cannot be read ({str(error).splitlines()[0]}): computing it again")
    say("precomputing DINOv2 features (frozen encoder, once)")
    features = compute()
    cached.parent.mkdir(parents=True, exist_ok=True)
    partial = cached.with_name(cached.name + ".partial")
    torch.save(features, partial)
    os.replace(partial, cached)  # whole or absent, whenever the run stops
    say(f"features cached in {cached}")
    return features


def load_frozen_model():
    """The embedded checkpoint as converted (its projector is replaced by the one being trained)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = embedded.embedded_checkpoint(progress=lambda line: print(line, file=sys.stderr), trained=False)
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    # The language model's attention as explicit matmuls and softmax: with the packed items' block mask, CPU
    # SDPA took ~45% of a bf16 step (its flash kernel, backward mostly). Eager, one item at a time, was 15-25%
    # faster on two profiled batches, 3.4% over run 9's whole run (docs/embedded.md, Decisions). The encoder
    # keeps SDPA, so the precomputed features stay exactly the chat path's.
    model.model.language_model.set_attn_implementation("eager")
    processor = AutoProcessor.from_pretrained(path)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, processor


class LoRALinear(torch.nn.Module):
    """``base(x) + scale * x A^T B^T``: a rank-r update beside a frozen nn.Linear. B starts at zero, so training
    starts from the packaged model exactly."""

    def __init__(self, base: torch.nn.Linear, rank: int, alpha: float, generator: torch.Generator):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        self.lora_A = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=generator) / base.in_features ** 0.5)
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.scale


ADAPTED = ("q_proj", "k_proj", "v_proj", "o_proj")


def reset_projector(projector, config) -> None:
    """Load the seeded initial projector: training always starts there, never from one shipped in assets/."""
    projector.load_state_dict(embedded.initial_projector_state(
        config.vision_config.hidden_size, config.text_config.hidden_size, config.text_config.initializer_range))


def add_adapters(language_model, rank: int, alpha: float, seed: int) -> dict[str, LoRALinear]:
    """Put a LoRALinear around every attention projection; keys as in pipeline.embedded.ADAPTER_FILE."""
    generator = torch.Generator().manual_seed(seed)
    adapters = {}
    for i, layer in enumerate(language_model.layers):
        for name in ADAPTED:
            wrapped = LoRALinear(getattr(layer.self_attn, name), rank, alpha, generator)
            setattr(layer.self_attn, name, wrapped)
            adapters[f"layers.{i}.self_attn.{name}"] = wrapped
    return adapters


def adapter_state(adapters: dict[str, LoRALinear]) -> dict[str, torch.Tensor]:
    """What ships: A and B with the scale folded into B, so that merging is W + B A."""
    state = {}
    for key, module in adapters.items():
        state[f"{key}.lora_A"] = module.lora_A.detach().clone().contiguous()
        state[f"{key}.lora_B"] = (module.lora_B.detach() * module.scale).contiguous()
    return state


def load_adapters(adapters: dict[str, LoRALinear], state: dict[str, torch.Tensor]) -> None:
    """The inverse of `adapter_state`: shipped A and B (scale folded into B) into the wrapped projections."""
    with torch.no_grad():
        for key, module in adapters.items():
            module.lora_A.copy_(state[f"{key}.lora_A"])
            module.lora_B.copy_(state[f"{key}.lora_B"] / module.scale)


def clip_frame_indices(total: int, count: int) -> list[int]:
    # vision.sample_video_uniform's rule: what inference will sample from a clip of `total` frames.
    return np.linspace(0, total - 1, count, dtype=int).tolist()


def item_frames(item: tasks.Item, config) -> tuple[list, int]:
    """The frames inference encodes for the item (its image, or the clip's sampled frames) and the pooling of
    their feature grids (1, or `spatial_pool_stride` for a clip)."""
    if item.is_video:
        return [item.frames[k] for k in clip_frame_indices(len(item.frames), config.video_frames)], \
            config.spatial_pool_stride
    return item.frames[:1], 1


@torch.no_grad()
def precompute(items: list[tasks.Item], adapter: LlavaAdapter, batch: int = 16) -> list[torch.Tensor]:
    """(256, 384) float16 features per item, in item order."""
    config = adapter.config
    out: list[torch.Tensor | None] = [None] * len(items)
    images = [i for i, item in enumerate(items) if not item.is_video]
    clips = [i for i, item in enumerate(items) if item.is_video]
    start = time.perf_counter()
    for group, pool in ((images, 1), (clips, config.spatial_pool_stride)):
        for at in range(0, len(group), batch):
            chunk = group[at: at + batch]
            frames = [frame for i in chunk for frame in item_frames(items[i], config)[0]]
            pixels = adapter.image_processor(images=frames, return_tensors="pt")["pixel_values"]
            features = adapter.vision_features(pixels, pool=pool)
            per_item = features.reshape(len(chunk), -1, features.shape[-1])
            for i, f in zip(chunk, per_item):
                out[i] = f.to(torch.float16)
            done = sum(x is not None for x in out)
            print(f"  features {done}/{len(items)}  {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return out


@torch.no_grad()
def item_colours(item: tasks.Item, adapter: LlavaAdapter) -> torch.Tensor:
    """(visual tokens, 3): the mean processed-pixel colour under each of the item's visual tokens, computed as
    inference computes it (`LlavaAdapter.cell_colours` of the frames `item_frames` names)."""
    frames, pool = item_frames(item, adapter.config)
    pixels = adapter.image_processor(images=frames, return_tensors="pt")["pixel_values"]
    return adapter.cell_colours(pixels, pool).reshape(-1, 3)


def with_colours(items: list[tasks.Item], features: list[torch.Tensor], adapter: LlavaAdapter) -> list[torch.Tensor]:
    """Each item's features with its cells' mean colours appended, (tokens, C + 3): the input of `ColourInput`."""
    return [torch.cat([f, item_colours(item, adapter).to(f.dtype)], dim=-1) for item, f in zip(items, features)]


class ColourInput(torch.nn.Module):
    """The projector beside a learnt map of each visual token's cell colour (`--colour-input`). Its input is a
    feature row with the cell's mean colour appended (`with_colours`): the projector reads the first C values,
    a bias-free 3 -> hidden map (zero at the start) the last 3, and their sum is the token, as
    `LlavaAdapter.encode` adds the shipped map (`visual_colour_map`) to the projected token. Why: DINOv2 keeps
    hue only coarsely (docs/embedded.md, Colour)."""

    def __init__(self, projector: torch.nn.Module, hidden: int):
        super().__init__()
        self.projector = projector
        self.colour_map = torch.nn.Linear(3, hidden, bias=False)
        torch.nn.init.zeros_(self.colour_map.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.projector(x[..., :-3]) + self.colour_map(x[..., -3:])


def inference_projector(adapter: LlavaAdapter) -> torch.nn.Module:
    """What the chat path applies to a feature row, as a training-side module: the checkpoint's projector, beside
    its shipped colour map when it has one (then it takes `with_colours` rows). The position code is separate
    (`visual_code` with `adapter.position_axes`)."""
    projector = adapter.model.model.multi_modal_projector
    if adapter.colour_map is None:
        return projector
    wrapped = ColourInput(projector, adapter.text_config.hidden_size)
    with torch.no_grad():
        wrapped.colour_map.weight.copy_(adapter.colour_map)
    return wrapped


def patch_words(item: tasks.Item, grid: int) -> list[str | None]:
    """What each visual token's cell of an image shows, in words: "red circle", the written word, or None
    (background). Read off the rendered pixels, so a cell counts when the object covers a quarter of it."""
    pixels = np.asarray(item.frames[0])
    cell = pixels.shape[0] // grid
    pixels = pixels[: cell * grid, : cell * grid]
    words: list[str | None] = [None] * (grid * grid)

    def cover(mask: np.ndarray) -> np.ndarray:
        return mask.reshape(grid, cell, grid, cell).mean(axis=(1, 3))

    for thing in item.scene.things:
        mask = (pixels == np.array(tasks.COLOURS[thing.colour], dtype=np.uint8)).all(-1)
        for i, j in np.argwhere(cover(mask) > 0.25):
            words[i * grid + j] = f"{thing.colour} {thing.shape}"
    if item.scene.word:
        for i, j in np.argwhere(cover((pixels < 80).all(-1)) > 0.08):
            words[i * grid + j] = item.scene.word
    return words


def align(projector, items, features, embed_tokens, tokenizer, epochs: int, lr: float, say,
          position_weight: float = 0.0) -> None:
    """Stage 1: fit the projector so that each image token lands on the word embeddings of what it shows
    (the mean embedding of " red circle" on a red circle's cells, of " background" elsewhere, rescaled to
    the vocabulary's mean norm). No language-model pass, so it takes seconds; the LM-loss stage starts from
    tokens the frozen LM can already read as words instead of from noise.

    With `position_weight` w > 0 each target also says where its cell is: w * `visual_codes.position_code` is
    added. Without it the aligned projector keeps little of where a cell is (DINOv2's features carry it,
    the word targets do not); with w = 0.5 the left/right signal at the projector's output is 13x stronger.
    That was run 7 (`--align-position 0.5`): the signal faded during the LM-loss stage and the model still
    answered left/right at chance. The default is w = 0; the shipped run 8 gives the position through the
    fixed code added to every token instead (`--position-scale`, docs/embedded.md#position)."""
    scale = embed_tokens.weight.detach().norm(dim=-1).mean()
    cache: dict[str, torch.Tensor] = {}

    def target(words: str) -> torch.Tensor:
        if words not in cache:
            vector = visual_codes.word_embedding(embed_tokens.weight, tokenizer, words)
            cache[words] = vector * scale / vector.norm()
        return cache[words]

    grid = int(features[0].shape[0] ** 0.5)
    rows = [(i, patch_words(item, grid)) for i, item in enumerate(items) if not item.is_video]
    inputs = torch.stack([features[i] for i, _ in rows]).float()  # (N, tokens, C)
    targets = torch.stack([torch.stack([target(w or "background") for w in words]) for _, words in rows])
    if position_weight:
        axes = visual_codes.position_axes(embed_tokens.weight, tokenizer)
        targets = targets + position_weight * visual_codes.position_code(axes, 1, grid, grid)
    weight = torch.tensor([[1.0 if w else 0.1 for w in words] for _, words in rows])
    optimizer = torch.optim.AdamW(projector.parameters(), lr=lr, weight_decay=0.0)
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))
    for epoch in range(epochs):
        total = 0.0
        for at in range(0, len(rows), 32):
            pick = order[at: at + 32]
            error = (projector(inputs[pick]) - targets[pick]).pow(2).sum(-1)
            loss = (error * weight[pick]).sum() / weight[pick].sum()
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(pick)
        say(f"align epoch {epoch + 1}/{epochs}  squared error {total / len(rows):.4f}")


def shuffled_passes(count: int, length: int, rng: random.Random) -> list[int]:
    """`length` item indices: one pass over range(count) in a fresh random order after another, so that no
    item is seen a second time before every item has been seen once."""
    order: list[int] = []
    while len(order) < length:
        order += rng.sample(range(count), count)
    return order[:length]


def single_turn_chat(item: tasks.Item, question: str, answer: str) -> list[dict]:
    """The item's image or clip and `question` from the user, `answer` from the assistant."""
    media = {"type": "video" if item.is_video else "image"}
    return [{"role": "user", "content": [media, {"type": "text", "text": question}]},
            {"role": "assistant", "content": [{"type": "text", "text": answer}]}]


def visual_code(is_video: bool, config, axes: torch.Tensor | None) -> torch.Tensor | None:
    """The position code inference adds to an image's or a clip's visual tokens (`visual_codes.position_code`; its
    grid as LlavaAdapter lays it out: 16x16 for an image, `video_frames` 8x8 grids for a clip); None without
    `axes`. There are only these two codes: callers compute each once and share it between items."""
    if axes is None:
        return None
    side = embedded.IMAGE_SIZE // embedded.PATCH_SIZE
    if is_video:
        side //= config.spatial_pool_stride
        return visual_codes.position_code(axes, config.video_frames, side, side)
    return visual_codes.position_code(axes, 1, side, side)


def media_token(item: tasks.Item, config) -> int:
    return config.video_token_id if item.is_video else config.image_token_id


def chats(item: tasks.Item, rng: random.Random, caption_share: float) -> list[list[dict]]:
    """One single-turn chat per question of the item (and, for some items, a caption request), each with the
    image or clip, exactly as a user would ask it."""
    turns = [(qa.question, qa.answer) for qa in item.qas]
    if rng.random() < caption_share:
        ask = "Describe the video." if item.is_video else rng.choice(("Describe the image.", "What is in the image?"))
        turns.append((ask, item.caption))
    return [single_turn_chat(item, question, answer) for question, answer in turns]


def features_cache(seed: int, images: int, clips: int, styled: float = 0.0) -> Path:
    """Where the precomputed features of `training_items(seed, images, clips, styled)` are cached (keyed by the data
    and the embedded model's recipe, so a changed encoder conversion never reuses them)."""
    data = [seed, images, clips, embedded.RECIPE] + ([styled] if styled else [])  # plain sets keep their old keys
    recipe = hashlib.sha256(json.dumps(data).encode()).hexdigest()[:12]
    return CACHE / f"features-{recipe}.pt"


def tokenize(messages: list[dict], tokenizer, media_token: int, media_tokens: int) -> tuple[list[int], list[int]]:
    """Token ids (the media placeholder expanded) and labels (-100 except on answers and their <|im_end|>)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    spans, cursor = [], 0
    for m in messages:
        if m["role"] == "assistant":
            answer = m["content"][0]["text"] + "<|im_end|>"
            begin = text.index("<|im_start|>assistant\n" + answer, cursor) + len("<|im_start|>assistant\n")
            spans.append((begin, begin + len(answer)))
            cursor = begin + len(answer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, labels = [], []
    for token, (begin, end) in zip(encoded["input_ids"], encoded["offset_mapping"]):
        if token == media_token:
            ids += [token] * media_tokens
            labels += [-100] * media_tokens
            continue
        ids.append(token)
        labels.append(token if any(b <= begin < e for b, e in spans) else -100)
    return ids, labels


def pack(tokenized: list[tuple[list[int], list[int]]]) -> dict[str, list[int]]:
    """Several single-turn chats about one image as one sequence: their shared prefix (system prompt, user
    header, the visual tokens) once, then each chat's remainder as a segment that sees the prefix and itself
    only, at the positions it would have alone. Every answer is then predicted exactly as in its own chat —
    one image's tokens are computed once for all its questions, and no answer can be read off another."""
    first = tokenized[0][0]
    shared = min(next((k for k, (a, b) in enumerate(zip(first, ids)) if a != b), min(len(first), len(ids)))
                 for ids, _ in tokenized)
    ids, labels = list(first[:shared]), list(tokenized[0][1][:shared])
    positions, segments = list(range(shared)), [0] * shared
    for k, (chat_ids, chat_labels) in enumerate(tokenized, start=1):
        ids += chat_ids[shared:]
        labels += chat_labels[shared:]
        positions += range(shared, len(chat_ids))
        segments += [k] * (len(chat_ids) - shared)
    return {"ids": ids, "labels": labels, "positions": positions, "segments": segments}


def packed_chats(item: tasks.Item, tokenizer, config, media_tokens: int, rng: random.Random,
                 caption_share: float) -> dict[str, list[int]]:
    """The item's training example: its chats (`chats`) tokenized and packed into one sequence."""
    token = media_token(item, config)
    return pack([tokenize(chat, tokenizer, token, media_tokens) for chat in chats(item, rng, caption_share)])


def answer_logits(model, projector, batch: list[dict], features, image_token, video_token, codes=None,
                  schedule: pruned_forward.Schedule | pruned_forward.DivPruneSchedule | None = None):
    """The language model's logits at every position whose next token is an answer token, the answer tokens,
    and the row each belongs to. `codes`: each example's position code (`visual_code`), added to its projected
    tokens as inference adds it; None: no code. `schedule`: run the one example under this HiDivDrop schedule
    (`pruned_forward`), or DivPrune's selection (`DivPruneSchedule`), instead of with every token in every layer."""
    lm = model.model.language_model
    length = max(len(example["ids"]) for example in batch)
    pad = model.config.text_config.pad_token_id or 0
    ids = torch.full((len(batch), length), pad, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    positions = torch.zeros((len(batch), length), dtype=torch.long)
    segments = torch.full((len(batch), length), -1, dtype=torch.long)  # -1: padding
    for row, example in enumerate(batch):
        n = len(example["ids"])
        ids[row, :n] = torch.tensor(example["ids"])
        labels[row, :n] = torch.tensor(example["labels"])
        positions[row, :n] = torch.tensor(example["positions"])
        segments[row, :n] = torch.tensor(example["segments"])
    # token i sees token j when j <= i and j is in the shared prefix (segment 0) or in i's own segment
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    same = (segments[:, :, None] == segments[:, None, :]) | (segments[:, None, :] == 0)
    allowed = causal & same & (segments[:, None, :] >= 0)
    embeds = lm.embed_tokens(ids)
    media = (ids == image_token) | (ids == video_token)
    # the cached features are float16: cast each before stacking (CPU autocast rejects float16 inputs)
    projected = projector(torch.stack([f.float() for f in features]))
    if codes is not None:
        projected = projected + torch.stack(codes)
    embeds = embeds.masked_scatter(media[..., None], projected.reshape(-1, projected.shape[-1]).to(embeds.dtype))
    if isinstance(schedule, pruned_forward.DivPruneSchedule):
        assert len(batch) == 1, "a DivPrune schedule runs one example at a time"
        allowed = pruned_forward.divprune_allowed(allowed[0], embeds[0], media[0], schedule)[None]
    if isinstance(schedule, pruned_forward.Schedule):
        assert len(batch) == 1, "a HiDivDrop schedule runs one example at a time"
        hidden = pruned_forward.pruned_forward(lm, embeds, allowed[0], positions, segments[0], media[0],
                                               pruned_forward.probe_rows(labels[0], segments[0]), schedule)
    else:  # every token, or DivPrune's: one mask for every layer
        mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill(~allowed, torch.finfo(torch.float32).min)
        hidden = lm(inputs_embeds=embeds, attention_mask=mask[:, None], position_ids=positions).last_hidden_state
    # position t predicts token t+1 of its own segment: score only the positions whose next token is an
    # answer token (a segment never starts with one, so no prediction crosses a segment boundary)
    targets = labels[:, 1:]
    scored = targets != -100
    rows = torch.arange(len(batch))[:, None].expand_as(targets)[scored]
    return model.lm_head(hidden[:, :-1][scored]), targets[scored], rows


def batch_loss(model, projector, batch: list[dict], features, image_token, video_token,
               codes=None) -> tuple[torch.Tensor, int]:
    logits, targets, _ = answer_logits(model, projector, batch, features, image_token, video_token, codes)
    return torch.nn.functional.cross_entropy(logits, targets), len(targets)


def answer_tokens(example: dict) -> int:
    # the positions `answer_logits` scores: those whose next token is labelled
    return sum(label != -100 for label in example["labels"][1:])


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (x86 AVX512-BF16 or AMX-BF16, Arm BF16).

    Elsewhere torch converts every operand: on an AVX2-only AMD EPYC a bfloat16-autocast training step of the
    embedded model took 168 s against 14 s in float32, the backward's matrix products 95% of it. Linux's
    /proc/cpuinfo is read; where it is missing (not Linux) the answer is no: float32 is at worst 1.6x slower,
    bfloat16 without the hardware 12x."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return re.search(r"\b(avx512_bf16|amx_bf16|bf16)\b", flags) is not None


def accumulate_gradient(model, projector, batch: list[dict], features, image_token, video_token, codes=None,
                        bf16: bool = True, schedules=None) -> tuple[float, int]:
    """Backpropagate the batch's mean answer-token cross-entropy one example at a time and return it with the
    answer-token count: the gradient of `batch_loss` on the whole batch, without its padding.

    Packed items run from 299 to 661 tokens: padded to its longest, a batch of 8 computes 30% more tokens
    than it holds (over the default run's 320 batches); alone, each example runs at its own length. Each
    example's summed loss is divided by the batch's answer-token count, so the accumulated gradient is the
    batched one (up to rounding, tested). `schedules`: each example's HiDivDrop or DivPrune schedule, or None."""
    count = sum(answer_tokens(example) for example in batch)
    total = 0.0
    for i, example in enumerate(batch):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits, targets, _ = answer_logits(model, projector, [example], [features[i]], image_token, video_token,
                                               None if codes is None else [codes[i]],
                                               None if schedules is None else schedules[i])
            loss = torch.nn.functional.cross_entropy(logits, targets, reduction="sum") / count
        loss.backward()
        total += loss.item()
    return total, count


def question_examples(pairs: list[tuple[tasks.Item, tasks.QA]], adapter: LlavaAdapter, axes=None,
                      colours: bool = False):
    """(category, tokenized single-question chat, features, position code or None) for each held-out style
    (item, question) pair; `axes` as for `visual_code`; `colours`: features with colours (`with_colours`)."""
    codes = {is_video: visual_code(is_video, adapter.config, axes) for is_video in (False, True)}
    items = [item for item, _ in pairs]
    features = precompute(items, adapter)
    if colours:
        features = with_colours(items, features, adapter)
    examples = []
    for (item, qa), f in zip(pairs, features):
        chat = single_turn_chat(item, qa.question, qa.answer)
        tokenized = tokenize(chat, adapter.tokenizer, media_token(item, adapter.config), f.shape[0])
        examples.append((qa.category, pack([tokenized]), f, codes[item.is_video]))
    return examples


@torch.no_grad()
def validate(model, projector, examples: list[tuple[str, dict, torch.Tensor, torch.Tensor | None]], image_token,
             video_token, batch: int = 8) -> dict[str, float]:
    """Accuracy per category on single-question chats: a question counts as right when every answer token
    (and the closing <|im_end|>) is the argmax given the ones before it, i.e. when greedy decoding would
    produce exactly the answer."""
    right: dict[str, list[bool]] = {}
    for at in range(0, len(examples), batch):
        chunk = examples[at: at + batch]
        codes = [c for *_, c in chunk] if chunk[0][3] is not None else None
        logits, targets, rows = answer_logits(model, projector, [e for _, e, _, _ in chunk],
                                              [f for _, _, f, _ in chunk], image_token, video_token, codes)
        hit = logits.argmax(-1) == targets
        for row, (category, *_) in enumerate(chunk):
            right.setdefault(category, []).append(bool(hit[rows == row].all()))
    return {category: sum(hits) / len(hits) for category, hits in right.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=tasks.TRAIN_SEED)
    parser.add_argument("--images", type=int, default=1280)
    parser.add_argument("--clips", type=int, default=320)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--caption-share", type=float, default=0.25)
    parser.add_argument("--align-epochs", type=int, default=4, help="stage 1 epochs (0: skip)")
    parser.add_argument("--align-position", type=float, default=0.0,
                        help="weight of the cell's position in the alignment targets (0: what the cell shows only; "
                             "run 7 used 0.5)")
    parser.add_argument("--position-scale", type=float, default=1.0,
                        help="scale of the fixed 2D position code added to every visual token (pipeline/embedded.py; "
                             "0: none, as in runs 1-7)")
    parser.add_argument("--colour-input", action=argparse.BooleanOptionalAction, default=True,
                        help="also learn a map of each visual token's cell mean colour, added to the token "
                             "(ColourInput; written to --colour-out; on since run 10, --no-colour-input as in runs 1-9)")
    parser.add_argument("--colour-out", default=str(ROOT / "assets" / "embedded_colour.safetensors"))
    parser.add_argument("--adapter-rank", type=int, default=8,
                        help="rank of the LoRA adapters on SmolLM2's q/k/v/o projections (0: projector only)")
    parser.add_argument("--adapter-lr", type=float, default=5e-4)
    parser.add_argument("--adapter-out", default=str(ROOT / "assets" / "embedded_adapter.safetensors"))
    parser.add_argument("--steps", type=int, default=320,
                        help="LM-loss steps (0: one pass over the items); past the last item a new shuffled pass starts")
    parser.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                        help="the training forward pass (bf16: autocast, ~1.6x faster on a CPU with AVX512-BF16, "
                             "12x slower on one with AVX2 only; auto: bf16 where the CPU computes it in hardware, "
                             "else fp32); validation and inference stay float32")
    parser.add_argument("--out", default=str(ROOT / "assets" / "embedded_projector"),
                        help="output path without extension (.safetensors and .json are written)")
    parser.add_argument("--save-every", type=int, default=50, help="also write the projector every N steps")
    parser.add_argument("--validate-every", type=int, default=0,
                        help="log accuracy on the validation split every N steps (0, the default: never; each check "
                             "takes ~25 s and changes no weight)")
    parser.add_argument("--validate-per-category", type=int, default=4)
    parser.add_argument("--from-assets", action="store_true",
                        help="fine-tune: start from the shipped projector, colour map and adapters (assets/) instead of "
                             "the seeded initial projector and zero adapters; skips the alignment stage")
    parser.add_argument("--hidivdrop-share", type=float, default=0.0,
                        help="share of the items trained under a HiDivDrop schedule (late injection, pyramid, early "
                             "exit; training/pruned_forward.py) instead of with every token in every layer")
    parser.add_argument("--hidivdrop-speeds", default="0.5,1",
                        help="the slider range those schedules are drawn from, uniformly: LOW,HIGH")
    parser.add_argument("--hidivdrop-param", action="append", default=[], metavar="NAME=VALUE",
                        help="a HiDivDrop parameter for those schedules, as inference's --param takes it (repeat): "
                             "e.g. inject_fraction=0 exit_fraction=0 filter_layers=[3,6,9,12] keep=[0.35,0.2,0.12,0.08]")
    parser.add_argument("--divprune-share", type=float, default=0.0,
                        help="share of the items trained with only DivPrune's most diverse vision tokens "
                             "(training/pruned_forward.py); drawn after --hidivdrop-share's, never both on one item")
    parser.add_argument("--divprune-keep", default="0.2,0.6",
                        help="the share of vision tokens those items keep, drawn uniformly from LOW,HIGH")
    parser.add_argument("--styled-share", type=float, default=0.0,
                        help="share of the items drawn with a look of other pictures (tasks.stylise: dark, graded, "
                             "textured or striped backgrounds, turned, shadowed or outlined shapes, noise, JPEG); "
                             "its own random stream, so the scenes and questions are those of a plain run")
    args = parser.parse_args(argv)
    if args.precision == "auto":  # resolved here, so that the log and the record say which one ran
        args.precision = "bf16" if native_bf16() else "fp32"
    try:
        keep_low, keep_high = (float(x) for x in args.divprune_keep.split(","))
    except ValueError:
        parser.error(f"--divprune-keep takes LOW,HIGH, got {args.divprune_keep!r}")
    if not 0.0 < keep_low <= keep_high <= 1.0 or not 0.0 <= args.divprune_share <= 1.0 - args.hidivdrop_share:
        parser.error("--divprune-keep needs 0 < LOW <= HIGH <= 1 and --divprune-share a share in [0, 1] that, "
                     "with --hidivdrop-share, sums to at most 1")
    try:
        speed_low, speed_high = (float(x) for x in args.hidivdrop_speeds.split(","))
    except ValueError:
        parser.error(f"--hidivdrop-speeds takes LOW,HIGH, got {args.hidivdrop_speeds!r}")
    if not 0.0 <= speed_low <= speed_high <= 1.0 or not 0.0 <= args.hidivdrop_share <= 1.0:
        parser.error("--hidivdrop-speeds needs 0 <= LOW <= HIGH <= 1 and --hidivdrop-share a share in [0, 1]")
    try:
        hidivdrop_params = parse_params(args.hidivdrop_param)
        make_policy("hidivdrop", speed_high, hidivdrop_params)
    except UserError as error:
        parser.error(f"--hidivdrop-param: {error}")
    if not 0.0 <= args.styled_share <= 1.0:
        parser.error("--styled-share is a share in [0, 1]")
    if args.styled_share and args.align_epochs and not args.from_assets:
        parser.error("--styled-share needs --from-assets or --align-epochs 0: the alignment stage labels cells by "
                     "their exact colours, which styled pictures do not keep")
    if args.from_assets and not all(f.is_file() for f in (embedded.PROJECTOR_FILE, embedded.PROJECTOR_RECORD,
                                                          embedded.ADAPTER_FILE)):
        parser.error("--from-assets needs the trained projector, its record and the adapters in assets/")
    # Before the hour of training, not after it (a missing folder was found only by the save at the end).
    for flag, path in (("--out", f"{args.out}.safetensors"), ("--out", f"{args.out}.json"),
                       ("--adapter-out", args.adapter_out), ("--colour-out", args.colour_out)):
        try:
            check_writable_file(Path(path), flag)
        except UserError as error:
            parser.error(str(error))

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    start = time.perf_counter()
    log: list[str] = []

    def say(line: str) -> None:
        line = f"[{time.perf_counter() - start:7.1f} s] {line}"
        log.append(line)
        print(line, flush=True)

    say(f"generating {args.images} images and {args.clips} clips from seed {args.seed}"
        + (f", {args.styled_share:.0%} of them styled" if args.styled_share else ""))
    items = tasks.training_items(args.seed, args.images, args.clips, args.styled_share)
    model, processor = load_frozen_model()
    adapter = LlavaAdapter(model, processor.tokenizer, processor.image_processor)
    config = model.config

    cached = features_cache(args.seed, args.images, args.clips, args.styled_share)
    features = cached_features(cached, lambda: precompute(items, adapter), say)
    if args.colour_input:
        features = with_colours(items, features, adapter)
        say("cell colours appended to the features")

    axes = visual_codes.position_axes(model.model.language_model.embed_tokens.weight, processor.tokenizer) \
        * args.position_scale if args.position_scale else None
    validation = []
    if args.validate_every:
        validation = question_examples(tasks.heldout_set(tasks.VALIDATION_SEED, args.validate_per_category), adapter,
                                       axes, colours=args.colour_input)
        say(f"validation split: seed {tasks.VALIDATION_SEED}, {len(validation)} questions")

    def check(step: int) -> None:
        accuracy = validate(model, projector, validation, config.image_token_id, config.video_token_id)
        overall = sum(accuracy.values()) / len(accuracy)
        say(f"validation after step {step}: {overall:.0%}  " + " ".join(f"{c} {a:.0%}" for c, a in accuracy.items()))

    media_tokens = features[0].shape[0]
    codes = {is_video: visual_code(is_video, config, axes) for is_video in (False, True)}
    examples = []
    for item, f in zip(items, features):
        examples.append((packed_chats(item, processor.tokenizer, config, media_tokens, rng, args.caption_share), f,
                         codes[item.is_video]))
    mean_len = sum(len(e[0]["ids"]) for e in examples) / len(examples)
    say(f"{len(examples)} conversations, {mean_len:.0f} tokens on average")

    llava_projector = model.model.multi_modal_projector
    parent = None  # the shipped weights' own record, when this run fine-tunes them
    if args.from_assets:
        parent = json.loads(embedded.PROJECTOR_RECORD.read_text())
        llava_projector.load_state_dict(load_file(embedded.PROJECTOR_FILE))
        args.align_epochs = 0  # the shipped projector is aligned and trained already
        say(f"fine-tuning from {embedded.PROJECTOR_FILE.name}, {embedded.ADAPTER_FILE.name}, {embedded.COLOUR_FILE.name}")
    else:
        reset_projector(llava_projector, config)
    for p in llava_projector.parameters():
        p.requires_grad_(True)
    # what maps a feature row to a visual token: the projector, or the projector beside the colour map
    projector = ColourInput(llava_projector, config.text_config.hidden_size) if args.colour_input else llava_projector
    if args.from_assets and args.colour_input:
        with torch.no_grad():
            projector.colour_map.weight.copy_(load_file(embedded.COLOUR_FILE)["weight"])
    if args.align_epochs:
        align(projector, items, features, model.model.language_model.embed_tokens, processor.tokenizer,
              args.align_epochs, args.lr, say, position_weight=args.align_position)
    adapters = add_adapters(model.model.language_model, args.adapter_rank, 2.0 * args.adapter_rank, args.seed) \
        if args.adapter_rank else {}
    if args.from_assets and adapters:
        load_adapters(adapters, load_file(embedded.ADAPTER_FILE))
    groups = [{"params": list(projector.parameters()), "lr": args.lr}]
    if adapters:
        groups.append({"params": [p for m in adapters.values() for p in (m.lora_A, m.lora_B)], "lr": args.adapter_lr})
    optimizer = torch.optim.AdamW(groups, weight_decay=0.0)
    steps = args.steps or math.ceil(len(examples) / args.batch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))

    def save(path_stem: Path, final: bool) -> None:
        # Every file is written under a temporary name first and renamed into place once all are written: a run
        # stopped (or failing) while it saves leaves the set it had, not a new projector beside older adapters.
        staged: list[tuple[Path, Path]] = []

        def stage(path) -> str:
            staged.append((Path(f"{path}.partial"), Path(path)))
            return str(staged[-1][0])

        state = {k: v.detach().clone().contiguous() for k, v in llava_projector.state_dict().items()}
        save_file(state, stage(f"{path_stem}.safetensors"), metadata={"format": "pt"})
        if args.colour_input:
            save_file({"weight": projector.colour_map.weight.detach().clone().contiguous()}, stage(args.colour_out),
                      metadata={"format": "pt"})
        if adapters:
            save_file(adapter_state(adapters), stage(args.adapter_out), metadata={"format": "pt"})
        record = {
            "what": "projector of Glimpse's embedded model (SmolLM2-135M-Instruct + DINOv2-S/14), LLaVA 2-layer MLP",
            "seed": args.seed, "images": args.images, "clips": args.clips, "batch": args.batch, "lr": args.lr,
            "warmup": args.warmup, "schedule": "linear warm-up, cosine to 10%", "optimizer": "AdamW, no weight decay",
            "caption_share": args.caption_share, "align_epochs": args.align_epochs,
            "align_position": args.align_position, "position_scale": args.position_scale,
            "colour_input": args.colour_input,
            "init": "the shipped assets (fine-tune)" if args.from_assets else "seeded initial projector, zero adapters",
            "hidivdrop_share": args.hidivdrop_share, "hidivdrop_speeds": [speed_low, speed_high],
            "hidivdrop_params": hidivdrop_params,
            "divprune_share": args.divprune_share, "divprune_keep": [keep_low, keep_high],
            "styled_share": args.styled_share,
            "adapter_rank": args.adapter_rank, "adapter_alpha": 2.0 * args.adapter_rank, "adapter_lr": args.adapter_lr,
            "adapted": [f"layers.*.self_attn.{n}" for n in ADAPTED] if adapters else [], "steps": steps,
            "passes": round(steps * args.batch / len(examples), 2), "precision": args.precision,
            "embedded_recipe": embedded.RECIPE,
            "data": "app/tasks.py: training_items(seed, images, clips, styled), every object of a scene asked about; "
                    "every question a single-turn chat, packed per item",
            "validation": f"heldout_set({tasks.VALIDATION_SEED}, {args.validate_per_category}) every {args.validate_every} steps"
                          if args.validate_every else "none during training (--validate-every 0)",
            "command": "python -m training.train_projector " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__, "complete": final, "log": log,
        }
        if parent is not None:
            record["fine_tuned_from"] = parent  # what this run started from, and how that was trained
        Path(stage(f"{path_stem}.json")).write_text(json.dumps(record, indent=1) + "\n")
        for partial, path in staged:
            os.replace(partial, path)
        if not args.colour_input:
            Path(args.colour_out).unlink(missing_ok=True)  # nor beside an older colour map
        if not adapters:
            Path(args.adapter_out).unlink(missing_ok=True)  # a projector-only run must not ship beside older adapters

    trained = sum(p.numel() for g in groups for p in g["params"])
    say(f"training {trained} parameters (projector and adapters), {steps} steps of {args.batch}, "
        f"forward in {args.precision}")
    order = shuffled_passes(len(examples), steps * args.batch, rng)
    pruning = random.Random(args.seed + 1)  # its own stream: the item order stays that of a run without it
    num_layers = config.text_config.num_hidden_layers

    def pruning_schedule(example) -> pruned_forward.Schedule | pruned_forward.DivPruneSchedule | None:
        draw = pruning.random()
        if draw < args.hidivdrop_share:
            return pruned_forward.hidivdrop_schedule(pruning.uniform(speed_low, speed_high), num_layers, media_tokens,
                                                     hidivdrop_params)
        if draw < args.hidivdrop_share + args.divprune_share:
            frames = config.video_frames if config.video_token_id in example["ids"] else 1  # a clip: its frames
            return pruned_forward.DivPruneSchedule(pruning.uniform(keep_low, keep_high), frames)
        return None

    running = None
    for step in range(steps):
        chunk = [examples[i] for i in order[step * args.batch: (step + 1) * args.batch]]
        loss, count = accumulate_gradient(model, projector, [e for e, _, _ in chunk], [f for _, f, _ in chunk],
                                          config.image_token_id, config.video_token_id,
                                          [c for *_, c in chunk] if axes is not None else None,
                                          bf16=args.precision == "bf16",
                                          schedules=[pruning_schedule(e) for e, _, _ in chunk]
                                          if args.hidivdrop_share or args.divprune_share else None)
        torch.nn.utils.clip_grad_norm_([p for g in groups for p in g["params"]], 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss if running is None else 0.9 * running + 0.1 * loss
        if step % 5 == 0 or step == steps - 1:
            say(f"step {step + 1}/{steps}  loss {loss:.3f}  (smoothed {running:.3f})  "
                f"lr {schedule.get_last_lr()[0]:.2e}  answer tokens {count}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < steps:
            save(Path(args.out), final=False)
        if validation and ((step + 1) % args.validate_every == 0 or step == steps - 1):
            check(step + 1)
    say("done")
    save(Path(args.out), final=True)
    print(f"wrote {args.out}.safetensors and {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
