"""Linear layers for inference on a CPU (pipeline/cpu_linear.py): nn.Linear's function, packed or weight-left,
switched only where it was measured, and what load_engine does on a CPU."""

import pytest
import torch
from torch import nn

from glimpse.pipeline import cpu_linear
from glimpse.pipeline.cpu_linear import CpuLinear, use_cpu_linears

PATHS = ["packed", "weight-left"]


def _pair(bias: bool, pack: bool, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(96, 160, bias=bias)
    switched = nn.Linear(96, 160, bias=bias)
    switched.load_state_dict(plain.state_dict())
    assert use_cpu_linears(switched, pack=pack) == (1, 1 if pack else 0)
    return plain, switched


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (2, 1, 96), (3, 96), (8, 1, 96), (2, 8, 96), (1, 40, 96)])
def test_inference_gives_nn_linear_result(path, bias, shape):
    plain, switched = _pair(bias, pack=path == "packed")
    x = torch.randn(shape)
    with torch.inference_mode():
        expected, got = plain(x), switched(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert switched.packed is not None if path == "packed" else switched.packed is None


@pytest.mark.parametrize("width", [96, 1024, 1536])
def test_packed_rows_do_not_depend_on_the_other_rows(width):
    """A request's projections in a decode step are the same bits whatever else shares the step, and the
    same as in its own prefill (nn.Linear's differ between row counts). One row alone is the exception past an
    input 1,024 wide (docs/engine.md, "Linear layers on a CPU"; an outside pass found it at the embedded model's
    1,536, which this test, at 96 wide only, had never tried)."""
    torch.manual_seed(0)
    switched = nn.Linear(width, 160)
    use_cpu_linears(switched, pack=True)
    x = torch.randn(300, width)
    with torch.no_grad():
        paired = switched(x[:2])[0]
        for rows in (3, 5, 8, 16, 64, 300):
            assert torch.equal(switched(x[:rows])[0], paired), rows
        if width <= 1024:  # (wider, oneDNN sums one row alone in another order: documented, not promised)
            assert torch.equal(switched(x[:1])[0], paired)


def test_unpacked_prefill_sized_inputs_run_nn_linear_itself():
    plain, switched = _pair(bias=True, pack=False)
    x = torch.randn(1, cpu_linear.MAX_ROWS + 1, 96)
    with torch.inference_mode():
        assert torch.equal(switched(x), plain(x))


@pytest.mark.parametrize("path", PATHS)
def test_gradients_and_non_contiguous_inputs(path):
    plain, switched = _pair(bias=True, pack=path == "packed")
    with torch.no_grad():
        x = torch.randn(96, 4).T  # 4 rows, transposed storage
        torch.testing.assert_close(switched(x), plain(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 96, requires_grad=True)
    switched(x).sum().backward()  # with gradients: nn.Linear's own product
    assert switched.weight.grad is not None
    torch.testing.assert_close(x.grad, torch.ones(2, 160) @ plain.weight, rtol=1e-5, atol=1e-5)


def test_a_weight_changed_in_place_is_packed_again():
    plain, switched = _pair(bias=False, pack=True)
    x = torch.randn(3, 96)
    with torch.no_grad():
        switched(x)
        for layer in (plain, switched):
            layer.weight.mul_(-2.0)  # as an optimizer step or load_state_dict would
        torch.testing.assert_close(switched(x), plain(x), rtol=1e-5, atol=1e-5)
        switched.load_state_dict(nn.Linear(96, 160, bias=False).state_dict())
        torch.testing.assert_close(switched(x), x @ switched.weight.T, rtol=1e-5, atol=1e-5)


def test_only_plain_float32_cpu_linears_are_switched():
    class Adapted(nn.Linear):  # a subclass (a quantized or adapted layer) keeps its own forward
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), Adapted(8, 8), nn.Conv1d(8, 8, 1))
    assert use_cpu_linears(model) == (1, 1)
    assert [type(m) for m in model] == [CpuLinear, nn.Linear, Adapted, nn.Conv1d]
    assert use_cpu_linears(model) == (0, 0)  # switching twice changes nothing


def test_packing_needs_the_memory_for_the_copies(monkeypatch):
    monkeypatch.setattr(cpu_linear, "available_memory_bytes", lambda: 2 * 64 * 64 * 4 - 1)
    model = nn.Linear(64, 64)
    assert use_cpu_linears(model) == (1, 0)  # the copy would take more than half of what is available
    model = nn.Linear(64, 64)
    monkeypatch.setattr(cpu_linear, "available_memory_bytes", lambda: 2 * 64 * 64 * 4 + 1)
    assert use_cpu_linears(model) == (1, 1)


def test_load_engine_on_cpu_switches_the_model_and_runs_the_encoder_first(checkpoints):
    from glimpse.pipeline import load_engine

    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is CpuLinear and m.packed is not None for m in linears)
    # On a CPU the encoder and the layers would share the same cores (pipeline/engine.py).
    assert engine.parallel_vision is False
