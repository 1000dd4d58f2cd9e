"""Per-layer KV cache whose entries remember which prompt token they are.

Each layer keeps exactly the tokens that were active in it, so lengths differ between layers.
Next to the key/value tensors every layer stores, per entry, the token's original index in the
sequence (prompt tokens 0..T-1, generated tokens T, T+1, ...) and its modality (0 text, 1 image,
2 video): decode-time policies find visual entries through them.

The attention modules of transformers call ``cache.update(key, value, layer_idx)`` and attend to
what it returns; that is the only method they need.
"""

from __future__ import annotations

import torch


class LayerKV:
    def __init__(self):
        self.key: torch.Tensor | None = None  # (B, kv_heads, n, head_dim), after RoPE
        self.value: torch.Tensor | None = None
        self.index = torch.empty(0, dtype=torch.long)  # (n,) original token index
        self.modality = torch.empty(0, dtype=torch.long)  # (n,)

    def __len__(self) -> int:
        return 0 if self.key is None else self.key.shape[-2]

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only entries ``rows`` (positions in this layer's cache); the tensors really shrink."""
        rows = rows.to(self.key.device)
        self.key = self.key.index_select(-2, rows).contiguous()
        self.value = self.value.index_select(-2, rows).contiguous()
        self.index = self.index[rows.to(self.index.device)]
        self.modality = self.modality[rows.to(self.modality.device)]

    def nbytes(self) -> int:
        if self.key is None:
            return 0
        return self.key.numel() * self.key.element_size() + self.value.numel() * self.value.element_size()


class KVCache:
    def __init__(self, num_layers: int):
        self.layers = [LayerKV() for _ in range(num_layers)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        layer = self.layers[layer_idx]
        if layer.key is None:
            layer.key, layer.value = key, value
        else:
            layer.key = torch.cat([layer.key, key], dim=-2)
            layer.value = torch.cat([layer.value, value], dim=-2)
        return layer.key, layer.value

    def record(self, layer_idx: int, index: torch.Tensor, modality: torch.Tensor) -> None:
        """Remember which tokens the entries just added to ``layer_idx`` belong to."""
        layer = self.layers[layer_idx]
        layer.index = torch.cat([layer.index, index.cpu()])
        layer.modality = torch.cat([layer.modality, modality.cpu()])
        assert len(layer.index) == len(layer), "KV entries and their token records out of step"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return len(self.layers[layer_idx])

    def visual_entries(self) -> int:
        """Image and video entries over all layers (what ST3's annealing shrinks)."""
        return sum(int((layer.modality != 0).sum()) for layer in self.layers)

    def lengths(self) -> list[int]:
        return [len(layer) for layer in self.layers]

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


class AuxCache:
    """LazyLLM's Aux Cache: the hidden states of tokens pruned at a layer.

    A token pruned at layer ``l`` has no key/value in layers ``l`` and deeper. Its hidden state as
    it entered layer ``l`` (the output of layer ``l - 1``) is kept here, so a decode step that needs
    the token again can compute its key/value at ``l`` from that state instead of running it through
    every earlier layer; a token lives in either the KV cache or the Aux Cache of a layer, not both.
    """

    def __init__(self):
        self.layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (index (n,), hidden (n, d))

    def add(self, layer_idx: int, index: torch.Tensor, hidden: torch.Tensor) -> None:
        if index.numel() == 0:
            return
        if layer_idx in self.layers:
            old_index, old_hidden = self.layers[layer_idx]
            index, hidden = torch.cat([old_index, index.cpu()]), torch.cat([old_hidden, hidden])
        self.layers[layer_idx] = (index.cpu(), hidden)

    def get(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.layers.get(layer_idx)

    def nbytes(self) -> int:
        return sum(h.numel() * h.element_size() for _, h in self.layers.values())
