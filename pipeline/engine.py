"""The layer-by-layer prefill/decode engine.

One explicit loop over the model's own modules (embeddings, vision encoder + projector, decoder
layers, final norm, lm_head, rotary embedding) instead of ``model.generate``: pruning policies need
to change which tokens each layer computes, which hooks on ``generate`` cannot express cleanly.

Prefill keeps an *active set* per layer: sorted indices into the full prompt. A layer runs only on
its active tokens — gathered hidden states, gathered cos/sin of their original (persistent)
positions, causal order by original index — so pruning never shifts positions, and a token that
leaves the active set keeps its last hidden state. Each layer's KV cache holds exactly the tokens
that were active in it. With every token active the loop is exactly transformers' forward.
"""

from __future__ import annotations

import contextlib
import copy
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from glimpse.common import UserError
from glimpse.common.jsonable import plain_number
from glimpse.pipeline import attention
from glimpse.pipeline.adapters import IMAGE, TEXT, VIDEO, Adapter
from glimpse.pipeline.batch_kv import BatchKV, decodes_plainly, form_groups, serve_step
from glimpse.pipeline.cache import AuxCache, KVCache
from glimpse.pipeline.decode_graph import SlotStep, fixed_shape_step
from glimpse.pipeline.encoder_cache import EncoderCache, media_key
from glimpse.pipeline.media_cache import MediaCache
from glimpse.pipeline.metrics import MemoryMeter, Metrics, keep_map, prefill_flops, synchronize
from glimpse.pipeline.out_of_memory import OutOfMemory, attempt, is_out_of_memory, tried_to_allocate
from glimpse.pipeline.prefix_cache import PrefixCache, media_spans
from glimpse.pipeline.prompt import Prompt, PromptError, build_prompt
from glimpse.pipeline.sampling import Sampling
from glimpse.pruning import Frontier, Policy, configuration, make_policy, prunes_nothing
from glimpse.pruning.frontier import uncalibrated_frontier


@dataclass
class GenerationResult:
    text: str
    token_ids: list[int]
    metrics: Metrics
    policy: str
    params: dict
    finish_reason: str  # "stop" (EOS), "length" (max_new_tokens or context end), "cancelled"
    summary: str = ""  # the policy's one-line description, e.g. "DASH rho=0.40 at layer 11"
    # The next-token logits after prefill (float32, on the device): calibration's first-token KL.
    first_logits: torch.Tensor | None = field(default=None, repr=False)
    # What the answer could not see, said with it: e.g. a damaged video's frames sampled from the part that decoded.
    warnings: list[str] = field(default_factory=list)


@dataclass
class StreamChunk:
    text: str  # new text since the previous chunk (may be empty)
    token_id: int | None = None
    result: GenerationResult | None = None  # set on the last chunk only


@dataclass(frozen=True)
class LayerView:
    """What a policy's callbacks see of the layer they act on, valid during that layer only.

    Prefill: ``active`` the sorted original indices the layer computes, ``queries`` (1, heads, n, head_dim)
    and ``keys`` (1, kv_heads, n, head_dim) after RoPE, in the order of ``active``. Decode: ``active`` the
    step's rows (revived prompt tokens, then the new token), ``queries`` the new token's alone, ``keys``
    what it attended to and ``key_index`` their original indices."""

    index: int
    active: torch.Tensor
    modality: torch.Tensor  # of ``active``
    queries: torch.Tensor
    keys: torch.Tensor
    scaling: float
    key_index: torch.Tensor | None = None


@dataclass
class PrefillContext:
    """What policies may look at during prefill (and decode)."""

    prompt: Prompt
    adapter: Adapter
    modality: torch.Tensor  # (T,) on the model device
    positions: torch.Tensor  # (P, T)
    hidden: torch.Tensor  # (1, T, d): the residual stream; inactive tokens keep their last state
    cache: KVCache
    num_layers: int
    active_per_layer: list[torch.Tensor] = field(default_factory=list)
    # Per layer, the original indices that took part in attention when a policy restricted it
    # (ZipVL's important tokens); None where every active token did.
    attention_per_layer: list[torch.Tensor | None] = field(default_factory=list)
    aux_cache: AuxCache = field(default_factory=AuxCache)  # hidden states of pruned tokens (LazyLLM)
    generated: int = 0  # decode steps done
    vision_encoder_s: float = 0.0  # the vision encoder + projector's own time
    vision_wait_s: float = 0.0  # how long the layer loop waited for it (all of it, unless it overlapped)
    # Per decode step: the KV bytes and visual KV entries it attended to, and its wall time.
    kv_bytes_per_step: list[int] = field(default_factory=list)
    visual_kv_per_step: list[int] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)  # tokens the whole batch made in each of those steps
    revived: int = 0  # prompt-token computations added by revival in decode (LazyLLM)
    # Per decoder layer 0, 1, ...: (visual rows, features) the architecture adds to those tokens after
    # that layer (Qwen3-VL's DeepStack); empty for most.
    layer_features: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    # The layer the current callbacks act on (``LayerView``); None between layers.
    layer: "LayerView | None" = None
    next_position: torch.Tensor | None = None  # (P, 1): the first generated token's position; token g: + g
    # Leading prompt tokens whose keys and values came from the prefix cache (pipeline/prefix_cache.py):
    # no layer computed them for this request; ``active_per_layer`` holds the tokens after them.
    reused_tokens: int = 0
    # Whether this request may read and write the engine's caches (prefix, encoder): not when it is measured
    # against another run of the same prompt (Engine.start's ``caches``).
    caches: bool = True
    # (T,) bool on the model device: False for the visual tokens the policy had the vision encoder skip
    # (``Policy.skip_encoding``), which no decoder layer computes either; None when it skips none.
    encoded: torch.Tensor | None = None
    # During the prefill's layers: the active set the engine holds, its original indices and their modalities on
    # the host (the set is read from the device once, when a policy changes it). ``pruning.base.visual_in``
    # counts a set's visual tokens from it without a read of its own.
    host_active: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Asked before the vision encoder starts, before each block of its tower and before every decoder layer: True
    # stops the prefill there with ``PrefillInterrupted`` (Engine.start's ``interrupted``). A long video's prefill on
    # a CPU takes minutes; a client that left, or a server stopping, should not hold the model for all of it.
    interrupted: Callable[[], bool] | None = None


def _warn_if_greedy_with_sampling_settings(sampling: Sampling) -> None:
    """As transformers' ``generate`` warns: settings of sampling given to a greedy call are not read, and a notebook
    that set ``temperature=0.5`` (or a seed) without ``do_sample=True`` got the greedy answer without a word (an
    outside pass). ``glimpse ask`` refuses them without ``--sample``. ``sampling``: checked already."""
    given = [name for name, value, default in (("temperature", sampling.temperature, 1.0),
                                               ("top_p", sampling.top_p, 1.0), ("seed", sampling.seed, None))
             if value != default]
    if given and not sampling.do_sample:
        # Said at the caller's line, whichever of generate, stream or generate_batch it called (Python shows a
        # warning once per line: at a line of this file, a notebook saw it for its first call only).
        frame, level = sys._getframe(1), 2  # (1: this function; 2: the frame of its caller)
        while frame is not None and frame.f_code.co_filename == __file__:
            frame, level = frame.f_back, level + 1
        warnings.warn(f"{', '.join(given)} {'is' if len(given) == 1 else 'are'} read only with do_sample=True: "
                      "this answer is greedy", UserWarning, stacklevel=level)


def check_max_new_tokens(value) -> int:
    value = plain_number(value)  # (numpy's int64 too)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"max_new_tokens must be a whole number of at least 1, got {value!r}")
    return value


class EngineBusy(RuntimeError):
    """A call from the thread that holds the engine (a stream not read to its end) would wait on itself."""


class RequestCancelled(RuntimeError):
    """``generate`` with a ``cancel`` event that was set before the request's first token: it has no answer."""


class PrefillInterrupted(Exception):
    """A prefill stopped between two blocks of the vision tower or two decoder layers because its ``interrupted``
    said so (a client that left, a server past its shutdown grace): nothing of it is kept, and the engine is free
    for the next request."""


class OneCallAtATime:
    """The engine's lock: one call at a time (the model and its caches are shared), others wait. A call from the
    thread that holds it — ``stream`` read part of the way, then ``generate`` in the same thread — would wait for
    ever on itself: it is refused instead, saying so."""

    def __init__(self):
        self._lock = threading.Lock()
        self._owner: int | None = None

    def __enter__(self) -> "OneCallAtATime":
        if self._owner == threading.get_ident():
            raise EngineBusy("this engine is still answering a stream started in this thread: read it to its end, "
                             "or close() it, before the next call (an engine answers one call at a time)")
        self._lock.acquire()
        self._owner = threading.get_ident()
        return self

    def __exit__(self, *exc) -> None:
        self._owner = None
        self._lock.release()

    def locked(self) -> bool:
        return self._lock.locked()


