"""Promises of the caches and the prompt builder: what they hold and count, and prompts as transformers builds them
(found untested by an outside mutation pass)."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from glimpse.pipeline.adapters import IMAGE, MediaInput


def _kv(n: int):
    from glimpse.pipeline.cache import KVCache

    cache = KVCache(2)
    for layer in cache.layers:
        layer.append(torch.randn(1, 1, n, 4), torch.randn(1, 1, n, 4))
    return cache


def test_the_prefix_cache_checks_every_picture_not_only_the_first():
    """Two pictures behind the same placeholder ids: when only the second differs, only the tokens before it are
    shared (its keys are another picture's)."""
    from glimpse.pipeline.prefix_cache import MediaSpan, PrefixCache

    cache = PrefixCache(max_bytes=1 << 20)
    ids = torch.tensor([6, 0, 0, 8, 0, 0, 8, 9])
    at = torch.arange(8)[None]
    cache.put(ids, at, [MediaSpan(1, 3, "a"), MediaSpan(4, 6, "b")], _kv(8))
    _, shared = cache.lookup(torch.cat([ids, torch.tensor([5])]), torch.arange(9)[None],
                             [MediaSpan(1, 3, "a"), MediaSpan(4, 6, "c")])
    assert shared == 4
    _, shared = cache.lookup(torch.cat([ids, torch.tensor([5])]), torch.arange(9)[None],
                             [MediaSpan(1, 3, "a"), MediaSpan(4, 6, "b")])
    assert shared == 8


def test_a_prefix_cache_hit_is_a_use_and_is_counted():
    """Least recently *used* out first: an entry a lookup served stays over one nobody asked for; the tokens
    served are counted for /metrics."""
    from glimpse.pipeline.prefix_cache import PrefixCache

    per_token = 2 * 2 * 4 * 4
    cache = PrefixCache(max_bytes=8 * per_token)
    at = lambda n: torch.arange(n)[None]  # noqa: E731
    cache.put(torch.tensor([1, 1, 1, 1]), at(4), [], _kv(4))
    cache.put(torch.tensor([2, 2, 2, 2]), at(4), [], _kv(4))
    assert cache.lookup(torch.tensor([1, 1, 1, 7]), at(4), [])[1] == 3  # the older one, used now
    cache.put(torch.tensor([3, 3, 3, 3]), at(4), [], _kv(4))  # over the bound: the one not used goes
    assert sorted(int(e.input_ids[0]) for e in cache.entries.values()) == [1, 3]
    assert cache.stats()["reused_tokens"] == 3 and cache.stats()["hits"] == 1


def test_the_caches_count_every_byte_they_hold_and_keep_what_fits_exactly():
    from glimpse.pipeline.encoder_cache import EncoderCache
    from glimpse.pipeline.media_cache import MediaCache

    features, deepstack = torch.zeros(10, 4), [torch.zeros(10, 4), torch.zeros(10, 4)]  # 160 bytes each
    encoder = EncoderCache(max_bytes=480)
    encoder.put("a", (features, deepstack))  # exactly the bound: kept
    assert set(encoder.entries) == {"a"} and encoder.bytes == 480
    encoder.put("a", (features, deepstack))  # the same key again (two requests at once): held once
    assert set(encoder.entries) == {"a"} and encoder.bytes == 480

    frames = [Image.new("RGB", (10, 10)), Image.new("RGB", (10, 10))]  # 300 bytes each, as RGB
    item = MediaInput(IMAGE, 1, {"pixel_values": torch.zeros(10, 4)}, frames=frames)
    media = MediaCache(max_bytes=1 << 20)
    media.put("a", item)
    assert media.bytes == 160 + 2 * 300


def test_items_with_the_same_bytes_in_other_shapes_have_other_keys():
    from glimpse.pipeline.encoder_cache import item_key

    a = MediaInput(IMAGE, 4, {"pixel_values": torch.arange(12.0).reshape(3, 4)})
    b = MediaInput(IMAGE, 4, {"pixel_values": torch.arange(12.0).reshape(4, 3)})
    assert item_key(a) != item_key(b)


def test_a_template_that_writes_bos_gets_one_bos(checkpoints, media):
    """A chat template that writes BOS itself (Llama's, Mistral's) gets no second one from the tokenizer, as
    transformers' apply_chat_template(tokenize=True) gives; one that does not write it gets the tokenizer's."""
    from tokenizers.processors import TemplateProcessing

    from glimpse.pipeline import load_engine

    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    tok = engine.adapter.tokenizer
    bos = tok.bos_token_id
    tok._tokenizer.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello there"}]}]
    plain = engine.prepare(messages).input_ids.tolist()
    assert plain.count(bos) == 1 and plain[0] == bos
    engine.chat_template = "{{ bos_token }}" + tok.chat_template
    written = engine.prepare(messages).input_ids.tolist()
    expected = tok.apply_chat_template(messages, chat_template=engine.chat_template, tokenize=True,
                                       add_generation_prompt=True)
    expected = expected if isinstance(expected, list) else expected["input_ids"]
    assert written == list(expected) and written.count(bos) == 1


def test_a_prompt_that_fills_the_whole_context_is_refused(checkpoints, media):
    """A prompt of max_length tokens leaves no position for an answer: refused as over the context; one token
    shorter, it is answered."""
    from glimpse.pipeline import PromptError, load_engine

    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    messages = [{"role": "user", "content": "Hello there"}]
    n = len(engine.prepare(messages))
    engine.max_length = n
    with pytest.raises(PromptError, match="context length"):
        engine.generate(messages, max_new_tokens=2)
    engine.max_length = n + 1
    assert engine.generate(messages, max_new_tokens=2, ignore_eos=True).token_ids


def test_a_picture_the_chat_template_writes_no_placeholder_for_is_refused_not_dropped(checkpoints, media):
    """A template that leaves the picture out would have the model answer without it: refused, saying so."""
    from glimpse.pipeline import PromptError, load_engine

    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    engine.chat_template = ("{% for message in messages %}USER: {% for item in message['content'] %}"
                            "{% if item['type'] == 'text' %}{{ item['text'] }}{% endif %}{% endfor %} {% endfor %}"
                            "ASSISTANT:")
    messages = [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    with pytest.raises(PromptError, match="no placeholder"):
        engine.prepare(messages)


def test_control_text_typed_under_a_template_that_trims_it_is_spelled_out(checkpoints):
    """Templates that write a message's text trimmed (Llama 3's ``| trim``) still have typed control text spelled
    out as text, not refused and not read as a placeholder."""
    from glimpse.pipeline import load_engine

    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    template = engine.adapter.tokenizer.chat_template
    engine.chat_template = template.replace("{{ item['text'] }}", "{{ item['text'] | trim }}")
    assert "| trim" in engine.chat_template
    prompt = engine.prepare([{"role": "user", "content": [{"type": "text", "text": "  what is <image> here?  "}]}])
    assert engine.adapter.image_token_id not in prompt.input_ids.tolist()
    assert "<image>" in engine.adapter.tokenizer.decode(prompt.input_ids)


def test_a_llava_checkpoint_with_full_features_answers_as_transformers_does(checkpoints, media, tmp_path):
    """LLaVA-1.5 with vision_feature_select_strategy 'full' keeps the CLS feature: one more placeholder per
    picture, and the answer is transformers' own."""
    import json
    import shutil

    from glimpse.pipeline import load_engine
    from tiny_models import reference_inputs, transformers_model

    folder = tmp_path / "full"
    shutil.copytree(checkpoints["llava"], folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "vision_feature_select_strategy": "full"}))
    engine = load_engine(str(folder), device="cpu")
    messages = [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                             {"type": "text", "text": "What is in this picture?"}]}]
    result = engine.generate(messages, policy="none", max_new_tokens=6)
    prompt = engine.prepare(messages)
    with torch.no_grad():
        expected = transformers_model(folder).generate(**reference_inputs(engine, prompt), max_new_tokens=6,
                                                       do_sample=False)[0, len(prompt):].tolist()
    if expected and expected[-1] in engine.eos_token_ids:
        expected = expected[:-1]
    assert result.token_ids == expected


@pytest.mark.parametrize("arch", ["llava", "qwen2_vl"])  # grouped-query attention: fewer key/value heads than heads
def test_the_kv_budget_unit_is_what_a_prompt_token_really_holds(checkpoints, arch):
    from glimpse.pipeline import load_engine
    from glimpse.pruning import NoPruning

    engine = load_engine(str(checkpoints[arch]), device="cpu")
    prompt = engine.prepare([{"role": "user", "content": "Hello there"}])
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, NoPruning())
    held = sum(t.numel() * t.element_size() for layer in ctx.cache.layers for t in (layer.key, layer.value))
    assert held == engine.kv_bytes_per_token() * len(prompt)
