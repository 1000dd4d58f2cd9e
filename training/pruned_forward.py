"""Pruning in the training loop. HiDivDrop: the language model's forward pass as the engine runs it under a HiDivDrop
schedule, written as one attention mask per layer, so that the embedded model learns to answer with late
injection, the concave pyramid and the early exit (`python -m training.train_projector --hidivdrop-share`).

HiDivDrop is a training-based method in its paper: the vision tokens skip the first L_inj layers, a ranking at
each filtering layer keeps a shrinking share of them, and none is active from L_exit on. Run training-free on
the embedded model it keeps 10% of the answers at speed 0.5 (docs/pruning.md): the model was never shown text
layers without vision, nor vision tokens that join at layer 8 with their raw embeddings. Here a training item
runs exactly that, with the schedule `HiDivDrop.from_speed(speed).plan` gives inference:

* layers below L_inj and from L_exit on: no text token sees a vision key (the engine holds no vision KV there);
* at L_inj the vision tokens' hidden states are reset to their embeddings (the engine injects them there);
* at each cut the vision tokens of lowest rank leave, ranked as the engine ranks them: the last prompt token's
  attention in the layer before the cut, mean over heads (the same probe the policy reads).

Masking a token's keys from every later query is what dropping it does (tests/test_engine.py, drop equals
mask), so each chat's answer is trained on what inference will compute. One approximation, for packed items:
each chat ranks and drops its own vision tokens (its probe is its own last prompt token), but the shared
prefix's rows (the vision tokens themselves) are computed once for all chats, so among themselves they see
every vision token that some chat still keeps. A single-chat item is exact.

DivPrune (`--divprune-share`): each image's (each clip frame's) most diverse share `keep` of its vision tokens,
chosen by the engine's own `max_min_diverse` over the vision tokens' inputs; the rest are masked from every row.
The selection does not depend on the question, so packed items are exact too.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from glimpse.common import Modality
from glimpse.pruning import make_policy
from glimpse.pruning.base import lowest


@dataclass(frozen=True)
class Schedule:
    """Where the vision tokens are active: layers [inject, exit), and from each cut layer on only `cuts[layer]`
    of them (the policy's resolved plan on `visual` vision tokens)."""
    speed: float
    inject: int
    exit: int
    cuts: dict[int, int]


def hidivdrop_schedule(speed: float, num_layers: int, visual: int, params: dict | None = None) -> Schedule:
    """The schedule HiDivDrop at `speed`, with the parameter overrides `params` (as `--param` gives them to
    inference), runs on a prompt with `visual` vision tokens (no ILVAS profile)."""
    policy = make_policy("hidivdrop", speed, params)
    modality = torch.cat([torch.zeros(1, dtype=torch.long), torch.full((visual,), int(Modality.IMAGE)),
                          torch.zeros(1, dtype=torch.long)])
    policy.plan(SimpleNamespace(num_layers=num_layers, modality=modality))
    return Schedule(speed, policy.inject, policy.exit, dict(policy.cuts))


@dataclass(frozen=True)
class DivPruneSchedule:
    """DivPrune at `keep` on an item whose vision tokens are `frames` equal frames (1: an image); each frame is
    selected on its own, as inference does (`DivPrune.per_frame`)."""
    keep: float
    frames: int = 1


def divprune_allowed(allowed: torch.Tensor, embeds: torch.Tensor, visual: torch.Tensor,
                     schedule: DivPruneSchedule) -> torch.Tensor:
    """`allowed` (T, T) with the vision tokens DivPrune leaves out masked from every row: no row sees their keys
    (each still sees itself, so that no row is without a key; those rows' outputs are never read). `embeds`
    (T, hidden): the language model's inputs, which DivPrune's cosine distances are taken over."""
    from glimpse.pruning.divprune import kept_count, max_min_diverse

    frames = visual.nonzero().squeeze(1).chunk(schedule.frames)
    size = frames[0].shape[0]
    same = torch.stack(frames)  # (frames, size): the engine selects equal frames side by side, as here
    with torch.autocast(embeds.device.type, enabled=False):  # chosen in float32, as inference chooses
        chosen = max_min_diverse(embeds.detach().float()[same], kept_count(schedule.keep, size))
    dropped = same[~torch.zeros_like(same, dtype=torch.bool).scatter(1, chosen, True)]
    allowed = allowed.clone()
    allowed[:, dropped] = False
    allowed[dropped, dropped] = True
    return allowed


def probe_rows(labels: torch.Tensor, segments: torch.Tensor) -> dict[int, int]:
    """Each chat's last prompt token (segment -> position): the one whose next token is its answer's first. An
    item of one chat is all shared prefix (segment 0, `pack`): then segment 0 is that chat."""
    probes = {}
    for position in range(len(labels) - 1):
        segment = int(segments[position])
        if segment >= 0 and segment not in probes and labels[position + 1] != -100:
            probes[segment] = position
    return probes


def pruned_forward(language_model, embeds: torch.Tensor, allowed: torch.Tensor, positions: torch.Tensor,
                   segments: torch.Tensor, visual: torch.Tensor, probes: dict[int, int],
                   schedule: Schedule) -> torch.Tensor:
    """The language model's last hidden state (1, T, hidden) for one packed item under `schedule`.

    `allowed` (T, T) says which key each row may see without pruning (causal, per chat); `visual` (T,) marks the
    vision tokens; `probes` maps each chat (segment) to its last prompt token."""
    vis = visual.nonzero().squeeze(1)
    chats = sorted(probes)
    chat_rows = {k: (segments == k).nonzero() for k in chats}  # (rows, 1): each chat's rows, for the mask
    # keeps[k]: which vision tokens chat k still sees (over vis), narrowed at each cut
    keeps = {k: torch.ones(len(vis), dtype=torch.bool) for k in chats}
    scores: dict[int, torch.Tensor] = {}
    captured: dict[str, torch.Tensor] = {}

    def capture(_module, _args, output):
        captured["weights"] = output[1]  # eager attention returns its probabilities

    hidden = embeds
    position_embeddings = language_model.rotary_emb(hidden, position_ids=positions)
    floor = torch.finfo(torch.float32).min
    for layer_idx, layer in enumerate(language_model.layers):
        if layer_idx == schedule.inject and schedule.inject > 0:
            hidden = hidden.clone()
            hidden[:, vis] = embeds[:, vis]  # the vision tokens join here with their embeddings
        if layer_idx in schedule.cuts and scores:
            for k in chats:
                excess = int(keeps[k].sum()) - schedule.cuts[layer_idx]
                if excess > 0:
                    # the engine's rule (drop_lowest_visual): lowest scores first, ties to earlier tokens
                    keeps[k][lowest(scores[k].masked_fill(~keeps[k], float("inf")), excess)] = False
        sees = allowed.clone()
        if schedule.inject <= layer_idx < schedule.exit:
            union = torch.stack([keeps[k] for k in chats]).any(0)
            gone = vis[~union]
            sees[:, gone] = False  # rows of the shared prefix: keys some chat still keeps
            for k in chats:
                dropped = vis[~keeps[k]]
                sees[chat_rows[k], dropped[None, :]] = False
        else:
            sees[:, vis] = False  # no vision KV below the injection and from the exit on
            sees[vis, vis] = True  # a vision row sees itself: no row without a key (its output is unused)
        mask = torch.zeros(sees.shape, dtype=torch.float32).masked_fill(~sees, floor)[None, None]
        probe = layer_idx + 1 in schedule.cuts
        handle = layer.self_attn.register_forward_hook(capture) if probe else None
        hidden = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=position_embeddings)
        if handle is not None:
            handle.remove()
            weights = captured.pop("weights").detach()[0].float().mean(0)  # (T, T), mean over heads
            scores = {k: weights[probes[k], vis] for k in chats}
    return language_model.norm(hidden)
