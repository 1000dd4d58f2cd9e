"""How the engine runs each decoder layer through the model's own modules and still decides which
keys each query sees.

The engine calls every decoder layer's own ``forward`` — its norms, projections, q/k norms where the
architecture has them, its own RoPE, its MLP or mixture of experts — on the tokens it chose. Two
supported extension points of transformers let it steer attention without a private copy of the layer:

* **An attention function** registered through ``AttentionInterface``: at load the text model's
  ``_attn_implementation`` becomes ``glimpse_<kernel>`` (e.g. ``glimpse_sdpa``), with the kernel's own
  mask function registered under the same name (``AttentionMaskInterface``). The layer hands it its
  queries, keys and values after RoPE. Called without a ``glimpse`` keyword — transformers' own
  ``forward`` and ``generate`` — it *is* the kernel, unchanged (for "eager", ``eager_attention``: the modeling
  files' ``eager_attention_forward`` in one copy that also takes no module, equal to each one's bit for bit,
  tested). Called with one (the engine passes a
  ``LayerCall`` through the layer's ``**kwargs``), the call stores the keys and values in Glimpse's
  cache, shows the queries and keys to the policy, and runs the kernel over the rows and keys the
  policy chose.
* **A forward hook** on each attention module, with kwargs: the attention output after ``o_proj``,
  before the residual add, goes to the call (importance signals such as DASH's ``||U||``).

Assumption, true of every architecture Glimpse supports: ``o_proj`` has no bias, so a row that does
not attend (ZipVL's unimportant tokens) gets exactly zero attention update.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

PREFIX = "glimpse_"


class LayerCall(Protocol):
    """What the engine passes through a layer's forward as ``glimpse=``: one prefill layer of one
    request, or one decode layer of a batch of requests."""

    def attend(self, module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel) -> torch.Tensor:
        """(1, n, heads, head_dim): the attention of the layer's n rows, as ``kernel`` computes it."""

    def attention_output(self, output: torch.Tensor) -> None:
        """The attention output after o_proj, (1, n, hidden)."""


def eager_attention(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention for Llama-family layers (grouped-query heads repeated, float32
    softmax): what their modeling files pass as the default when no other kernel is configured."""
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return out, weights


def kernel(name: str):
    """The attention function of a kernel name ("sdpa", "eager", "flash_attention_2", ...)."""
    return eager_attention if name == "eager" else ALL_ATTENTION_FUNCTIONS[name]


def glimpse_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, glimpse=None, **kwargs):
    run = kernel(module.config._attn_implementation.removeprefix(PREFIX))
    if glimpse is None:  # transformers' own forward: exactly the kernel
        return run(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    def chosen(q, k, v, mask):
        # Flash kernels take no explicit mask (decode rows with revived tokens need one): sdpa then.
        use = run if mask is None or run is eager_attention else ALL_ATTENTION_FUNCTIONS["sdpa"]
        out, _ = use(module, q, k, v, mask, scaling=scaling, dropout=0.0, sliding_window=kwargs.get("sliding_window"))
        return out

    return glimpse.attend(module, query, key, value, chosen), None


def install(text_config) -> str:
    """Route the text model's attention through ``glimpse_attention``; returns the kernel's name."""
    current = text_config._attn_implementation or "eager"
    name = current.removeprefix(PREFIX)
    routed = PREFIX + name
    if routed not in ALL_ATTENTION_FUNCTIONS:
        AttentionInterface.register(routed, glimpse_attention)
        # transformers' own forward builds the mask its kernel expects; flash kernels take none.
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(name)
        if mask is not None:
            AttentionMaskInterface.register(routed, mask)
    text_config._attn_implementation = routed
    return name


_HOOKED: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()


def hook_attention_outputs(modules) -> None:
    """Give each attention module's output (after o_proj) to the engine's call, once per module."""
    for module in modules:
        if module not in _HOOKED:
            module.register_forward_hook(_output_hook, with_kwargs=True)
            _HOOKED.add(module)


def _output_hook(module, args, kwargs, output) -> None:
    call = kwargs.get("glimpse")
    if call is not None:
        call.attention_output(output[0])
