"""Packed group-wise KV quantization: the building block of ZipVL's mixed-precision KV cache."""

from __future__ import annotations

import pytest
import torch

from glimpse.pipeline.quant import dequantize, quantize


@pytest.mark.parametrize("bits", [2, 4])
def test_round_trip_error_is_within_half_a_step_of_each_group(bits):
    x = torch.randn(1, 2, 37, 64, generator=torch.Generator().manual_seed(0)) * 3
    q = quantize(x, bits, group=32)
    error = (dequantize(q) - x).abs().reshape(1, 2, 37, 2, 32)
    groups = x.reshape(1, 2, 37, 2, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / (2**bits - 1)
    assert (error <= (step / 2 + step * 2e-3 + 1e-3).unsqueeze(-1)).all()  # + float16 rounding of scale/min
    assert dequantize(q).dtype == x.dtype and dequantize(q).shape == x.shape


@pytest.mark.parametrize("bits", [2, 4])
def test_stored_bytes_are_the_packed_codes_plus_scales(bits):
    x = torch.randn(1, 2, 100, 128)
    q = quantize(x, bits, group=32)
    codes = 2 * 100 * 128 * bits // 8
    scales = 2 * (2 * 100 * 128 // 32) * 2  # scale and min, float16, per group
    assert q.packed.dtype == torch.uint8 and q.nbytes() == codes + scales
    # (bits + 1) bits per value with groups of 32: a float16 scale and min cost 1 bit per value.
    assert q.nbytes() == x.numel() * (bits + 1) // 8 < x.numel() * 2


def test_selecting_tokens_works_on_the_packed_bytes():
    x = torch.randn(1, 2, 10, 64)
    q = quantize(x, 4)
    rows = torch.tensor([1, 4, 7])
    assert torch.equal(dequantize(q.select(rows)), dequantize(q)[:, :, rows])


def test_attention_over_dequantized_keys_and_values_is_close_to_float():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 64, generator=g) for n in (1, 300, 300))
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    for bits, tolerance in ((4, 0.05), (2, 0.25)):
        approx = torch.nn.functional.scaled_dot_product_attention(q, dequantize(quantize(k, bits)),
                                                                  dequantize(quantize(v, bits)))
        assert (approx - exact).abs().max() < tolerance
