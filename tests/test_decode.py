"""Decode-time policies: ST3's Visual Token Annealing."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline import load_engine
from pipeline.adapters import TEXT
from pruning import ST3, NoPruning
from pruning.st3 import anneal_share
from tiny_models import build_llava, reference_inputs

LAYERS = 6


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("decode") / "llava", layers=LAYERS)


def _messages(media):
    return [{"role": "user", "content": [{"type": "image", "image": str(media["image"])},
                                         {"type": "text", "text": "Describe the picture."}]}]


def _endless(engine):
    engine.eos_token_ids = set()  # decode exactly max_new_tokens: the schedule is what is tested
    return engine


def test_annealing_schedules_are_the_papers():
    assert anneal_share("cosine", 0, 50) == 1.0
    assert anneal_share("cosine", 25, 50) == pytest.approx(math.cos(math.pi / 4))
    assert anneal_share("cosine", 50, 50) == 0.0 and anneal_share("cosine", 70, 50) == 0.0
    assert anneal_share("linear", 10, 50) == pytest.approx(0.8)
    assert anneal_share("exponential", 10, 30) == pytest.approx(math.exp(-1))


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_vta_keeps_ceil_beta_of_each_layers_prefill_visual_kv_and_all_text(llava, media, schedule):
    engine = _endless(load_engine(str(llava), device="cpu"))
    messages = _messages(media)
    prompt = engine.prepare(messages)
    V, T = prompt.token_counts()["image"], len(prompt)
    tau, new = 6, 10
    result = engine.generate(messages, policy=ST3(anneal_tau=tau, anneal=schedule), max_new_tokens=new)
    assert len(result.token_ids) == new
    series = result.metrics["visual_kv_per_step"]  # step g = 1 .. new - 1 (the last token is not fed back)
    assert series == [LAYERS * math.ceil(anneal_share(schedule, g, tau) * V - 1e-9) for g in range(1, new)]
    assert series[tau - 1:] == [0] * (new - tau)  # nothing visual from g = tau on

    baseline = engine.generate(messages, policy=NoPruning(), max_new_tokens=new)
    per_entry = baseline.metrics["kv_bytes"] / (LAYERS * (T + new - 1))
    # At the end every layer holds exactly the text prompt and the generated tokens: real bytes.
    assert result.metrics["kv_bytes"] == pytest.approx(per_entry * LAYERS * (T - V + new - 1))
    steps = result.metrics["kv_bytes_per_step"]
    assert steps[-1] < baseline.metrics["kv_bytes_per_step"][-1] and len(steps) == new - 1


def test_vta_ranks_visual_kv_by_the_last_tokens_prefill_attention(llava, media):
    engine = _endless(load_engine(str(llava), device="cpu", attn="eager"))
    prompt = engine.prepare(_messages(media))
    policy = ST3(anneal_tau=8)
    with torch.no_grad():
        _, ctx = engine.prefill(prompt, policy)
        attentions = engine.model(**reference_inputs(engine, prompt), output_attentions=True).attentions
    visual = (prompt.modality != TEXT).nonzero().squeeze(1)
    policy.decode_step(4, ctx)  # beta = cos(pi/4): keep the top ceil(0.707 V) in every layer
    keep = math.ceil(math.cos(math.pi / 4) * len(visual) - 1e-9)
    for layer_idx in range(LAYERS):
        scores = attentions[layer_idx][0, :, -1].mean(dim=0)[visual]
        expected = visual[scores.argsort(descending=True)[:keep]]
        entries = ctx.cache.layers[layer_idx]
        kept = entries.index[entries.modality != TEXT]
        assert sorted(kept.tolist()) == sorted(expected.tolist())
        assert int((entries.modality == TEXT).sum()) == len(prompt) - len(visual)  # text untouched
        assert entries.key.shape[-2] == len(entries.index)  # the tensors really shrank


def test_decoding_after_the_visual_kv_is_gone_equals_a_model_that_hides_vision_from_new_tokens(llava, media):
    engine = _endless(load_engine(str(llava), device="cpu", attn="eager"))
    messages = _messages(media)
    new = 6
    result = engine.generate(messages, policy=ST3(anneal_tau=1), max_new_tokens=new)  # beta(1) = 0
    assert result.metrics["visual_kv_per_step"] == [0] * (new - 1)

    # Reference: transformers' own layers over prompt + generated tokens, where the generated
    # tokens cannot see the visual tokens as keys (the prompt tokens saw them in prefill).
    prompt = engine.prepare(messages)
    adapter, T = engine.adapter, len(prompt)
    generated = torch.tensor(result.token_ids[:-1])
    with torch.no_grad():
        hidden = torch.cat([engine.embed_prompt(prompt), adapter.embed_tokens(generated)[None]], dim=1)
        N = hidden.shape[1]
        cos, sin = adapter.rotary(hidden, torch.arange(N)[None])
        allowed = torch.ones(N, N, dtype=torch.bool).tril()
        visual = (prompt.modality != TEXT).nonzero().squeeze(1)
        allowed[T:, visual] = False
        mask = torch.zeros(N, N).masked_fill(~allowed, torch.finfo(hidden.dtype).min)[None, None]
        for layer in adapter.layers:
            hidden = layer(hidden, attention_mask=mask, position_embeddings=(cos, sin))
        logits = adapter.lm_head(adapter.norm(hidden))[0]
    assert logits[T - 1:].argmax(dim=-1).tolist() == result.token_ids
    unpruned = engine.generate(messages, policy=NoPruning(), max_new_tokens=new)
    assert unpruned.metrics["visual_kv_per_step"] == [LAYERS * len(visual)] * (new - 1)
