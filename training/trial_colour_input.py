"""Trial behind docs/embedded.md, "Colour": does a per-token colour input help the shipped model tell red,
orange and yellow apart? Not part of the shipped recipe.

    python -m training.trial_colour_input control 40   # ~8 min + ~4 min scoring on a 2-core CPU
    python -m training.trial_colour_input colour 40
    python -m training.trial_colour_input control 0    # score the shipped weights as they are

Both arms fine-tune the shipped projector (run 9, adapters merged) for N steps of 8 on the training items
(seed 0; their features must be cached by a `train_projector` run), projector at lr 1e-4. The `colour` arm
also learns a 3 -> 576 map, zero at the start, from each visual token's cell mean colour (the processed pixels
average-pooled over its 14x14 patch, 28x28 for a pooled clip cell) added to the token beside the position
code. Scored by teacher forcing (greedy-exact, as `train_projector.validate`): 50 colour questions of held-out
seeds 2 and 5, and 4 per category of seed 2.
"""
import sys, time, random, hashlib, json, os
import torch
from transformers import LlavaForConditionalGeneration, AutoProcessor
from pipeline import embedded
from pipeline.adapters import LlavaAdapter
from training import tasks
from training import train_projector as tp

arm = sys.argv[1]            # "control" or "colour"
steps = int(sys.argv[2])
torch.manual_seed(0); rng = random.Random(0)
path = embedded.embedded_checkpoint(trained=True)
model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
model.model.language_model.set_attn_implementation("eager")
processor = AutoProcessor.from_pretrained(path)
for p in model.parameters(): p.requires_grad_(False)
adapter = LlavaAdapter(model, processor.tokenizer, processor.image_processor)
config = model.config
axes = adapter.position_axes
projector = model.model.multi_modal_projector
colour_map = torch.nn.Linear(3, config.text_config.hidden_size, bias=False)
torch.nn.init.zeros_(colour_map.weight)


def cell_rgb(item):
    """(tokens, 3): the mean of the processed (normalised) pixels under each visual token."""
    if item.is_video:
        frames = [item.frames[k] for k in tp.clip_frame_indices(len(item.frames), config.video_frames)]
        pool = embedded.PATCH_SIZE * config.spatial_pool_stride
    else:
        frames, pool = item.frames[:1], embedded.PATCH_SIZE
    pixels = processor.image_processor(images=frames, return_tensors="pt")["pixel_values"]
    return torch.nn.functional.avg_pool2d(pixels, pool).flatten(2).transpose(1, 2).reshape(-1, 3)


def code(item, base):
    c = base
    if arm == "colour":
        c = c + colour_map(cell_rgb(item)) if c is not None else colour_map(cell_rgb(item))
    return c


def evaluate(tag):
    out = {}
    for seed in (2, 5):
        pairs = tasks.heldout_set(seed, 50, ("colour",)) + (tasks.heldout_set(seed, 4) if seed == 2 else [])
        codes = {v: tp.visual_code(v, config, axes) for v in (False, True)}
        cache = tp.CACHE / f"trial-features-{seed}.pt"
        if os.path.exists(cache):
            feats = torch.load(cache)
        else:
            feats = tp.precompute([i for i, _ in pairs], adapter)
            tp.CACHE.mkdir(exist_ok=True)
            torch.save(feats, cache)
        right = {}
        with torch.no_grad():
            for (item, qa), f in zip(pairs, feats):
                chat = tp.single_turn_chat(item, qa.question, qa.answer)
                ex = tp.pack([tp.tokenize(chat, processor.tokenizer, tp.media_token(item, config), f.shape[0])])
                c = code(item, codes[item.is_video])
                logits, targets, _ = tp.answer_logits(model, projector, [ex], [f], config.image_token_id,
                                                      config.video_token_id, None if c is None else [c])
                right.setdefault(qa.category, []).append(bool((logits.argmax(-1) == targets).all()))
        out[seed] = {k: f"{sum(v)}/{len(v)}" for k, v in right.items()}
    print(tag, arm, out, flush=True)


if steps == 0:
    evaluate("before"); sys.exit()
items = tasks.training_items(tasks.TRAIN_SEED, 1280, 320)
recipe = hashlib.sha256(json.dumps([tasks.TRAIN_SEED, 1280, 320, embedded.RECIPE]).encode()).hexdigest()[:12]
features = torch.load(tp.CACHE / f"features-{recipe}.pt")
codes = {v: tp.visual_code(v, config, axes) for v in (False, True)}
examples = []
for item, f in zip(items, features):
    tok = tp.media_token(item, config)
    examples.append((tp.pack([tp.tokenize(c, processor.tokenizer, tok, f.shape[0]) for c in tp.chats(item, rng, 0.25)]), f, item))
for p in projector.parameters(): p.requires_grad_(True)
groups = [{"params": list(projector.parameters()), "lr": 1e-4}]
if arm == "colour":
    groups.append({"params": list(colour_map.parameters()), "lr": 1e-2})
opt = torch.optim.AdamW(groups, weight_decay=0.0)
order = tp.shuffled_passes(len(examples), steps * 8, rng)
start = time.perf_counter()
for step in range(steps):
    chunk = [examples[i] for i in order[step * 8:(step + 1) * 8]]
    opt.zero_grad()
    loss, n = tp.accumulate_gradient(model, projector, [e for e, _, _ in chunk], [f for _, f, _ in chunk],
                                     config.image_token_id, config.video_token_id,
                                     [code(it, codes[it.is_video]) for *_, it in chunk])
    opt.step()
    if step % 5 == 0:
        print(f"step {step} loss {loss:.3f} colour-map norm {colour_map.weight.norm():.3f} {time.perf_counter()-start:.0f}s", flush=True)
evaluate("after")
