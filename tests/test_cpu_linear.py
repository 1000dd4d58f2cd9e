"""The CPU decode layout of linear layers (pipeline/cpu_linear.py): the same function as nn.Linear, switched
only where it was measured, and what load_engine does on a CPU."""

import pytest
import torch
from torch import nn

from glimpse.pipeline import cpu_linear
from glimpse.pipeline.cpu_linear import WeightLeftLinear, use_weight_left_linears


def _pair(bias: bool, seed: int = 0) -> tuple[nn.Linear, nn.Linear]:
    torch.manual_seed(seed)
    plain = nn.Linear(96, 160, bias=bias)
    switched = nn.Linear(96, 160, bias=bias)
    switched.load_state_dict(plain.state_dict())
    use_weight_left_linears(switched)
    return plain, switched


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 96), (1, 1, 96), (2, 1, 96), (3, 96), (8, 1, 96), (2, 8, 96), (4, 4, 96)])
def test_few_rows_give_nn_linear_result(bias, shape):
    plain, switched = _pair(bias)
    x = torch.randn(shape)
    with torch.inference_mode():
        expected, got = plain(x), switched(x)
    assert got.shape == expected.shape
    assert got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_prefill_sized_inputs_run_nn_linear_itself():
    plain, switched = _pair(bias=True)
    x = torch.randn(1, cpu_linear.MAX_ROWS + 1, 96)
    with torch.inference_mode():
        assert torch.equal(switched(x), plain(x))


def test_non_contiguous_input_and_gradients():
    plain, switched = _pair(bias=True)
    x = torch.randn(96, 4).T  # 4 rows, transposed storage
    torch.testing.assert_close(switched(x), plain(x), rtol=1e-5, atol=1e-5)
    x = torch.randn(2, 96, requires_grad=True)
    switched(x).sum().backward()
    assert switched.weight.grad is not None and x.grad is not None
    expected = torch.ones(2, 160) @ plain.weight  # d(sum(x W^T + b))/dx
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)


def test_only_plain_float32_cpu_linears_are_switched():
    class Adapted(nn.Linear):  # a subclass (a quantized or adapted layer) keeps its own forward
        pass

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), Adapted(8, 8), nn.Conv1d(8, 8, 1))
    assert use_weight_left_linears(model) == 1
    assert [type(m) for m in model] == [WeightLeftLinear, nn.Linear, Adapted, nn.Conv1d]
    assert use_weight_left_linears(model) == 0  # switching twice changes nothing


def test_load_engine_on_cpu_switches_the_model_and_runs_the_encoder_first(checkpoints):
    from glimpse.pipeline import load_engine

    engine = load_engine(str(checkpoints["llava"]), device="cpu")
    linears = [m for m in engine.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(type(m) is WeightLeftLinear for m in linears)
    # On a CPU the encoder and the layers would share the same cores (pipeline/engine.py).
    assert engine.parallel_vision is False
