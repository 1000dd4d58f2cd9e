"""What Glimpse's LLaVA adapter adds to the embedded model's visual tokens: a fixed 2D position code in
words the language model knows (pipeline/embedded.py says why). Kept apart from the embedded model's
builder so that loading any other model never imports the builder (onnx, gguf, file locks)."""

from __future__ import annotations

import torch


def word_embedding(embed_weight: torch.Tensor, tokenizer, words: str) -> torch.Tensor:
    """The mean input embedding of " " + `words` (the form they take inside a sentence)."""
    return embed_weight.detach()[tokenizer(" " + words, add_special_tokens=False)["input_ids"]].float().mean(0)


def position_axes(embed_weight: torch.Tensor, tokenizer) -> torch.Tensor:
    """(2, hidden): the unit vectors from the input embedding of " left" to " right" and of " top" to " bottom",
    each times the vocabulary's mean embedding norm."""
    def axis(low: str, high: str) -> torch.Tensor:
        return word_embedding(embed_weight, tokenizer, high) - word_embedding(embed_weight, tokenizer, low)

    axes = torch.stack([axis("left", "right"), axis("top", "bottom")])
    return axes / axes.norm(dim=-1, keepdim=True) * embed_weight.detach().float().norm(dim=-1).mean()


def position_code(axes: torch.Tensor, frames: int, rows: int, cols: int) -> torch.Tensor:
    """(frames * rows * cols, hidden): x * axes[0] + y * axes[1] for each token of `frames` row-major grids,
    x and y running from -1 to 1 over the cell centres (the left column's x is -1 + 1/cols)."""
    y = (torch.arange(rows, dtype=torch.float32, device=axes.device) + 0.5) / rows * 2 - 1
    x = (torch.arange(cols, dtype=torch.float32, device=axes.device) + 0.5) / cols * 2 - 1
    grid = x[None, :, None] * axes[0] + y[:, None, None] * axes[1]  # (rows, cols, hidden)
    return grid.reshape(rows * cols, -1).repeat(frames, 1)