@dataclass
class Request:
    """One conversation being answered: its prompt, its own policy object and caches, and clocks."""

    prompt: Prompt
    policy: Policy
    ctx: PrefillContext
    sampling: Sampling
    generator: torch.Generator | None
    budget: int  # new tokens allowed (max_new_tokens, capped by the context length)
    next_token: int | None  # chosen, not yet emitted (None while ``pending``)
    t_request: float
    t_prefill: float
    t_first: float
    detok: "_IncrementalDecoder"
    stop_ids: set[int]  # the EOS ids that end this answer (none when asked to ignore EOS)
    tokens: list[int] = field(default_factory=list)
    finish: str = "length"
    t_decode: float = 0.0  # decode starts (for a batch: once every request is prefilled)
    t_end: float = 0.0
    first_logits: torch.Tensor | None = None
    cancel: threading.Event | None = None  # set: stop before the next step (the client left)
    done: bool = False  # ended (``finish`` says why): takes no further step
    peak_memory: int = 0  # the highest reading of the memory meter after any of this request's steps
    t_queued: float | None = None  # when the request was submitted, if it waited for the engine (the scheduler)
    t_received: float | None = None  # when it arrived, before its prompt was built (the scheduler's; else t_queued)
    # The end of the prompt, not computed yet: the few tokens after a reused prefix, which the next decode step
    # computes beside the running batch (``Engine.start(defer=True)``); None once its first token is chosen.
    pending: "DecodeRows | None" = None
    host_position: list[int] | None = None  # ``ctx.next_position`` read to the host once (pipeline/decode_graph.py)
    error: Exception | None = None  # what ended it in a decode step (its policy's, or the step's); finish "error"
    short_of_memory: bool = False  # a decode step of it ran out of memory: ``Engine._passes`` says what follows
    claim: "PolicyClaim | None" = None  # of the caller's policy object, when it runs that object itself

    def note_memory(self, meter: MemoryMeter) -> None:
        self.peak_memory = max(self.peak_memory, meter.peak())


class PolicyClaim:
    """That a request runs a caller's policy object: held by the request (by ``Engine.start`` while it prefills),
    known to ``claim_policy`` through a weak reference, done once the request ends."""

    done = False


# id(policy object) -> the claim of the request running it, for every engine (an object may be given to two at once).
# Weak: an entry goes with its request; the object itself is left untouched (it may be copied or pickled).
_CLAIMS: "weakref.WeakValueDictionary[int, PolicyClaim]" = weakref.WeakValueDictionary()
_CLAIMS_LOCK = threading.Lock()


def claim_policy(policy: Policy) -> tuple[Policy, PolicyClaim]:
    """``policy`` itself for a request to run, or a fresh object of its settings when another request runs it now.
    A policy holds its request's state from ``plan`` on: one object given to two engines in two threads crossed
    two requests' states (IndexError, or FastV's other tokens without a word: an outside pass). Reused one request
    after another it stays the object itself, whose state (``halted``, ``telemetry``) its caller may read after."""
    claim = PolicyClaim()
    with _CLAIMS_LOCK:
        held = _CLAIMS.get(id(policy))
        if held is not None and not held.done:
            policy = policy.fresh()
        _CLAIMS[id(policy)] = claim  # the request's end (or its being dropped) frees the object
    return policy, claim


@dataclass
class DecodeRows:
    """The tokens one request computes in a decode step, sorted by original index: prompt tokens
    a policy revives on the way (LazyLLM), then the new token, always last."""

    index: torch.Tensor  # (r,) original token indices, on CPU
    modality: torch.Tensor  # (r,) on CPU
    positions: torch.Tensor  # (P, r) persistent positions
    hidden: torch.Tensor  # (1, r, d) the rows' hidden states entering the current layer

    @property
    def count(self) -> int:
        return int(self.index.shape[0])

    @classmethod
    def new_token(cls, embedding: torch.Tensor, ctx: PrefillContext) -> "DecodeRows":
        index = torch.tensor([len(ctx.prompt) + ctx.generated])
        return cls(index, torch.tensor([TEXT]), ctx.next_position + ctx.generated, embedding)

    def join(self, index: torch.Tensor, hidden: torch.Tensor, ctx: PrefillContext) -> "DecodeRows":
        """These rows plus prompt tokens ``index`` entering with ``hidden`` (n, d)."""
        index = torch.cat([self.index, index.cpu()])
        order = index.argsort()
        device = self.hidden.device
        positions = torch.cat([self.positions, ctx.positions[:, index[self.count:].to(device)]], dim=1)
        hidden = torch.cat([self.hidden, hidden.to(self.hidden.dtype)[None]], dim=1)
        return DecodeRows(index[order], torch.cat([self.modality, ctx.modality[index[self.count:]].cpu()])[order],
                          positions[:, order.to(device)], hidden[:, order.to(device)])

    def keep(self, rows: torch.Tensor) -> "DecodeRows":
        """Only the rows at positions ``rows`` (sorted; must include the new token, the last)."""
        on = rows.to(self.hidden.device)
        return DecodeRows(self.index[rows.cpu()], self.modality[rows.cpu()], self.positions[:, on],
                          self.hidden[:, on])


def attend_among(rows: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kernel,
                 mask: torch.Tensor | None) -> torch.Tensor:
    """Attention in which only ``rows`` (sorted positions) attend, and only to each other (ZipVL's important
    tokens): (1, n, heads, head_dim), zero for the other rows (their FFN still runs; their keys and values are
    in the cache all the same). ``query`` (1, heads, n, head_dim), ``key``/``value`` (1, kv_heads, n, head_dim)."""
    # The queries are taken and the output put back token-major ((1, n, heads, head_dim): the projections' layout,
    # where a row is one contiguous block), not along the strided token axis of their head-major view; the cache's
    # keys and values are head-major.
    n = query.shape[2]
    out = query.new_zeros(1, n, query.shape[1], query.shape[3])
    query = query.transpose(1, 2).index_select(1, rows).transpose(1, 2)
    return out.index_copy_(1, rows, kernel(query, key.index_select(2, rows), value.index_select(2, rows), mask))


@dataclass
class PrefillLayer:
    """One prefill layer of one request (a ``pipeline.attention.LayerCall``): the active tokens'
    keys and values go into the request's cache, the policy sees the layer's queries and keys and
    picks which rows attend (all, or ZipVL's important ones), and it gets the attention output."""

    engine: "Engine"
    policy: Policy
    ctx: PrefillContext
    layer_idx: int

    def attend(self, module, query, key, value, kernel) -> torch.Tensor:
        ctx, engine = self.ctx, self.engine
        key, value = ctx.cache.update(key, value, self.layer_idx)
        active = ctx.active_per_layer[self.layer_idx]
        ctx.layer = LayerView(self.layer_idx, active, ctx.modality[active], query, key, module.scaling)
        rows = self.policy.attention_rows(self.layer_idx, ctx)
        ctx.attention_per_layer.append(None if rows is None else active[rows])
        n = query.shape[2]
        if rows is None:  # ``key`` may begin with a reused prefix's entries, which every row sees
            return kernel(query, key, value, engine._causal_mask(n, query.dtype, past=key.shape[2] - n))
        return attend_among(rows, query, key, value, kernel, engine._causal_mask(rows.shape[0], query.dtype))

    def attention_output(self, output: torch.Tensor) -> None:
        self.policy.score(self.layer_idx, output, self.ctx)


@dataclass
class DecodeLayer:
    """One decode layer of a batch of requests (a ``pipeline.attention.LayerCall``): the rows of all
    requests go through the layer's token-wise work together; attention runs per request, over that
    request's own cache."""

    engine: "Engine"
    requests: list["Request"]
    batch: list[DecodeRows]
    layer_idx: int
    # The KV slot groups of the first requests (each group's members in turn, one row each), if any.
    groups: Sequence[BatchKV]

    def attend(self, module, query, key, value, kernel) -> torch.Tensor:
        outputs, start = [], 0
        for group in self.groups:  # one call for each group's members
            part = slice(start, start + len(group.members))
            outputs.append(group.attend(self.layer_idx, query[:, :, part], key[:, :, part], value[:, :, part],
                                        kernel, module.scaling))
            for i, request in enumerate(group.members, start=start):
                if request.policy.scores_in_decode():  # it attended to every entry its layer holds
                    layer_kv = request.ctx.cache.layers[self.layer_idx]
                    self.engine.decode_score(self.layer_idx, module, query[:, :, i:i + 1], self.batch[i], request,
                                             layer_kv.keys_values()[0], layer_kv.index)
            start = part.stop
        for request, rows in zip(self.requests[start:], self.batch[start:]):
            part = slice(start, start + rows.count)
            outputs.append(self.engine.decode_attention(self.layer_idx, module, query[:, :, part], key[:, :, part],
                                                        value[:, :, part], rows, request, kernel))
            start += rows.count
        return torch.cat(outputs, dim=1) if len(outputs) > 1 else outputs[0]

    def attention_output(self, output: torch.Tensor) -> None:
        pass


