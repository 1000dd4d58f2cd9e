"""Group-wise asymmetric integer quantization of KV tensors, with real bit packing.

A tensor (..., n, head_dim) is split, per token and head, into groups of ``group`` consecutive
channels; each group stores ``bits``-bit codes ``q = round((x - min) / scale)`` packed ``8 / bits``
to a byte, plus its ``scale`` and ``min`` in float16. Dequantization is ``q * scale + min``; the
error of each element is at most ``scale / 2 = (max - min) / (2 (2^bits - 1))`` of its group (plus
float16 rounding of scale and min). Tokens stay separate rows, so selecting tokens (evicting KV
entries) works on the packed bytes directly, without re-quantizing.

Written here rather than taken from quanto or hqq: the engine needs exactly this (2 and 4 bits,
token-major packing it can index) on CPU and GPU alike, and both libraries bring compiled
extensions or CUDA-only kernels that the CPU machine cannot use.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class QuantizedTensor:
    packed: torch.Tensor  # uint8 (..., n, head_dim * bits / 8)
    scale: torch.Tensor  # float16 (..., n, head_dim / group)
    minimum: torch.Tensor  # float16 (..., n, head_dim / group)
    bits: int
    group: int
    dtype: torch.dtype  # what dequantize returns

    @property
    def tokens(self) -> int:
        return self.packed.shape[-2]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.minimum))

    def select(self, rows: torch.Tensor) -> "QuantizedTensor":
        """Only the tokens ``rows`` (positions along the token axis)."""
        pick = lambda t: t.index_select(-2, rows.to(t.device))  # noqa: E731
        return QuantizedTensor(pick(self.packed), pick(self.scale), pick(self.minimum), self.bits, self.group,
                               self.dtype)

    def _like(self, make) -> "QuantizedTensor":
        return QuantizedTensor(make(self.packed), make(self.scale), make(self.minimum), self.bits, self.group,
                               self.dtype)

    def narrow(self, dim: int, start: int, length: int) -> "QuantizedTensor":
        """A view of ``length`` rows from ``start`` along ``dim`` (a leading axis, or -2: tokens)."""
        return self._like(lambda t: t.narrow(dim, start, length))

    def slots(self, count: int, room: int) -> "QuantizedTensor":
        """Zeros for ``count`` slots of ``room`` tokens each, of this tensor's kind: (count, ..., room, ...)."""
        return self._like(lambda t: t.new_zeros(count, *t.shape[1:-2], room, t.shape[-1]))

    def copy_into(self, target: "QuantizedTensor") -> None:
        """Write these tokens into ``target`` (a view of as many tokens)."""
        for mine, theirs in zip((self.packed, self.scale, self.minimum), (target.packed, target.scale, target.minimum)):
            theirs.copy_(mine)


def cat_tokens(parts: list[QuantizedTensor]) -> QuantizedTensor:
    """The tokens of ``parts`` (of one kind: bits, group, dtype) one after the other."""
    if len(parts) == 1:
        return parts[0]
    join = lambda name: torch.cat([getattr(q, name) for q in parts], dim=-2)  # noqa: E731
    first = parts[0]
    return QuantizedTensor(join("packed"), join("scale"), join("minimum"), first.bits, first.group, first.dtype)


def quantize(x: torch.Tensor, bits: int, group: int = 32) -> QuantizedTensor:
    if bits not in (2, 4, 8):
        raise ValueError(f"bits must be 2, 4 or 8, got {bits}")
    *lead, dim = x.shape
    if dim % group:
        raise ValueError(f"head_dim {dim} is not a multiple of the group size {group}")
    groups = x.float().reshape(*lead, dim // group, group)
    minimum = groups.amin(dim=-1, keepdim=True)
    scale = ((groups.amax(dim=-1, keepdim=True) - minimum) / (2**bits - 1)).clamp(min=1e-8)
    # Codes from the float16 scale/min actually stored, so dequantization matches them exactly.
    scale16, minimum16 = scale.half(), minimum.half()
    codes = ((groups - minimum16.float()) / scale16.float()).round().clamp(0, 2**bits - 1).to(torch.uint8)
    per_byte = 8 // bits
    codes = codes.reshape(*lead, dim // per_byte, per_byte)
    shifts = torch.arange(per_byte, device=x.device, dtype=torch.uint8) * bits
    packed = (codes << shifts).sum(dim=-1, dtype=torch.uint8)
    return QuantizedTensor(packed, scale16.squeeze(-1), minimum16.squeeze(-1), bits, group, x.dtype)


def dequantize(q: QuantizedTensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float values (``q.dtype``). With ``out`` (a tensor of that shape and dtype, e.g. a slice of a
    bigger buffer whose last axis is contiguous) they are written there, so a reader of several segments
    assembles them in one buffer instead of concatenating copies. Computed in float32 either way."""
    per_byte = 8 // q.bits
    shifts = _shifts(q.bits, q.packed.device)
    codes = (q.packed.unsqueeze(-1) >> shifts) & (2**q.bits - 1)  # (..., n, dim / per_byte, per_byte)
    *lead, packed_dim = q.packed.shape
    dim = packed_dim * per_byte
    codes = codes.reshape(*lead, dim // q.group, q.group).float()
    minimum, scale = q.minimum.float().unsqueeze(-1), q.scale.float().unsqueeze(-1)
    if out is None:
        return torch.addcmul(minimum, codes, scale).reshape(*lead, dim).to(q.dtype)
    # Straight into ``out`` (rounded to its dtype as it is stored): no float32 copy of the values first.
    torch.addcmul(minimum, codes, scale, out=out.view(*lead, dim // q.group, q.group))
    return out


_SHIFTS: dict[tuple[int, torch.device], torch.Tensor] = {}


def _shifts(bits: int, device: torch.device) -> torch.Tensor:
    """The bit offsets of the codes in a byte, made once per device (a decode step dequantizes at every layer)."""
    key = (bits, device)
    if key not in _SHIFTS:
        _SHIFTS[key] = torch.arange(8 // bits, device=device, dtype=torch.uint8) * bits
    return _SHIFTS[key]
