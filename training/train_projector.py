"""Train the embedded model's projector on the generated visual task set, with SmolLM2 and DINOv2 frozen.

    python -m training.train_projector            # ~50 min on a 2-core CPU, writes assets/embedded_projector.*

Two stages, as LLaVA's projector pre-training:

1. Precompute: every training image (and every sampled clip frame) goes once through DINOv2 with the exact
   function inference uses (`LlavaAdapter.vision_features`: layer -2, CLS dropped, clip frames 2x2 pooled),
   so the frozen encoder costs nothing per step. Features are cached under `training/cache/`.
2. Train: each item is one chat — the image or clip in the first user turn, then all of its questions as
   turns (a caption request among them for some items), rendered with the embedded model's own chat template
   exactly as `glimpse ask` renders a prompt. Loss is next-token cross-entropy on the assistant answers and
   their `<|im_end|>` only. Only the projector (LLaVA's two-layer GELU MLP, 0.55M parameters) gets gradients;
   the language model runs frozen in float32, as at inference, and the LM head is applied to answer
   positions only.

Outputs: `assets/embedded_projector.safetensors` (the projector's state dict), `assets/embedded_projector.json`
(seed, data recipe, hyper-parameters, the whole training log). The embedded model picks the file up on its next
load (a new cache entry, see pipeline/embedded.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pipeline import embedded
from pipeline.adapters import LlavaAdapter
from training import tasks

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(__file__).resolve().parent / "cache"


def load_frozen_model():
    """The embedded checkpoint as converted (its projector is replaced by the one being trained)."""
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    path = embedded.embedded_checkpoint(progress=lambda line: print(line, file=sys.stderr))
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, processor


def clip_frame_indices(total: int, count: int) -> list[int]:
    # vision.sample_video_uniform's rule: what inference will sample from a clip of `total` frames.
    return np.linspace(0, total - 1, count, dtype=int).tolist()


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
            frames = []
            for i in chunk:
                item = items[i]
                picks = clip_frame_indices(len(item.frames), config.video_frames) if item.is_video else [0]
                frames += [item.frames[k] for k in picks]
            pixels = adapter.image_processor(images=frames, return_tensors="pt")["pixel_values"]
            features = adapter.vision_features(pixels, pool=pool)
            per_item = features.reshape(len(chunk), -1, features.shape[-1])
            for i, f in zip(chunk, per_item):
                out[i] = f.to(torch.float16)
            done = sum(x is not None for x in out)
            print(f"  features {done}/{len(items)}  {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def conversation(item: tasks.Item, rng: random.Random, caption_share: float) -> list[dict]:
    turns = [(qa.question, qa.answer) for qa in item.qas]
    if rng.random() < caption_share:
        ask = "Describe the video." if item.is_video else rng.choice(("Describe the image.", "What is in the image?"))
        turns.insert(rng.randrange(len(turns) + 1), (ask, item.caption))
    messages = []
    for k, (question, answer) in enumerate(turns):
        content = [{"type": "text", "text": question}]
        if k == 0:
            content.insert(0, {"type": "video" if item.is_video else "image"})
        messages.append({"role": "user", "content": content})
        messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
    return messages


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


def batch_loss(model, projector, batch, features, image_token, video_token) -> tuple[torch.Tensor, int]:
    lm = model.model.language_model
    length = max(len(ids) for ids, _ in batch)
    pad = model.config.text_config.pad_token_id or 0
    ids = torch.full((len(batch), length), pad, dtype=torch.long)
    labels = torch.full((len(batch), length), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), length), dtype=torch.long)
    for row, (seq, lab) in enumerate(batch):
        ids[row, : len(seq)] = torch.tensor(seq)
        labels[row, : len(lab)] = torch.tensor(lab)
        mask[row, : len(seq)] = 1
    embeds = lm.embed_tokens(ids)
    media = (ids == image_token) | (ids == video_token)
    projected = projector(torch.stack(features).float())
    embeds = embeds.masked_scatter(media[..., None], projected.reshape(-1, projected.shape[-1]))
    hidden = lm(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
    # position t predicts token t+1: score only the positions whose next token is an answer token
    targets = labels[:, 1:]
    picked = hidden[:, :-1][targets != -100]
    logits = model.lm_head(picked)
    loss = torch.nn.functional.cross_entropy(logits, targets[targets != -100])
    return loss, int((targets != -100).sum())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=tasks.TRAIN_SEED)
    parser.add_argument("--images", type=int, default=1700)
    parser.add_argument("--clips", type=int, default=400)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--caption-share", type=float, default=0.25)
    parser.add_argument("--out", default=str(ROOT / "assets" / "embedded_projector"),
                        help="output path without extension (.safetensors and .json are written)")
    parser.add_argument("--save-every", type=int, default=50, help="also write the projector every N steps")
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    start = time.perf_counter()
    log: list[str] = []

    def say(line: str) -> None:
        line = f"[{time.perf_counter() - start:7.1f} s] {line}"
        log.append(line)
        print(line, flush=True)

    say(f"generating {args.images} images and {args.clips} clips from seed {args.seed}")
    items = tasks.training_items(args.seed, args.images, args.clips)
    model, processor = load_frozen_model()
    adapter = LlavaAdapter(model, processor.tokenizer, processor.image_processor)
    config = model.config

    recipe = hashlib.sha256(json.dumps([args.seed, args.images, args.clips, embedded.RECIPE]).encode()).hexdigest()[:12]
    cached = CACHE / f"features-{recipe}.pt"
    if cached.is_file():
        features = torch.load(cached)
        say(f"features loaded from {cached}")
    else:
        say("precomputing DINOv2 features (frozen encoder, once)")
        features = precompute(items, adapter)
        CACHE.mkdir(exist_ok=True)
        torch.save(features, cached)
        say(f"features cached in {cached}")

    media_tokens = features[0].shape[0]
    examples = []
    for item, f in zip(items, features):
        token = config.video_token_id if item.is_video else config.image_token_id
        ids, labels = tokenize(conversation(item, rng, args.caption_share), processor.tokenizer, token, media_tokens)
        examples.append((ids, labels, f))
    mean_len = sum(len(e[0]) for e in examples) / len(examples)
    say(f"{len(examples)} conversations, {mean_len:.0f} tokens on average")

    # Always from the seeded initialisation, never from a projector already shipped in assets/.
    projector = model.model.multi_modal_projector
    projector.load_state_dict(embedded.initial_projector_state(
        config.vision_config.hidden_size, config.text_config.hidden_size, config.text_config.initializer_range))
    for p in projector.parameters():
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(projector.parameters(), lr=args.lr, weight_decay=0.0)
    steps = math.ceil(len(examples) / args.batch)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / args.warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / steps))))

    def save(path_stem: Path, final: bool) -> None:
        state = {k: v.detach().clone().contiguous() for k, v in projector.state_dict().items()}
        save_file(state, f"{path_stem}.safetensors", metadata={"format": "pt"})
        record = {
            "what": "projector of Glimpse's embedded model (SmolLM2-135M-Instruct + DINOv2-S/14), LLaVA 2-layer MLP",
            "seed": args.seed, "images": args.images, "clips": args.clips, "batch": args.batch, "lr": args.lr,
            "warmup": args.warmup, "schedule": "linear warm-up, cosine to 10%", "optimizer": "AdamW, no weight decay",
            "caption_share": args.caption_share, "steps": steps, "embedded_recipe": embedded.RECIPE,
            "data": "training/tasks.py: training_items(seed, images, clips); every question of an item as a turn",
            "command": "python -m training.train_projector " + " ".join(sys.argv[1:] if argv is None else argv),
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads",
            "torch": torch.__version__, "complete": final, "log": log,
        }
        Path(f"{path_stem}.json").write_text(json.dumps(record, indent=1) + "\n")

    say(f"training {sum(p.numel() for p in projector.parameters())} projector parameters, {steps} steps of {args.batch}")
    order = list(range(len(examples)))
    rng.shuffle(order)
    running = None
    for step in range(steps):
        chunk = [examples[i] for i in order[step * args.batch: (step + 1) * args.batch]]
        loss, answer_tokens = batch_loss(model, projector, [(ids, lab) for ids, lab, _ in chunk],
                                         [f for _, _, f in chunk], config.image_token_id, config.video_token_id)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(projector.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % 5 == 0 or step == steps - 1:
            say(f"step {step + 1}/{steps}  loss {loss.item():.3f}  (smoothed {running:.3f})  "
                f"lr {schedule.get_last_lr()[0]:.2e}  answer tokens {answer_tokens}")
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < steps:
            save(Path(args.out), final=False)
    say("done")
    save(Path(args.out), final=True)
    print(f"wrote {args.out}.safetensors and {args.out}.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