class Engine:
    def __init__(self, adapter: Adapter, *, model_id: str, chat_template: str | None = None,
                 grounded: bool = True):
        self.adapter = adapter
        self.model = adapter.model
        self.tokenizer = adapter.tokenizer
        self.model_id = model_id
        self.chat_template = chat_template
        self.grounded = grounded  # False for the embedded model until its projector is trained
        self.device = self.adapter.embed_tokens.weight.device
        self.dtype = self.adapter.embed_tokens.weight.dtype
        # Each layer runs its own forward; attention goes through pipeline/attention.py's function,
        # which runs this kernel ("sdpa", "eager", "flash_attention_2") over what the engine chose.
        self.attn_implementation = attention.install(self.adapter.text_config)
        attention.hook_attention_outputs(layer.self_attn for layer in self.adapter.layers)
        self.max_length, self.attention_window = self.adapter.max_length, self.adapter.attention_window
        self.eos_token_ids = _eos_ids(self.model, self.tokenizer)
        self._lock = OneCallAtATime()  # one request at a time: the model and its caches are shared
        # Prompts are built in the submitters' threads (a server's), several at once: the tokenizer they share
        # works for one at a time (a Rust tokenizer used from two threads can fail "Already borrowed"), while
        # decoding their media runs side by side (``prepare``).
        self._tokenizing = threading.Lock()
        # Run the vision encoder beside the layers that need no visual token (late injection);
        # False runs it first, always. On GPU the two overlap on two streams. On a CPU they would share the
        # same cores, and the worker thread's OpenMP team would slow every later kernel of this thread:
        # the encoder first measured 12-19% sooner to the first token there, and decode kept its speed
        # (docs/benchmarks.md, "Decode on a CPU").
        self.parallel_vision = self.device.type == "cuda"
        # Where it runs: one worker thread and (on GPU) one side stream for the engine's life, made on first use,
        # not a thread and a stream per request (each new thread or stream sets up its own library handles and
        # workspaces on the GPU).
        self._vision_worker: ThreadPoolExecutor | None = None
        self._vision_stream = None
        # Calibrated parameters per policy name (HiDivDrop's filtering layers from an ILVAS profile),
        # applied to every policy this engine builds by name; explicit overrides win.
        self.profiles: dict[str, dict] = {}
        # The identity of the weights (``profiles.checkpoint_identity``; ``load_engine`` sets it):
        # what a stored profile must have been measured on to apply.
        self.checkpoint: str = model_id
        # What ``auto`` runs at each speed: this model's calibrated frontier (``glimpse calibrate
        # slider``), the shipped one for the embedded model, or the uncalibrated default.
        self.frontier: Frontier = uncalibrated_frontier()
        # The vision encoder's outputs for recent media (pipeline/encoder_cache.py): off unless given a size
        # (``glimpse serve`` gives one), so that measurements always pay for the encoder.
        self.encoder_cache = EncoderCache(max_bytes=0)
        # Recent images and videos decoded and preprocessed (pipeline/media_cache.py), keyed by a digest of their
        # bytes: a chat's follow-up turns send them again. Off unless given a size (``glimpse serve`` gives one).
        self.media_cache = MediaCache(max_bytes=0)
        # Keys and values of recent unpruned prompts (pipeline/prefix_cache.py): an unpruned prompt that starts
        # like one of them prefills only the rest. Off unless given a size (``glimpse serve`` gives one).
        self.prefix_cache = PrefixCache(max_bytes=0)
        # The KV slot groups of the requests decoding together (pipeline/batch_kv.py), between the steps of a
        # batch; False decodes every request on its own cache (for measuring what the slots gain).
        self.decode_slots = True
        self.slot_groups: list[BatchKV] = []
        # Slot steps in which no policy acts run as one fixed-shape step (pipeline/decode_graph.py), captured as a
        # CUDA graph. On by default on a GPU: an H100 decoded 2.2x as many tokens/s as ``generate`` at batch 1
        # with it (1.0x without), the same tokens for every architecture (docs/benchmarks.md). Off on a CPU,
        # where the fixed-shape step only costs (it attends over each slot's whole room); the tests turn it on.
        self.decode_graphs = self.device.type == "cuda"
        self.decode_graph_error: str | None = None  # why a capture failed (and turned the graphs off), if one did

    # ------------------------------------------------------------------ public API
    def generate(self, messages, **kwargs) -> GenerationResult:
        """``stream``'s result. A ``cancel`` event set before the first token raises ``RequestCancelled``."""
        for chunk in self.stream(messages, **kwargs):
            if chunk.result is not None:
                return chunk.result
        raise RequestCancelled("the request was cancelled before its first token: it has no answer")

    def stream(self, messages, *, policy: str | Policy = "auto", speed: float = 0.0, max_new_tokens: int = 128,
               do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
               seed: int | None = None, ignore_eos: bool = False,
               cancel: threading.Event | None = None) -> Iterator[StreamChunk]:
        """``ignore_eos``: decode exactly ``max_new_tokens`` (benchmarks and evaluations). ``cancel``: once
        set (a client that left), the request stops before its next step — or before prefill, if it was
        still waiting for the model — and the model is free for the next one; its result, if any, says
        ``finish_reason == "cancelled"``; cancelled before it began or during its prefill (which stops before the next
        block of the vision tower or the next decoder layer), the stream yields nothing. One call at a time
        per engine: other threads wait; a call from the thread of a stream not read to its end raises
        ``EngineBusy``."""
        if cancel is not None and not callable(getattr(cancel, "is_set", None)):  # True was an AttributeError
            raise UserError(f"cancel takes a threading.Event (set it to stop the answer), got {type(cancel).__name__}")
        sampling = Sampling(do_sample, temperature, top_p, seed)
        _warn_if_greedy_with_sampling_settings(sampling)
        with self._lock:
            if cancel is not None and cancel.is_set():
                return  # gave up while waiting: nothing computed
            yield from self._stream(messages, policy, speed, max_new_tokens, sampling, ignore_eos, cancel)

    def generate_batch(self, conversations: list, *, policy: str | Policy = "auto", speed: float = 0.0,
                       max_new_tokens: int = 128, do_sample: bool = False, temperature: float = 1.0,
                       top_p: float = 1.0, seed: int | None = None, ignore_eos: bool = False) -> list[GenerationResult]:
        """Answer several conversations at once (batch captioning): each is prefilled on its own,
        with its own policy object, then all decode together — every decode step computes the new
        tokens of all unfinished requests in one pass through the weights. Results equal answering
        them one by one."""
        if not isinstance(conversations, (list, tuple)):  # a string would be answered letter by letter
            raise PromptError(f"conversations must be a list of conversations, got {type(conversations).__name__}")
        sampling = Sampling(do_sample, temperature, top_p, seed)
        _warn_if_greedy_with_sampling_settings(sampling)
        with self._lock, torch.inference_mode():
            meter = MemoryMeter(self.device)
            requests = []
            for number, messages in enumerate(conversations):
                # A Policy object given here is a template: each request gets its own copy.
                own = copy.deepcopy(policy) if isinstance(policy, Policy) else policy
                try:
                    requests.append(self.start(messages, own, speed, max_new_tokens, sampling, ignore_eos))
                except UserError as error:  # which one (of several): the same error, naming its conversation
                    if len(conversations) == 1:
                        raise
                    raise type(error)(f"conversation {number} (from 0): {error}") from error
            for _ in self._decode_loop(requests, meter):
                pass
            return [self._result(request, batch_size=len(requests)) for request in requests]

    def vision_worker(self) -> tuple[ThreadPoolExecutor, "torch.cuda.Stream | None"]:
        """The vision encoder's worker thread and side stream (None on CPU), made on first use."""
        if self._vision_worker is None:
            if self.device.type == "cuda":
                self._vision_stream = torch.cuda.Stream(self.device)
            self._vision_worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="glimpse-vision")
        return self._vision_worker, self._vision_stream

    def make_policy(self, name: str, speed: float = 0.0, overrides: dict | None = None) -> Policy:
        """A registry policy for this model (``auto``: the configuration its frontier selects at
        ``speed``): its calibration profile, then ``overrides``, which win."""
        policy = make_policy(name, speed, overrides, frontier=self.frontier)  # a bad name or override fails here
        explicit = dict(overrides or {})
        if name == "auto":  # the chosen configuration's own parameters are as explicit as overrides
            point = self.frontier.choose(speed)
            explicit.update(_member_params(point.members if point else ()))
        policy = self._with_profiles(policy, explicit)
        policy.check(len(self.adapter.layers))  # before a picture is decoded for it
        return policy

    def configuration(self, members) -> Policy:
        """A frontier configuration (``pruning.frontier.Member`` list) for this model, with its
        calibration profile applied as ``auto`` applies it: calibration measures what ``auto`` runs.
        A parameter a member sets itself wins over the profile."""
        return self._with_profiles(configuration(members), _member_params(members))

    def _with_profiles(self, policy: Policy, overrides: dict) -> Policy:
        """``policy`` (or each member of a pipeline) with this model's calibrated parameters (HiDivDrop's
        ILVAS filtering layers), except those ``overrides`` set explicitly ("param" or "member.param")."""
        for member in getattr(policy, "policies", (policy,)):
            for param, value in self.profiles.get(member.name, {}).items():
                if param not in overrides and f"{member.name}.{param}" not in overrides:
                    setattr(member, param, value)
        return policy

    def promise(self, name: str, speed: float, overrides: dict | None = None) -> dict:
        """What ``name`` at ``speed`` is measured to keep on this model, before anything is asked:
        for ``auto`` the frontier's promise, for a named policy what calibration measured of it."""
        speed = plain_number(speed)  # (numpy's: the promise is JSON)
        promise = self.frontier.promise(speed) if name == "auto" else self.frontier.promise_for(name, speed)
        if overrides:  # the measured numbers are of the configuration as the slider set it
            promise = {**promise, "overridden": sorted(overrides),
                       "text": f"parameters overridden ({', '.join(sorted(overrides))}): not the measured "
                               f"configuration; as measured: {promise['text']}"}
        return promise

    def kv_bytes_per_token(self) -> int:
        """What one token's keys and values take over all layers, unpruned and unquantized: the unit of
        the server's KV budget."""
        kv_heads, head_dim = self.adapter.kv_heads_and_dim
        return 2 * len(self.adapter.layers) * kv_heads * head_dim * self.dtype.itemsize

    def prepare(self, messages, caches: bool = True,
                reading: contextlib.AbstractContextManager | None = None) -> Prompt:
        """The prompt of ``messages``; ``caches=False``: every image and video decoded again (no media cache).
        Several threads may build prompts at once: their media are read side by side, the tokenizer works for one at a
        time. ``reading``: entered around the reading of the media, if any (a server's limits on it)."""
        return build_prompt(self.adapter, messages, self.chat_template, self.max_length,
                            self.media_cache if caches else None, self._tokenizing, reading)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()  # on a generator: entered around every resume, not across the caller's code
    def _stream(self, messages, policy, speed, max_new_tokens, sampling, ignore_eos, cancel) -> Iterator[StreamChunk]:
        meter = MemoryMeter(self.device)
        try:
            request = self.start(messages, policy, speed, max_new_tokens, sampling, ignore_eos,
                                 interrupted=cancel.is_set if cancel is not None else None)
        except PrefillInterrupted:
            return  # cancelled during its prefill: no token was chosen, as if cancelled before it began
        request.cancel = cancel
        for _, token in self._decode_loop([request], meter):
            yield StreamChunk(request.detok.push(token), token)
        yield StreamChunk(request.detok.flush(), None, self._result(request))

    def start(self, messages, policy, speed, max_new_tokens, sampling, ignore_eos=False,
              caches: bool = True, defer: bool = False, interrupted: Callable[[], bool] | None = None) -> "Request":
        """Prefill one request and pick its first token. ``messages`` may be a ``Prompt`` already built.
        ``caches=False``: no cache is read or written — media, encoder, prefix: an answer measured against another
        answer to the same prompt (the chat's "compare") computes everything, as the other one does.
        ``defer=True`` (the scheduler): when all but a few text tokens of an unpruned prompt are in the prefix
        cache, those few are not prefilled here, in a pass of their own, but by the next ``decode_step``, in the
        pass it makes for the running batch anyway; the request has no first token until then.
        ``interrupted``: asked before the vision encoder starts, before each block of its tower the adapter names
        (``Adapter.vision_blocks``) and before each decoder layer; once it says True the prefill stops there and
        raises ``PrefillInterrupted``."""
        t_request = time.perf_counter()
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        claim = None
        if isinstance(policy, Policy):
            policy.check(len(self.adapter.layers))  # given as it is: checked before its media are decoded
            policy, claim = claim_policy(policy)
        else:
            policy = self.make_policy(policy, speed)  # checks it
        prompt = messages if isinstance(messages, Prompt) else self.prepare(messages, caches)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(sampling.seed)
        try:
            request, tried = attempt(lambda: self._prefill_request(prompt, policy, max_new_tokens, sampling, generator,
                                                                  ignore_eos, caches, defer, t_request, interrupted))
            if request is None:
                counts = [f"{n:,} {kind}" for kind, n in prompt.token_counts().items() if n]
                counts = " and ".join([", ".join(counts[:-1]), counts[-1]] if len(counts) > 1 else counts)
                raise OutOfMemory(f"out of {self._memory_name()} memory prefilling this prompt of {counts} "
                                  f"tokens{tried}: a shorter video, fewer or smaller images or a shorter conversation "
                                  "need less (beside other requests, it may fit once they end)")
        except BaseException:
            if claim is not None:  # nothing runs the object now (a traceback kept somewhere would have held it)
                claim.done = True
            raise
        request.claim = claim
        return request

    def _prefill_request(self, prompt, policy, max_new_tokens, sampling, generator, ignore_eos, caches, defer,
                         t_request, interrupted) -> "Request":
        t_prefill = time.perf_counter()
        stop_ids = set() if ignore_eos else self.eos_token_ids
        ctx, spans = self._prefill_context(prompt, policy, caches)
        if defer and (rows := self._deferred_rows(ctx, spans)) is not None:  # a decode step computes it; no one asks
            return Request(prompt, policy, ctx, sampling, generator, self._budget(max_new_tokens, ctx), None,
                           t_request, t_prefill, 0.0, _IncrementalDecoder(self.tokenizer), stop_ids, pending=rows)
        ctx.interrupted = interrupted
        try:
            logits = self._prefill_layers(prompt, policy, ctx, spans)
        finally:
            # Only the prefill asks it. Kept, it closed a reference cycle (the scheduler's ``interrupted`` holds the
            # ticket, which holds this request and so its context), which kept every served request's prefill hidden
            # states (on a GPU, 117 MB for a 16K-token Qwen2-VL-7B prompt) until Python's next full garbage collection.
            ctx.interrupted = None
        token = sampling.next(logits, generator)
        synchronize(self.device)
        t_first = time.perf_counter()
        return Request(prompt, policy, ctx, sampling, generator, self._budget(max_new_tokens, ctx), token, t_request,
                       t_prefill, t_first, _IncrementalDecoder(self.tokenizer), stop_ids, first_logits=logits)

    def _budget(self, max_new_tokens: int, ctx: PrefillContext) -> int:
        budget = max_new_tokens
        if self.max_length is not None:
            budget = min(budget, self.max_length - int(ctx.positions.max()) - 1)  # positions the model knows
        if self.attention_window is not None:  # the whole sequence within one window (Qwen's positions count less)
            budget = min(budget, self.attention_window - len(ctx.prompt))
        return budget

    # A prompt's end computed in a decode step: at most this many tokens, so that a step stays a step.
    DEFERRED_TOKENS = 64

    def _deferred_rows(self, ctx: PrefillContext, spans) -> "DecodeRows | None":
        """The rest of a prompt whose prefix came from the prefix cache, as decode rows, when it is at most
        ``DEFERRED_TOKENS`` tokens, all text; otherwise None (the layer loop prefills it)."""
        start, T = ctx.reused_tokens, len(ctx.prompt)
        if start == 0 or T - start > self.DEFERRED_TOKENS or any(span.end > start for span in spans):
            return None
        rest = torch.arange(start, T)
        ctx.active_per_layer = [rest.to(self.device)] * ctx.num_layers  # what the step will compute in each layer
        return DecodeRows(rest, ctx.prompt.modality[start:].cpu(), ctx.positions[:, start:], ctx.hidden[:, start:])

    def _prompt_done(self, request: "Request", logits: torch.Tensor) -> None:
        """A deferred prompt's end was computed by this decode step: its first token, clocks and cache entry."""
        request.pending = None
        request.next_token = request.sampling.next(logits, request.generator)
        request.first_logits = logits
        synchronize(self.device)
        request.t_first = request.t_decode = time.perf_counter()
        self.prefix_cache.put(request.prompt.input_ids, request.ctx.positions, media_spans(request.prompt),
                              request.ctx.cache)

    def _decode_loop(self, requests: list["Request"], meter: MemoryMeter) -> Iterator[tuple["Request", int]]:
        """Yield each request's tokens as they are chosen; decode all unfinished requests together."""
        running = list(requests)
        for request in requests:
            request.t_decode = time.perf_counter()  # after every request's prefill
            request.note_memory(meter)
        try:
            while running:
                for request in running:
                    token = self.take_token(request)
                    if token is not None:
                        yield request, token
                running = [request for request in running if not request.done]
                if running:
                    self.decode_step(running)
                    for request in running:
                        request.note_memory(meter)
        finally:  # ended, failed, or its consumer left (a closed stream): the slots go with the batch
            self.batch_ended()

    def take_token(self, request: "Request") -> int | None:
        """Append the request's chosen token to its answer and return it, or end the request (cancelled,
        EOS, out of budget) and return None. A request whose answer reaches its budget ends with it.
        A request that failed in a decode step raises its error here, to its own caller only."""
        if request.error is not None:
            error, request.error = request.error, None
            try:
                raise error
            finally:  # held by the request or this frame, both in the error's traceback: a reference cycle
                del error
        if request.cancel is not None and request.cancel.is_set():
            self.finish(request, "cancelled")
        elif request.pending is not None:  # its prompt's end is computed in the next step: no token yet
            return None
        elif request.next_token in request.stop_ids:
            self.finish(request, "stop")
        elif len(request.tokens) < request.budget:
            request.tokens.append(request.next_token)
            if len(request.tokens) >= request.budget:
                self.finish(request, "length")
            return request.tokens[-1]
        else:
            self.finish(request, "length")
        return None

    def finish(self, request: "Request", reason: str) -> None:
        """End ``request`` here ("stop", "length", "cancelled", "error"): it takes no further decode step."""
        synchronize(self.device)
        request.finish, request.done, request.t_end = reason, True, time.perf_counter()
        if request.claim is not None:  # its policy object may answer another request now
            request.claim.done = True
        if request.pending is not None:  # ended before the step that was to compute its prompt's end
            request.pending, request.t_first = None, request.t_end

    def decode_step(self, running: list["Request"]) -> bool:
        """One decode step of every request in ``running`` together: each policy acts on its own cache
        first (evict / pack), then one pass through the weights picks each request's next token.

        Returns whether memory ran out on the way. A pass that runs out of memory is undone and run again in
        smaller parts (``_passes``), so that it ends only the requests whose step cannot be undone or that do not
        fit even alone; those end with ``OutOfMemory`` (``take_token`` raises it to their callers)."""
        t_step = time.perf_counter()
        for request in running:
            if request.pending is None:
                try:
                    request.policy.decode_step(len(request.tokens), request.ctx)  # evict / pack KV before the step
                except Exception as error:  # noqa: BLE001 — this request's policy failed: it alone ends
                    request.error = self._out_of_memory_said(error, "packing or evicting this request's KV cache")
                    self.finish(request, "error")
        running = [request for request in running if not request.done]
        if not running:
            return False
        for request in running:
            if request.pending is None:
                request.ctx.kv_bytes_per_step.append(request.ctx.cache.nbytes())  # what this step attends to
                request.ctx.visual_kv_per_step.append(request.ctx.cache.visual_entries())
        passes, ran_out = self._passes(running)
        decoded = []
        for requests, decoding, logits in passes:
            for request, row, decodes in zip(requests, logits, decoding):
                if not decodes:
                    self._prompt_done(request, row)
                    continue
                request.ctx.generated += 1
                request.next_token = request.sampling.next(row, request.generator)  # reads the device: synced
                decoded.append(request)
        seconds = time.perf_counter() - t_step
        for request in decoded:
            request.ctx.step_s.append(seconds)
            request.ctx.step_tokens.append(len(decoded))
        return ran_out

    # After a step ran out of memory, its requests (``Request.short_of_memory``) and those decoding beside them
    # decode without KV slots (forming them copies every request's cache) and at most ``pass_limit`` requests per
    # pass, until none of them is left: ``_passes`` sets this, ``batch_ended`` clears it. A server that is never
    # idle gets its slots back too. (A flag on the request, not a set of their ``id``s: an ended request's id may
    # be a new request's.)
    pass_limit: int | None = None

    def _passes(self, running: list["Request"]) -> tuple[list[tuple[list, list, torch.Tensor]], bool]:
        """The step's passes through the model, each (requests in the logits' row order, whether each decodes,
        logits), and whether memory ran out. Usually one pass. One that runs out of memory is undone for each of its
        requests whose step can be (``_undoable``; the others end with ``OutOfMemory``) and run again: without KV
        slots, then in halves, down to one request, which ends if it does not fit alone. The parts that fit set
        how many requests a pass takes until the batch ends (``pass_limit``): not one failed pass per step."""
        short = any(request.short_of_memory for request in running)
        if self.pass_limit is not None and not short:
            self.batch_ended()  # the requests that ran out of memory have all ended
        limit = self.pass_limit or len(running)
        todo = [running[i:i + limit] for i in range(0, len(running), limit)]
        passes, ran_out = [], False
        while todo:
            part = todo.pop(0)
            saved = {id(r): r.pending.hidden for r in part if r.pending is not None}  # decode() moves them on
            passed, tried = attempt(lambda: self._decode_pass(part, slots=self.decode_slots and not short))
            if passed is not None:
                passes.append(passed)
                continue
            with_slots = self.decode_slots and not short and any(decodes_plainly(r) for r in part)
            ran_out, short, self.slot_groups = True, True, []
            for request in part:
                request.short_of_memory = True
            if not with_slots:  # it failed in a pass as small as it gets with this many: fewer from now on
                self.pass_limit = min(self.pass_limit or len(part), (len(part) + 1) // 2)
            undone = []
            for request in part:
                request.ctx.layer = None
                if request.pending is not None:
                    request.pending.hidden = saved[id(request)]
                if self._undoable(request):
                    request.ctx.cache.undo_append(request.pending.index if request.pending is not None
                                                  else torch.tensor([len(request.ctx.prompt) + request.ctx.generated]))
                    undone.append(request)
                    continue
                request.error = OutOfMemory(f"out of {self._memory_name()} memory decoding {len(part)} request"
                                            f"{'s' * (len(part) > 1)} together{tried}: fewer at once need less "
                                            "(glimpse serve --max-batch, glimpse caption --batch-size)")
                self.finish(request, "error")
            if with_slots and undone:  # without the slots' copies of their caches, it may fit
                todo.insert(0, undone)
            elif len(undone) > 1:
                half = (len(undone) + 1) // 2
                todo[:0] = [undone[:half], undone[half:]]
            elif undone:
                undone[0].error = OutOfMemory(f"out of {self._memory_name()} memory decoding this request, even on "
                                              f"its own{tried}: a shorter prompt or answer needs less (beside other "
                                              "requests, it may fit once they end)")
                self.finish(undone[0], "error")
        return passes, ran_out

    def _undoable(self, request: "Request") -> bool:
        """Whether a failed pass can be undone for ``request``: it appended the step's entries to its cache and
        changed nothing else. Not so for a policy that revives prompt tokens in decode (LazyLLM: its revived
        tokens' hidden states leave the aux cache) or whose step scores and packs KV (ZipVL filling a window)."""
        policy = request.policy
        return not policy.implements("decode_rows") and not (policy.implements("decode_score")
                                                            and policy.scores_in_decode())

    def _out_of_memory_said(self, error: Exception, work: str) -> Exception:
        """``error`` as ``OutOfMemory`` when it is an allocation that failed (``work``: what failed), else itself."""
        if not is_out_of_memory(error):
            return error
        return OutOfMemory(f"out of {self._memory_name()} memory {work}{tried_to_allocate(error)}")

    def batch_ended(self) -> None:
        """The requests decoding together all ended: their KV slots go, and a shortage of memory they met with it."""
        self.slot_groups, self.pass_limit = [], None

    def _decode_pass(self, running: list["Request"], slots: bool):
        """The step's pass through the model: (requests in the logits' row order, whether each decodes, logits).
        ``slots``: whether requests that can share one attention call per layer go first, in their slot groups
        (pipeline/batch_kv.py)."""
        candidates = [request for request in running if slots and decodes_plainly(request)]
        groups = serve_step(self.slot_groups, candidates)
        if groups is None:
            self.slot_groups = []  # the old slots go before the new ones are made
            groups = form_groups(candidates)
        self.slot_groups = groups
        in_slots = [request for group in groups for request in group.members]  # the step's first rows, in order
        if self.decode_graphs and fixed_shape_step(running, groups):
            first = groups[0]  # it keeps the step (its graph) while the groups stay the same
            if first.fixed_step is None or not first.fixed_step.serves(groups):
                first.fixed_step = SlotStep(groups, positions_rows=running[0].ctx.next_position.shape[0])
            return in_slots, [True] * len(in_slots), first.fixed_step.run(self, groups)
        if groups:
            members = {id(request) for request in in_slots}
            running = in_slots + [request for request in running if id(request) not in members]
        decoding = [request.pending is None for request in running]
        return running, decoding, self.decode(running, groups)

    def _memory_name(self) -> str:
        return {"cuda": "GPU"}.get(self.device.type, self.device.type.upper())

    def _result(self, request: "Request", batch_size: int = 1) -> GenerationResult:
        synchronize(self.device)
        metrics = self._metrics(request, batch_size)
        text = self.tokenizer.decode(request.tokens, skip_special_tokens=True)
        policy = request.policy
        return GenerationResult(text, request.tokens, metrics, policy.name, policy.params(), request.finish,
                                policy.summary(), request.first_logits,
                                [item.warning for item in request.prompt.media if item.warning])

    def embed_prompt(self, prompt: Prompt, encoded: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with the vision encoder's output written over the placeholder tokens (over those
        ``encoded`` marks, the others left as they are: see ``encode_media``)."""
        embeds = self.adapter.embed_tokens(prompt.input_ids.to(self.device))[None]  # (1, T, d)
        for rows, features, _ in self.encode_media(prompt, encoded=encoded):
            embeds[0, rows] = features
        return embeds

    def encode_media(self, prompt: Prompt, caches: bool = True, encoded: torch.Tensor | None = None,
                     ) -> list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]]:
        """The vision encoder + projector, per modality: the placeholder rows, one feature row each,
        and per decoder layer what the architecture adds to those rows after it (DeepStack; usually none).
        ``encoded`` (one bool per prompt token, ``PrefillContext.encoded``): only the placeholder rows it marks
        are encoded and returned. Media encoded before are taken from ``encoder_cache`` when it is on (a chat's
        follow-up turns) and ``caches`` allows it."""
        out = []
        encoded = encoded.cpu() if encoded is not None else None
        for kind in (IMAGE, VIDEO):
            items = [m for m in prompt.media if m.kind == kind]
            if not items:
                continue
            rows = (prompt.modality == kind).nonzero().squeeze(1)
            keep = encoded[rows] if encoded is not None else None
            if keep is not None and bool(keep.all()):
                keep = None
            elif keep is not None and not bool(keep.any()):
                continue  # every token of this kind skipped: nothing to encode
            key = media_key(items, keep) if self.encoder_cache.max_bytes and caches else None
            cached = self.encoder_cache.get(key) if key is not None else None
            if cached is None:
                features, layers = self.adapter.encode_with_layers(prompt.media, kind, keep)
                features, layers = features.to(self.device, self.dtype), [f.to(self.device, self.dtype) for f in layers]
                if key is not None:
                    self.encoder_cache.put(key, (features, layers))
            else:
                features, layers = cached
            rows = (rows if keep is None else rows[keep]).to(self.device)
            if features.shape[0] != rows.shape[0]:
                raise RuntimeError(f"encoder gave {features.shape[0]} features for {rows.shape[0]} placeholders")
            out.append((rows, features, layers))
        return out

    def check_prompt(self, prompt: Prompt) -> None:
        """Refuse a ``Prompt`` built by another model's engine: its token ids and media tensors mean something else
        here (they failed deep in the prefill with a KeyError, or ran as other tokens)."""
        if prompt.made_for and prompt.made_for != self.adapter.prompt_signature:
            raise PromptError(f"this prompt was built for another model ({prompt.made_for.split(':')[0]}, whose "
                              "tokenizer, image processor or vision settings differ from this engine's "
                              f"{self.adapter.name}): build it with this engine's prepare(messages), or pass the "
                              "messages")

    def prefill(self, prompt: Prompt, policy: Policy, caches: bool = True) -> tuple[torch.Tensor, PrefillContext]:
        ctx, spans = self._prefill_context(prompt, policy, caches)
        return self._prefill_layers(prompt, policy, ctx, spans), ctx

    def _prefill_context(self, prompt: Prompt, policy: Policy, caches: bool) -> tuple[PrefillContext, list | None]:
        """The request's context (embeddings, positions, an empty cache, the policy's plan) and, where the
        prefix cache applies, its media spans, with the cache seeded from the longest cached prefix.
        ``caches=False``: neither the prefix cache nor (when the encoder runs) the encoder's is used."""
        self.check_prompt(prompt)
        input_ids = prompt.input_ids.to(self.device)
        hidden = self.adapter.embed_tokens(input_ids)[None]  # (1, T, d)
        positions = self.adapter.positions(input_ids, prompt.modality, prompt.media)
        num_layers = len(self.adapter.layers)
        ctx = PrefillContext(prompt, self.adapter, prompt.modality.to(self.device), positions, hidden,
                             KVCache(num_layers), num_layers,
                             next_position=positions.max(dim=1, keepdim=True).values + 1, caches=caches)
        policy.check(num_layers)  # a bad parameter (a layer past this model's last) fails here, before any work
        policy.plan(ctx)
        skipped = policy.skip_encoding(ctx) if prompt.media else None
        if skipped is not None and skipped.numel():
            ctx.encoded = torch.ones(input_ids.shape[0], dtype=torch.bool, device=self.device)
            ctx.encoded.index_fill_(0, skipped.to(self.device), False)
        spans = None
        if caches and self.prefix_cache.max_bytes and prunes_nothing(policy):
            spans = media_spans(prompt)
            self._reuse_prefix(prompt, spans, ctx)
        return ctx, spans

    def _prefill_layers(self, prompt: Prompt, policy: Policy, ctx: PrefillContext, spans) -> torch.Tensor:
        """The decoder layers over the prompt from the first token not reused; the next-token logits."""
        cos, sin = self.adapter.rotary(ctx.hidden, ctx.positions)
        # The vision encoder starts now, beside the layer loop; the loop joins it before the first
        # layer that computes a visual token (layer 0 unless a policy injects vision late). Media wholly
        # inside a reused prefix are not encoded again.
        start = ctx.reused_tokens
        needs_vision = bool(prompt.media) and (start == 0 or any(span.end > start for span in spans))
        _stop_if_interrupted(ctx)  # before the encoder starts (which then asks before each of its blocks)
        vision = (VisionJob(self, prompt, parallel=self.parallel_vision, caches=ctx.caches, encoded=ctx.encoded,
                            interrupted=ctx.interrupted)
                  if needs_vision else None)
        try:
            logits = self._layers(ctx.hidden, cos, sin, policy, ctx, vision, start)
        finally:
            if vision is not None:
                vision.wait()  # never leave the encoder running on a failed request
                # The encoder's error, raised at the join or never joined (the prefill stopped first), goes now. Kept
                # on the job, whose frames its traceback holds, it was a reference cycle, which kept the prefill's
                # hidden states (GPU memory) until Python's next full garbage collection: a client leaving during the
                # vision encoder ends its prefill this way.
                vision.error = None
        if spans is not None:
            self.prefix_cache.put(prompt.input_ids, ctx.positions, spans, ctx.cache)
        return logits

    def _reuse_prefix(self, prompt: Prompt, spans, ctx: PrefillContext) -> None:
        """Seed the request's cache with the entries of the longest prefix it shares with a cached prompt."""
        found = self.prefix_cache.lookup(prompt.input_ids, ctx.positions, spans)
        if found is None:
            return
        entry, shared = found
        records = torch.arange(shared)
        for layer, key, value in zip(ctx.cache.layers, entry.keys, entry.values):
            # Views of the entry: the request's first new entries are written into a copy (cache.Growing),
            # never into the entry itself.
            layer.append(key.narrow(-2, 0, shared), value.narrow(-2, 0, shared))
            layer.add_records(records, prompt.modality[:shared])
        ctx.reused_tokens = shared

    def _layers(self, hidden, cos, sin, policy, ctx, vision, start: int = 0) -> torch.Tensor:
        """The decoder layers over the prompt from token ``start`` on (the tokens before it come from the
        prefix cache, already in every layer's cache)."""
        T = hidden.shape[1]
        active = torch.arange(start, T, device=self.device)
        if ctx.encoded is not None:  # the visual tokens the encoder skipped enter no layer
            active = active[ctx.encoded[start:]]
        # The active set and its modalities on the host too, for the cache's token records and the vision
        # check: read from the device only when a policy changes the set. A read waits for the GPU to finish
        # every layer queued before it, so reading at every layer left the GPU idle while the host queued the
        # next one (an H100 profile of a 7B prefill counted twice transformers' host syncs; docs/benchmarks.md).
        # Writing a Python value through a tensor index (``fresh[active] = False``) waits the same way: on a GPU
        # the value becomes a host tensor, copied from pageable memory, which synchronizes; ``index_fill_`` takes
        # it as a scalar (an H200 profile found one such wait per layer, 2026-11-27).
        # So a changed set is read once (``.cpu()``), and the engine's checks of it and its note of which tokens a
        # layer computed (``fresh``) work on that host copy; policies count the set's visual tokens from it too
        # (``ctx.host_active``, ``pruning.base.visual_in``).
        modality = ctx.prompt.modality.cpu()
        host_index = torch.arange(start, T) if ctx.encoded is None else active.cpu()
        host_modality = modality[host_index]
        encoded = None if ctx.encoded is None else ctx.encoded.cpu()
        ctx.host_active = (active, host_index, host_modality)
        fresh = torch.ones(T, dtype=torch.bool)  # on the host: not computed by any layer yet
        fresh[:start] = False
        if vision is not None and policy.reads_visual_inputs:  # it selects on them before layer 0 (DivPrune)
            hidden = ctx.hidden = vision.join(hidden, ctx)
            vision = None
        for layer_idx, layer in enumerate(self.adapter.layers):
            _stop_if_interrupted(ctx)
            chosen = policy.select(layer_idx, active, ctx)
            if chosen is not active:
                host_chosen = _checked(chosen.cpu(), host_index, fresh)
                if encoded is not None:  # a policy injecting visual tokens (HiDivDrop) may not add those never encoded
                    host_chosen = host_chosen[encoded[host_chosen]]
                    chosen = host_chosen.to(self.device, non_blocking=True)  # pageable: copied before it returns
                active, host_index = chosen, host_chosen
                host_modality = modality[host_index]
                ctx.host_active = (active, host_index, host_modality)
            hidden = ctx.hidden  # a merging policy folds pruned tokens into kept ones (pruning.base.merge_into_kept)
            if vision is not None and bool((host_modality != TEXT).any()):
                hidden = ctx.hidden = vision.join(hidden, ctx)
                vision = None  # joined
            if layer_idx > 0 and ctx.layer_features:
                joining = host_index[fresh[host_index]]
                if joining.numel():
                    # Tokens injected late (HiDivDrop) get what the earlier layers would have added to them.
                    hidden = ctx.hidden = _add_layer_features(hidden, ctx, joining.to(self.device, non_blocking=True),
                                                              range(layer_idx))
            fresh.index_fill_(0, host_index, False)
            ctx.active_per_layer.append(active)
            full = active.shape[0] == T  # nothing pruned: skip the gather/scatter copies
            h = hidden if full else hidden[:, active]
            pe = (cos, sin) if full else (cos[:, active], sin[:, active])
            out = self.run_layer(layer, h, pe, PrefillLayer(self, policy, ctx, layer_idx))
            ctx.layer = None  # the layer's view ends with it
            ctx.cache.record(layer_idx, host_index, host_modality)
            if full:
                hidden = out
            else:
                hidden = hidden.index_copy(1, active, out)
            if layer_idx < len(ctx.layer_features):  # DeepStack: only into the visual tokens active here
                hidden = _add_layer_features(hidden, ctx, active, [layer_idx])
            ctx.hidden = hidden
        if vision is not None:  # no layer used the visual tokens (a policy dropped them all)
            vision.join(hidden, ctx)
        # Only the last prompt position needs the final norm and the lm_head.
        logits = self.adapter.lm_head(self.adapter.norm(hidden[:, -1:]))
        return logits[0, -1].float()

    def run_layer(self, layer, hidden, position_embeddings, call: attention.LayerCall) -> torch.Tensor:
        """One decoder layer, as its own forward runs it (norms, projections, q/k norms, RoPE, MLP or
        MoE), on ``hidden``'s tokens; ``call`` decides what its attention sees (pipeline/attention.py)."""
        return layer(hidden, position_embeddings=position_embeddings, glimpse=call)

    def decode(self, requests: list["Request"], groups: Sequence[BatchKV] = ()) -> torch.Tensor:
        """One decode step of one or more requests: (B, vocab) logits.

        Every request's rows (its new token, plus prompt tokens a policy revives on the way) are
        packed side by side into one sequence for the token-wise work — norms, projections, RoPE
        at each row's own position, the FFN — so the weights are read once per step for the whole
        batch. Attention runs over each request's own cache (whatever each layer kept, packed or
        evicted; each request's policy acts on its own cache): in one call for the requests in
        each of ``groups`` (slot groups, whose members come first, group after group), per request for the others.
        """
        new = [r for r in requests if r.pending is None]
        tokens = torch.tensor([[r.next_token for r in new]], device=self.device, dtype=torch.long)
        embedded = self.adapter.embed_tokens(tokens)  # (1, new, d)
        embeds = iter(embedded.split(1, dim=1))  # (1, 1, d) each
        # A request whose prompt's end is still to compute brings those tokens instead of a new one.
        batch = [r.pending if r.pending is not None else DecodeRows.new_token(next(embeds), r.ctx) for r in requests]
        # With no policy that revives prompt tokens (LazyLLM), every layer computes the same rows (a new token, or
        # the end of a prompt): they stay one tensor from layer to layer, with the same RoPE, made once.
        fixed_rows = not any(r.policy.implements("decode_rows") for r in requests)
        if fixed_rows:
            hidden = embedded if len(new) == len(requests) else torch.cat([rows.hidden for rows in batch], dim=1)
            position_embeddings = self.adapter.rotary(hidden, torch.cat([rows.positions for rows in batch], dim=1))
        for layer_idx, layer in enumerate(self.adapter.layers):
            if not fixed_rows:
                previous = batch
                batch = [r.policy.decode_rows(layer_idx, rows, r.ctx) for r, rows in zip(requests, batch)]
                for request, rows in zip(requests, batch):
                    if request.pending is None:
                        request.ctx.revived += rows.count - 1  # prompt tokens computed here in decode
                # Most layers change no request's rows (LazyLLM reselects at a few): the last layer's output and
                # RoPE then serve as they are, where joining the rows again and recomputing RoPE cost a dozen
                # operators per layer.
                if layer_idx == 0 or any(now is not before for now, before in zip(batch, previous)):
                    hidden = torch.cat([rows.hidden for rows in batch], dim=1)
                    position_embeddings = self.adapter.rotary(hidden, torch.cat([rows.positions for rows in batch],
                                                                                dim=1))
            hidden = self.run_layer(layer, hidden, position_embeddings,
                                    DecodeLayer(self, requests, batch, layer_idx, groups))
            for request in requests:
                request.ctx.layer = None  # the layer's view ends with it
            if not fixed_rows:
                start = 0
                for rows in batch:
                    rows.hidden = hidden[:, start:start + rows.count]
                    start += rows.count
        if not fixed_rows:
            hidden = torch.cat([rows.hidden[:, -1:] for rows in batch], dim=1)  # each request's new token
        elif hidden.shape[1] != len(batch):  # each request's last row: its new token, or its prompt's last token
            last = torch.tensor([rows.count for rows in batch]).cumsum(0) - 1
            hidden = hidden[:, last.to(hidden.device)]
        return self.adapter.lm_head(self.adapter.norm(hidden))[0].float()

    def decode_attention(self, layer_idx, attn, query, key, value, rows: "DecodeRows", request, kernel) -> torch.Tensor:
        """A request's decode rows attend to the entries of this layer's cache the policy picks
        (all, by default) and to each other, causally; their own keys/values join the cache.
        (1, r, heads, head_dim), as ``kernel`` computes it."""
        ctx, policy = request.ctx, request.policy
        layer_kv = ctx.cache.layers[layer_idx]
        attend = policy.decode_attend(layer_idx, ctx)  # positions in the layer's cache, or None
        past = len(layer_kv)
        layer_kv.append(key, value)
        ctx.cache.record(layer_idx, rows.index, rows.modality)
        picked = None if attend is None else torch.cat([attend.cpu(), torch.arange(past, past + rows.count)])
        keys, values = layer_kv.keys_values(picked)
        mask = None
        if rows.count > 1:  # revived prompt tokens then the new token: causal among themselves
            n, seen = rows.count, keys.shape[-2] - rows.count
            allowed = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
            allowed = torch.cat([allowed.new_ones(n, seen), allowed], dim=1)
            mask = torch.zeros(n, seen + n, dtype=query.dtype, device=self.device)
            mask = mask.masked_fill(~allowed, torch.finfo(query.dtype).min)[None, None]
        out = kernel(query, keys, values, mask)
        if policy.implements("decode_score"):
            key_index = layer_kv.index if picked is None else layer_kv.index[picked]
            self.decode_score(layer_idx, attn, query[:, :, -1:], rows, request, keys, key_index)
        return out

    def decode_score(self, layer_idx, attn, query, rows: "DecodeRows", request, keys, key_index) -> None:
        """Show a request's policy the layer its new token (``query``) just attended in: to ``keys``, the
        entries of original indices ``key_index``."""
        request.ctx.layer = LayerView(layer_idx, rows.index, rows.modality, query, keys, attn.scaling, key_index)
        request.policy.decode_score(layer_idx, request.ctx)

    def _causal_mask(self, n: int, dtype: torch.dtype, past: int = 0) -> torch.Tensor | None:
        # Active tokens are sorted by original index, so plain causal order over the gathered
        # sequence is causal order by original position. sdpa and flash-attention apply it
        # themselves (is_causal) when no mask is given; eager needs it spelled out, and so do
        # ``past`` keys before the rows (a reused prefix): is_causal would align the rows with the
        # first keys, not the last.
        if self.attn_implementation != "eager" and past == 0:
            return None
        mask = torch.full((n, past + n), torch.finfo(dtype).min, dtype=dtype, device=self.device).triu(past + 1)
        return mask[None, None]

    def _metrics(self, request: "Request", batch_size: int) -> Metrics:
        prompt, ctx, n_tokens = request.prompt, request.ctx, len(request.tokens)
        counts = [int(a.shape[0]) for a in ctx.active_per_layer]
        attending = [n if rows is None else int(rows.shape[0])
                     for n, rows in zip(counts, ctx.attention_per_layer or [None] * len(counts))]
        (d, m), T = self.adapter.hidden_and_ffn, len(prompt)
        t_request, t_prefill, t_first, t_end = request.t_request, request.t_prefill, request.t_first, request.t_end
        decode_s = t_end - request.t_decode
        queued = request.t_queued if request.t_queued is not None else t_request
        # The server builds a prompt (reads its media) before it queues it; ``start`` builds one given messages.
        received = request.t_received if request.t_received is not None else queued
        return Metrics(
            ttft_s=t_first - received,  # as the user waits for it: the prompt's building and the queue included
            queue_s=t_request - queued,
            prompt_s=(queued - received) + (t_prefill - t_request),
            prefill_s=t_first - t_prefill,
            vision_encoder_s=ctx.vision_encoder_s,
            vision_wait_s=ctx.vision_wait_s,
            decode_tokens_per_s=(n_tokens - 1) / decode_s if n_tokens > 1 and decode_s > 0 else None,
            new_tokens=n_tokens,
            prompt_tokens=prompt.token_counts(),
            active_tokens_per_layer=counts,
            attention_tokens_per_layer=attending,
            prefill_flops=prefill_flops(counts, d, m, attending, past=ctx.reused_tokens),
            prefill_flops_baseline=prefill_flops([T] * len(counts), d, m),
            prefill_flops_unpruned=prefill_flops([T - ctx.reused_tokens] * len(counts), d, m, past=ctx.reused_tokens),
            kv_bytes=ctx.cache.nbytes(),
            kv_bytes_per_step=ctx.kv_bytes_per_step,
            visual_kv_per_step=ctx.visual_kv_per_step,
            decode_step_s=ctx.step_s,
            decode_tokens_per_s_per_step=[n / s if s > 0 else None for n, s in zip(ctx.step_tokens, ctx.step_s)],
            batch_size=batch_size,
            revived_tokens=ctx.revived,
            prefix_reused_tokens=ctx.reused_tokens,
            aux_cache_bytes=ctx.aux_cache.nbytes(),
            peak_memory_bytes=request.peak_memory,
            keep_map=keep_map(prompt, ctx.active_per_layer, ctx.attention_per_layer, reused=ctx.reused_tokens),
            policy_telemetry=request.policy.observed(),
        )


def _checked(active: torch.Tensor, previous: torch.Tensor, fresh: torch.Tensor) -> torch.Tensor:
    """Hold policies to the engine's contract: sorted, last token kept, and nothing new but tokens
    no layer has computed yet (late injection: they join with their original embeddings). A token
    that left never comes back: its hidden state went stale. On the host's copies of the new and the
    previous set (no read of the device per check)."""
    if active.numel() == 0 or int(active[-1]) != fresh.shape[0] - 1:
        raise RuntimeError("a policy dropped the last prompt token; it is never pruned")
    if active.numel() > 1 and not bool((active[1:] > active[:-1]).all()):
        raise RuntimeError("a policy returned an unsorted or repeated active set")
    if not bool((torch.isin(active, previous) | fresh[active]).all()):  # each one stayed, or joins for the first time
        raise RuntimeError("a policy re-activated a token that had already left")
    return active


class VisionJob:
    """The vision encoder + projector of one prompt, run in the engine's vision worker thread — on its
    own CUDA stream on GPU — while the decoder layers that need no visual token run (HiDivDrop's parallel
    decoupling). ``join`` waits for it and writes the features over the placeholder rows.

    Sequential (``parallel=False``) runs it at once in the caller's thread: the same kernels on the
    same inputs, so the features are bit-identical either way.
    """

    def __init__(self, engine: "Engine", prompt: Prompt, parallel: bool, caches: bool = True,
                 encoded: torch.Tensor | None = None, interrupted: Callable[[], bool] | None = None):
        self.engine, self.prompt, self.caches, self.encoded = engine, prompt, caches, encoded
        self.interrupted = interrupted
        self.features: list[tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]] = []
        self.error: BaseException | None = None
        self.seconds = 0.0
        self.running = None  # the worker's future, when parallel
        # Autograd modes are per thread: the worker runs under the caller's.
        self.modes = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())
        if parallel:
            worker, side = engine.vision_worker()
            # What the main stream has queued for this prompt (``encoded``, made just before) comes first on the side
            # stream: without the wait, its copy to the host could run before the kernels that fill it.
            self.ready = torch.cuda.current_stream(engine.device).record_event() if side is not None else None
            self.running = worker.submit(self._run, side)
        else:
            self.ready = None
            self._run(None)

    def wait(self) -> None:
        """Until the encoder is done (it reports its own errors in ``join``)."""
        if self.running is not None:
            self.running.result()

    def _run(self, side_stream) -> None:
        start = time.perf_counter()
        try:
            # The side stream keeps the encoder off the main one.
            stream = torch.cuda.stream(side_stream) if side_stream is not None else contextlib.nullcontext()
            inference, grad = self.modes
            blocks = self.engine.adapter.vision_blocks()
            with (torch.inference_mode(inference), torch.set_grad_enabled(grad), stream,
                  _stop_between(blocks, self.interrupted)):
                if self.ready is not None:
                    side_stream.wait_event(self.ready)
                self.features = self.engine.encode_media(self.prompt, self.caches, self.encoded)
                if side_stream is not None:
                    side_stream.synchronize()
                else:
                    synchronize(self.engine.device)
        except BaseException as error:  # handed to the request's thread in join
            self.error = error
        self.seconds = time.perf_counter() - start

    def join(self, hidden: torch.Tensor, ctx: PrefillContext) -> torch.Tensor:
        start = time.perf_counter()
        self.wait()
        ctx.vision_encoder_s = self.seconds
        ctx.vision_wait_s = self.seconds if self.running is None else time.perf_counter() - start
        if self.error is not None:
            raise self.error  # (the prefill drops it from the job when it ends: Engine._prefill_layers)
        for rows, features, layers in self.features:
            for tensor in (features, *layers):
                if tensor.is_cuda:  # made on the side stream, used from now on on the main one
                    tensor.record_stream(torch.cuda.current_stream(tensor.device))
            hidden = hidden.index_copy(1, rows, features[None])
        depth = max((len(layers) for _, _, layers in self.features), default=0)
        ctx.layer_features = [
            (torch.cat([rows for rows, _, layers in self.features if l < len(layers)]),
             torch.cat([layers[l] for _, _, layers in self.features if l < len(layers)]))
            for l in range(depth)]
        return hidden


def _stop_if_interrupted(ctx: PrefillContext) -> None:
    # A Python call per layer, no device read: nothing a GPU prefill would notice.
    if ctx.interrupted is not None and ctx.interrupted():
        raise PrefillInterrupted("the prefill was interrupted")


@contextlib.contextmanager
def _stop_between(blocks: torch.nn.ModuleList | None, interrupted: Callable[[], bool] | None) -> Iterator[None]:
    """While inside, each of the vision tower's ``blocks`` first asks ``interrupted`` and raises ``PrefillInterrupted``
    when it says True: a forward pre-hook, PyTorch's own way to run code before a module, removed on the way out
    (the engine's lock keeps any other encoder call out meanwhile)."""
    if blocks is None or interrupted is None:
        yield
        return

    def ask(module, args) -> None:
        if interrupted():
            raise PrefillInterrupted("the prefill was interrupted in the vision encoder")

    handles = [block.register_forward_pre_hook(ask) for block in blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _add_layer_features(hidden: torch.Tensor, ctx: PrefillContext, tokens: torch.Tensor, layers) -> torch.Tensor:
    """``hidden`` plus the features the architecture adds after each of ``layers`` (DeepStack), for the
    visual rows among ``tokens`` only: a pruned token's state is stale, and it gets nothing."""
    for layer in layers:
        if layer >= len(ctx.layer_features):
            break
        rows, features = ctx.layer_features[layer]
        pick = torch.isin(rows, tokens)
        hidden = hidden.index_add(1, rows[pick], features[pick][None].to(hidden.dtype))
    return hidden


def _eos_ids(model, tokenizer) -> set[int]:
    """The ids that end an answer: the generation config's ``eos_token_id`` (an id or a list of ids) and the
    tokenizer's. Anything else there is refused, naming the file (a float or a nested list was a TypeError after the
    weights loaded, a string or a dict was taken as stop ids; an outside pass)."""
    ids = set()
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (eos, tokenizer.eos_token_id):
        values = [] if value is None else [value] if isinstance(value, int) else value
        if not isinstance(values, (list, tuple)) or not all(type(v) is int for v in values):
            raise UserError(f"cannot load the model: the eos_token_id of its generation_config.json (or tokenizer) "
                            f"must be a token id or a list of token ids, got {value!r:.80}")
        ids.update(values)
    return ids


class _IncrementalDecoder:
    """Turns a token stream into text deltas without splitting multi-byte characters, in O(1) per token.

    Each step decodes only a short window: the tokens since ``prefix`` (the last few already shown)
    with and without the new ones, and emits the difference. Decoding a window that starts at an
    earlier token, rather than at the new token, keeps the leading space a tokenizer would drop at
    the start of a text. While the window ends in an incomplete UTF-8 sequence ("\ufffd") it grows
    until the character completes. The joined deltas equal decoding the whole answer at once.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = 0  # window start
        self.shown = 0  # tokens[prefix:shown] decode to text already emitted

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def push(self, token: int) -> str:
        self.tokens.append(token)
        before = self._decode(self.tokens[self.prefix:self.shown])
        after = self._decode(self.tokens[self.prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):  # nothing new yet, or a character cut short
            return ""
        self.prefix, self.shown = self.shown, len(self.tokens)
        return after[len(before):]

    def flush(self) -> str:
        before = self._decode(self.tokens[self.prefix:self.shown])
        after = self._decode(self.tokens[self.prefix:])
        self.prefix = self.shown = len(self.tokens)
        return after[len(before):]


def _member_params(members) -> dict:
    """The parameters a configuration's members set themselves, as ``member.param`` overrides."""
    return {f"{member.policy}.{param}": value for member in members for param, value in member.params}
