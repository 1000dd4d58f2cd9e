"""The scheduler: one thread owns the engine and answers every request the server gets, together.

Iteration-level batching (Orca, OSDI '22; what vLLM calls continuous batching): between two decode
steps the scheduler takes in waiting requests — prefills each, on its own, with its own policy — and
they join the running batch; finished and cancelled requests leave it. Every decode step computes the
next token of every running request in one pass through the weights (``Engine.decode_step``), each
request attending over its own cache with its own policy, so a request's answer does not depend on the
company it keeps.

Admission is bounded three ways: at most ``max_batch`` requests run at once; their KV caches may
reserve at most ``kv_budget_bytes`` (a request reserves what its prompt and ``max_new_tokens`` would
take unpruned, an upper bound, so the budget holds whatever the policies keep); at most ``queue_size``
wait. A request beyond that is refused at once (``QueueFull``, with how long to wait), never queued
without bound.

Submitters run in their own threads (the API's, the chat's): ``submit`` builds the prompt there (media
decoding never stalls the running batch, nor another submitter's prompt, and is bounded by ``media_timeout_s``), and
each ticket's chunks go to its own sink. A ticket's
``cancel`` (a client that left, Stop, Clear) ends it before its next step — or before its prefill,
if it was still waiting, or during its prefill before the next vision block or decoder layer — and frees its cache
at once.

``close`` stops it as a server stops on SIGTERM (``docker stop``): no new request is taken, those still waiting
end with ``ServerStopping``, and the running ones decode on to their end — or, past a grace period, end with
``ServerStopping`` after what they have said (a prefill under way, before its next vision block or decoder layer) —
and then the loop returns.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import itertools
import os
import queue
import threading
import time
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from glimpse import vision
from glimpse.vision import MEDIA_READERS, MEDIA_TIMEOUT_S
from glimpse.common import UserError
from glimpse.pipeline.engine import (Engine, GenerationResult, PrefillInterrupted, Request, Sampling, StreamChunk,
                                     check_max_new_tokens)
from glimpse.pipeline.metrics import MemoryMeter
from glimpse.pipeline.prompt import ContextOverflow, Prompt
from glimpse.pruning import Policy


class QueueFull(Exception):
    """The server cannot take this request now: ``waiting`` requests already wait; retry in ``retry_s``."""

    def __init__(self, waiting: int, retry_s: float):
        self.waiting, self.retry_s = waiting, retry_s
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in about {retry_s:.0f} s")


class Cancelled(Exception):
    """The request was cancelled before its first token: it has no answer."""


class ServerStopping(UserError):
    """The server is shutting down: it takes no new request, and a running one past the grace period is cut.
    (A ``UserError`` so that the chat and the command line say it in these words; the API answers 503.)"""


class StopText:
    """Stop strings in a streamed answer (OpenAI's ``stop``): text is released only once no stop string
    can start in it, and the answer ends before the first stop string, which is not returned."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.pending = ""
        self.hit = False

    def feed(self, text: str) -> str:
        """The text that can be shown now, given ``text`` new. Sets ``hit`` at a stop string."""
        if not self.stops:
            return text
        self.pending += text
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            shown, self.pending = self.pending[:cut], ""
            return shown
        keep = len(self.pending) - self.hold
        shown, self.pending = (self.pending[:keep], self.pending[keep:]) if keep > 0 else ("", self.pending)
        return shown

    def flush(self) -> str:
        shown, self.pending = self.pending, ""
        return shown


@dataclass(eq=False)  # a ticket is itself: compared and hashed by identity
class Ticket:
    """A submitted request, as its submitter holds it: ``cancel`` it, read its ``chunks()`` (or give a
    ``sink`` that receives each ``StreamChunk``, then the final one with the result; or an exception;
    or ``None`` for a request cancelled before its first token, which has no result)."""

    prompt: Prompt
    policy: Policy
    max_new_tokens: int
    sampling: Sampling
    ignore_eos: bool
    stop: StopText
    reserved_bytes: int  # the KV this request may grow to (its admission reserves it)
    caches: bool  # may use the engine's caches (Engine.start)
    sink: Callable[[object], None]
    submitted: float = field(default_factory=time.perf_counter)  # queued, its prompt built
    received: float = field(default_factory=time.perf_counter)  # arrived (``submit``'s ``received``)
    admitted_at: float | None = None  # when it left the queue for a place in the batch
    cancel: threading.Event = field(default_factory=threading.Event)
    request: Request | None = None
    text: str = ""  # what was sent so far
    batch: int = 1  # the largest batch it decoded in
    ended: bool = False
    _queue: queue.Queue | None = None

    def chunks(self, timeout: float | None = None, heartbeat: float | None = None) -> Iterator[StreamChunk | None]:
        """The answer's chunks as they come (for tickets submitted without a sink); ``TimeoutError`` after
        ``timeout`` seconds without one. With ``heartbeat``, yields None instead whenever that many seconds
        pass without a chunk (a waiting submitter shows its queue position). Closing this iterator early
        cancels the request."""
        try:
            while True:
                try:
                    item = self._queue.get(timeout=heartbeat or timeout)
                except queue.Empty:
                    if heartbeat is None:
                        raise TimeoutError(f"no answer within {timeout} s") from None
                    yield None
                    continue
                if item is None:  # cancelled before its first token
                    return
                if isinstance(item, BaseException):
                    try:
                        raise item
                    finally:  # else this frame, in the error's traceback, holds the error: a cycle (_first, in api)
                        del item
                yield item
                if item.result is not None:
                    return
        finally:
            self.cancel.set()  # a no-op once the answer ended

    def result(self, timeout: float | None = None) -> GenerationResult:
        for chunk in self.chunks(timeout):
            if chunk.result is not None:
                return chunk.result
        raise Cancelled("the request was cancelled before its first token")


class Scheduler:
    def __init__(self, engine: Engine, *, max_batch: int = 8, queue_size: int = 32,
                 kv_budget_bytes: int | None = None, media_timeout_s: float | None = MEDIA_TIMEOUT_S,
                 media_readers: int = MEDIA_READERS, start: bool = True):
        """``media_timeout_s``: the longest a request's images and videos may take to read (None: no limit);
        ``media_readers``: requests whose media are read at once. ``start=False``: the caller runs the loop itself, in
        its own thread, with ``run()``."""
        if max_batch < 1 or queue_size < 0 or media_readers < 1:
            raise UserError("the batch size and the media readers must be at least 1 and the queue size at least 0")
        self.engine, self.max_batch, self.queue_size = engine, max_batch, queue_size
        self.media_timeout_s = media_timeout_s
        # Decoding is CPU work that holds the frames it decodes: more readers than cores only share the cores and
        # multiply the memory (a long Qwen2-VL video's frames are hundreds of megabytes).
        self.media_readers = threading.BoundedSemaphore(media_readers)
        self.kv_budget_bytes = kv_budget_bytes if kv_budget_bytes is not None else default_kv_budget(engine.device)
        self.waiting: collections.deque[Ticket] = collections.deque()
        self.admitted: list[Ticket] = []  # taken from the queue by this iteration, their prefill not done yet
        self.running: list[Ticket] = []
        self.condition = threading.Condition()
        # While the loop works: when it last finished a unit of work (a prefill, a decode step) or began the
        # iteration. ``stalled_s`` is measured from it, so an iteration that prefills several long prompts one after
        # another is not taken for a wedged one.
        self.busy_since: float | None = None
        # The running requests' caches, in bytes, as the loop last counted them between steps: ``state`` read them
        # from its caller's thread while the loop changed them, and a ZipVL cache caught mid-change raised
        # (ZeroDivisionError: /health answered 500 on a busy server, an outside pass).
        self.kv_bytes = 0
        # A running average of how long a request holds its place in the batch (prefill and decode, not its wait in
        # the queue, which would count the queue twice), for the wait estimates.
        self.service_s = 10.0
        self.closed = False
        self.preparing = 0  # submitters inside ``submit`` (building a prompt): a closing server answers them first
        self.cut_at: float | None = None  # after close(): when requests still running are cut (perf_counter)
        self.error: BaseException | None = None  # what stopped the loop, if anything did
        self.on_finish: list[Callable[[Ticket, GenerationResult | None, BaseException | None], None]] = []
        self.torch_threads = torch.get_num_threads()  # for the thread that runs the model
        self.thread = threading.Thread(target=self._loop, name="glimpse-scheduler", daemon=True)
        if start:
            self.thread.start()

    def run(self) -> None:
        """Run the loop in the calling thread until ``close()``. ``glimpse serve`` runs it in the main thread:
        on CPU, torch's OpenMP kernels run about 1.5x slower in a thread other than the one that first used
        them (the one that loaded the model), because a second OpenMP team competes with the first one's."""
        self.thread = threading.current_thread()
        self._loop()

    # ------------------------------------------------------------------ submitters' side
    def submit(self, messages, *, policy: str | Policy = "auto", speed: float = 0.0, max_new_tokens: int = 128,
               do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int | None = None,
               ignore_eos: bool = False, stop: tuple[str, ...] = (), caches: bool = True,
               sink: Callable[[object], None] | None = None, refuse_past_context: str | None = None,
               left: Callable[[], bool] | None = None, received: float | None = None) -> Ticket:
        """Queue a request; raises ``QueueFull`` when the queue is full, ``UserError`` for a bad prompt or
        one that could never fit the KV budget. The prompt (media decoding included) is built here, in the
        caller's thread (``prepare``; ``left``: whether its client has left meanwhile). ``refuse_past_context``: a
        prompt that leaves fewer than ``max_new_tokens`` tokens of the model's context is refused (``ContextOverflow``),
        naming this field of the request (the API's explicit ``max_tokens`` or ``max_completion_tokens``, refused as
        OpenAI's API does) rather than answered up to the context's end. ``received``: when the request arrived
        (``time.perf_counter()``; default now), where its time to first token starts: the API's handler and the chat
        read its body and files before they submit it (they were left out of ``ttft_s``, an outside pass)."""
        received = time.perf_counter() if received is None else received
        # Before its KV is reserved: a negative max_new_tokens reserved negative bytes, and the requests behind it were
        # admitted past the budget (an outside mutation pass; the engine refused it only at its prefill).
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        with self._building():  # counted while it builds its prompt, for ``wait_for_submitters``
            self.check_room()  # refuse before the work of building the prompt
            # A Policy object given here is a template: the request gets its own copy (policies keep state).
            policy = copy.deepcopy(policy) if isinstance(policy, Policy) else self.engine.make_policy(policy, speed)
            prompt = messages if isinstance(messages, Prompt) else self.prepare(messages, caches, left)
            self.engine.check_prompt(prompt)
            context = self.engine.max_length
            if refuse_past_context and context is not None and len(prompt) + max_new_tokens > context:
                raise ContextOverflow(f"the prompt takes {len(prompt):,}, which leaves {context - len(prompt):,}, not "
                                      f"the {max_new_tokens:,} asked for; ask for fewer tokens or shorten the "
                                      "conversation", context, param=refuse_past_context, field=refuse_past_context)
            reserved = self.reservation(prompt, max_new_tokens)
            if reserved > self.kv_budget_bytes:
                raise self._over_budget(reserved)
            own_queue = None
            if sink is None:
                own_queue = queue.Queue()
                sink = own_queue.put
            ticket = Ticket(prompt, policy, max_new_tokens, Sampling(do_sample, temperature, top_p, seed), ignore_eos,
                            StopText(tuple(stop)), reserved, caches, sink, received=received, _queue=own_queue)
            with self.condition:
                self._refuse_if_full(reserved)
                self.waiting.append(ticket)
                self.condition.notify()
            return ticket

    def _over_budget(self, reserved: int) -> UserError:
        # In tokens, which the client can act on, and MiB: "1 MiB, more than the budget of 1 MiB" said in MiB alone.
        per_token = max(self.engine.kv_bytes_per_token(), 1)
        return UserError(f"this request may need KV cache for {reserved // per_token:,} tokens (prompt and answer, "
                         f"{reserved / 2**20:,.1f} MiB), more than the server's budget of "
                         f"{self.kv_budget_bytes // per_token:,} tokens ({self.kv_budget_bytes / 2**20:,.1f} MiB): "
                         "shorten the prompt, send fewer frames or ask for fewer tokens")

    def reservation(self, prompt: Prompt, max_new_tokens: int) -> int:
        """The KV bytes a request reserves: ``prompt`` with room for ``max_new_tokens``."""
        return self.engine.kv_bytes_per_token() * (len(prompt) + max_new_tokens)

    def fits_budget(self, prompt: Prompt, max_new_tokens: int) -> bool:
        """Whether ``prompt`` with room for ``max_new_tokens`` fits the server's KV budget (``submit`` refuses one that
        does not): the chat leaves out its oldest turns until it does."""
        return self.reservation(prompt, max_new_tokens) <= self.kv_budget_bytes

    @contextlib.contextmanager
    def _building(self) -> Iterator[None]:
        with self.condition:
            self.preparing += 1
        try:
            yield
        finally:
            with self.condition:
                self.preparing -= 1
                self.condition.notify_all()  # ``wait_for_submitters`` (and the loop, which finds nothing new)

    def prepare(self, messages, caches: bool = True, left: Callable[[], bool] | None = None) -> Prompt:
        """The prompt of ``messages`` (media decoded), built in the caller's thread; ``submit`` takes it.
        ``PromptError`` (``ContextOverflow``) for one that cannot be a prompt.

        Several are built at once: their media are read side by side and only the tokenizer takes one at a time
        (``Engine.prepare``). Reading them stops at ``media_timeout_s`` (``MediaError``), once ``left()`` (its client
        left: ``vision.ReadingStopped``) and once the server closes (``ServerStopping``): they are the server's work
        that a client sets by what it sends, and a 600 KB video whose frames can only be reached by decoding all
        20,000 of them took 18 s, all other requests' prompts waiting behind it (found from outside, 2026-12-05)."""
        def stop() -> bool:
            return self.closed or (left is not None and left())

        with one_torch_thread(self.engine.device):
            return self.engine.prepare(messages, caches, reading=self.reading_turn(stop))

    @contextlib.contextmanager
    def reading_turn(self, stop: Callable[[], bool] | None = None) -> Iterator[None]:
        """One of the ``media_readers`` places (waited for until ``stop()``; by default, until the server closes), and
        in it the reading's limits: the time limit counts from the place, not from the wait for it. A prompt's reading
        takes one (``prepare``), and so does media read outside a prompt (the chat's check of a turn's files). Stopped
        because the server closes, the reading raises ``ServerStopping``."""
        stop = stop or (lambda: self.closed)
        try:
            while not self.media_readers.acquire(timeout=0.25):
                if stop():
                    raise vision.ReadingStopped("the request's media: reading them was stopped before it began")
            try:
                with vision.reading_limit(self.media_timeout_s, stop):
                    yield
            finally:
                self.media_readers.release()
        except vision.ReadingStopped:
            if self.closed:
                raise ServerStopping(STOPPING) from None
            raise

    def check_room(self) -> None:
        """Raise ``QueueFull`` if a request submitted now would be refused."""
        with self.condition:
            self._refuse_if_full()

    def _refuse_if_full(self, reserved: int = 0) -> None:
        """Raise ``QueueFull`` if a request reserving ``reserved`` bytes of KV would wait beyond ``queue_size``. It
        waits if the batch is full, or if the budget cannot take it after those ahead of it (first come, first
        served): a server whose budget held fewer requests than ``max_batch`` took any number to wait in a queue of
        ``--queue-size 0`` (an outside pass's randomized clients)."""
        if self.error is not None:
            raise RuntimeError(f"the scheduler stopped: {self.error!r}")
        if self.closed:
            raise ServerStopping(STOPPING)
        still_waiting = self._still_waiting()
        ahead = self.running + self.admitted + still_waiting
        would_wait = (len(ahead) >= self.max_batch
                      or sum(t.reserved_bytes for t in ahead) + reserved > self.kv_budget_bytes)
        queued = self._queued(still_waiting)
        if would_wait and len(queued) >= self.queue_size:
            raise QueueFull(len(still_waiting), self.wait_estimate(1))  # (all that wait, as /health counts them)

    def _queued(self, still_waiting: list[Ticket]) -> list[Ticket]:
        """Those of ``still_waiting`` (in order) that wait for a place: the batch (its size, the KV budget) cannot
        take them after those ahead of them. The others have a place and wait only for the loop to take them, after
        the prefill under way: counted against ``queue_size`` too, a burst was refused before the batch was full
        (``--max-batch 2 --queue-size 2`` took three requests, not four: an outside pass)."""
        held = self.running + self.admitted
        places, used = self.max_batch - len(held), sum(t.reserved_bytes for t in held)
        for at, ticket in enumerate(still_waiting):
            if places <= 0 or used + ticket.reserved_bytes > self.kv_budget_bytes:
                return still_waiting[at:]
            places, used = places - 1, used + ticket.reserved_bytes
        return []

    def _still_waiting(self) -> list[Ticket]:
        """The queued tickets whose submitters still wait (under the condition). One that gave up (a client that
        left, Stop) stays in the queue until the loop reaches it, which may be minutes away behind a long prefill,
        but it holds no place there: it is not counted against ``queue_size``, in ``waiting`` or ahead of anyone."""
        return [t for t in self.waiting if not t.cancel.is_set()]

    def generate(self, messages, **options) -> GenerationResult:
        return self.submit(messages, **options).result()

    def stream(self, messages, **options) -> Iterator[StreamChunk]:
        return self.submit(messages, **options).chunks()

    def position(self, ticket: Ticket) -> int:
        """0 once the request runs (or ended); otherwise how many requests wait ahead of it, plus one."""
        with self.condition:
            if ticket not in self.waiting:
                return 0
            ahead = itertools.takewhile(lambda t: t is not ticket, self.waiting)
            return sum(not t.cancel.is_set() for t in ahead) + 1

    def wait_estimate(self, position: int) -> float:
        """Seconds until a request at queue ``position`` starts (at least 1). Each request in the batch holds its
        place about ``service_s`` in all, so it has about ``service_s`` less the time it has held it left (none, once
        past it); the request starts when ``position`` places have freed: the soonest first, and each place a whole
        ``service_s`` again once every one has freed (a 429's Retry-After is ``wait_estimate(1)``: when the queue has
        room again). Counted from the places' own start times, the chat's "about N s" counts down as it waits (until
        2026-12-07 it was ``position * service_s / running``, and stood still while no place freed)."""
        now = time.perf_counter()
        with self.condition:
            started = [t.admitted_at or now for t in self.running + self.admitted]
        if not started:  # nothing in the batch yet: each place a whole request's time from now
            return max(1.0, position * self.service_s)
        left = sorted(max(self.service_s - (now - at), 0.0) for at in started)
        rounds, place = divmod(position - 1, len(left))
        return max(1.0, left[place] + rounds * self.service_s)

    def state(self) -> dict:
        """What ``/health`` and ``/metrics`` report. ``prefilling``: requests taken from the queue whose prefill is
        under way or next (they hold their KV reservation, and are ``running`` once their first token is out);
        ``stalled_s``: how long the loop has worked without finishing a prefill or a decode step (a wedged scheduler
        shows here); ``kv_bytes``: the running requests' caches after the last step."""
        with self.condition:
            running, admitted = list(self.running), list(self.admitted)
            waiting = len(self._still_waiting())
            busy = self.busy_since
        return {"running": len(running), "prefilling": len(admitted), "waiting": waiting, "kv_bytes": self.kv_bytes,
                "kv_reserved_bytes": sum(t.reserved_bytes for t in running + admitted),
                "kv_budget_bytes": self.kv_budget_bytes, "max_batch": self.max_batch, "queue_size": self.queue_size,
                "stalled_s": 0.0 if busy is None else time.perf_counter() - busy,
                "alive": self.thread.is_alive() and self.error is None}

    def close(self, grace_s: float | None = None, wait: bool = True) -> None:
        """Take no new request (``submit`` raises ``ServerStopping``); requests still waiting end with it. Running
        requests decode on to their end, or for at most ``grace_s`` seconds (None: no limit): then each ends with
        ``ServerStopping``, its client keeping what it was sent. The loop returns once none runs. ``wait``: return
        only then (at most a minute), unless called from the loop's own thread."""
        with self.condition:
            self.closed = True
            if grace_s is not None:
                cut_at = time.perf_counter() + max(0.0, grace_s)
                self.cut_at = cut_at if self.cut_at is None else min(self.cut_at, cut_at)
            self.condition.notify()
        if wait and self.thread is not threading.current_thread() and self.thread.is_alive():
            self.thread.join(timeout=60)

    def wait_for_submitters(self) -> None:
        """After ``close(grace_s)``: until no submitter is still building its prompt, or the grace period is over.
        Such a submitter's ``submit`` raises ``ServerStopping`` once its media reading stops (``prepare``: at the next
        packet of a video or the next image) or its prompt is built, and ``glimpse serve`` waits for that, so that its
        client is told (503) rather than left with a connection closed under it."""
        with self.condition:
            while self.preparing and self.cut_at is not None and (left := self.cut_at - time.perf_counter()) > 0:
                self.condition.wait(timeout=left)

    # ------------------------------------------------------------------ the loop (the scheduler's thread)
    def _loop(self) -> None:
        if self.engine.device.type == "cpu":
            # This thread's own count (OpenMP's is per thread), whatever a submitter set meanwhile. Asking first
            # runs torch's once-per-thread setup, which would otherwise reset the count at the first kernel.
            torch.get_num_threads()
            torch.set_num_threads(self.torch_threads)
        try:
            while True:
                self.kv_bytes = sum(_cache_bytes(t.request) for t in self.running)  # (only this thread changes them)
                with self.condition:
                    while not self.closed and not self.waiting and not self.running:
                        self.condition.wait()
                    turned_away = self._turn_away_waiting() if self.closed else []
                    stop = self.closed and not self.running
                    if not stop:
                        self.busy_since = time.perf_counter()
                        joining = self._admit()
                for ticket in turned_away:
                    self._end(ticket, None, None if ticket.cancel.is_set() else ServerStopping(STOPPING))
                if stop:
                    break
                self._iteration(joining)
                with self.condition:
                    self.busy_since = None
        except BaseException as error:  # a bug: every request still here learns it, and /health reports it
            self.error = error
            with self.condition:
                tickets = list(self.running) + list(self.admitted) + list(self.waiting)
                self.running.clear()
                self.admitted.clear()
                self.waiting.clear()
            # Ctrl-C (a second SIGTERM) is no bug: the answers it cuts say the server stopped (a stream's last event
            # said "KeyboardInterrupt: ", an outside pass)
            told = ServerStopping(STOPPING_CUT) if isinstance(error, KeyboardInterrupt) else error
            for ticket in tickets:
                self._end(ticket, None, told)
            raise

    def _turn_away_waiting(self) -> list[Ticket]:
        """The waiting tickets, taken from the queue: the scheduler is closing (under the condition)."""
        tickets = list(self.waiting)
        self.waiting.clear()
        return tickets

    def _admit(self) -> list[Ticket]:
        """Waiting requests that fit beside the running ones, oldest first (under the condition)."""
        joining = []
        reserved = sum(t.reserved_bytes for t in self.running)
        while self.waiting and len(self.running) + len(joining) < self.max_batch:
            ticket = self.waiting[0]
            if ticket.cancel.is_set():  # gave up while waiting: nothing was computed
                self.waiting.popleft()
                self._end(ticket, None, None)
                continue
            if ticket.reserved_bytes > self.kv_budget_bytes:  # it fitted when it came; the budget was lowered since
                self.waiting.popleft()
                self._end(ticket, None, self._over_budget(ticket.reserved_bytes))
                continue
            if reserved + ticket.reserved_bytes > self.kv_budget_bytes:
                break  # first come, first served: it waits until enough of the budget is free
            self.waiting.popleft()
            ticket.admitted_at = time.perf_counter()
            joining.append(ticket)
            reserved += ticket.reserved_bytes
        self.admitted = list(joining)
        return joining

    def _iteration(self, joining: list[Ticket]) -> None:
        engine = self.engine
        with engine._lock, torch.inference_mode():
            meter = MemoryMeter(engine.device)
            for ticket in joining:
                try:
                    self._prefill(ticket, meter)
                finally:
                    with self.condition:
                        if ticket in self.admitted:  # it ended without joining (cancelled, or its prefill failed)
                            self.admitted.remove(ticket)
                        self.busy_since = time.perf_counter()  # a prefill done: the loop is not stuck
            with self.condition:
                running = [t for t in self.running if not any(t is j for j in joining)]
            if self._past_grace():  # closing, and the grace period is over: each ends with what it has said
                for ticket in running:
                    if ticket.request.error is None and not ticket.request.done:
                        ticket.request.error = ServerStopping(STOPPING_CUT)
                        engine.finish(ticket.request, "error")
            for ticket in running:
                self._take(ticket, meter)
            with self.condition:
                self.running = [t for t in self.running if not t.ended]
                step_tickets = list(self.running)
            stepping = [t.request for t in step_tickets]
            if stepping:
                for ticket in self.running:
                    ticket.batch = max(ticket.batch, len(stepping))
                try:
                    ran_out_of_memory = engine.decode_step(stepping)
                    with self.condition:
                        self.busy_since = time.perf_counter()
                except Exception as error:  # noqa: BLE001 — the step itself failed: its requests end, the server goes on
                    # (A policy's per-step work that fails is the request's own, and a pass that runs out of memory
                    # is undone and run again in parts, in decode_step; this is a failure inside the pass through
                    # the model, which no single request can be named for.)
                    traceback.print_exc()
                    engine.batch_ended()
                    for request in stepping:
                        request.error = error
                        engine.finish(request, "error")
                else:
                    if ran_out_of_memory:
                        ended = sum(request.error is not None for request in stepping)
                        print(f"glimpse: a decode step of {len(stepping)} requests ran out of memory: it ran again "
                              f"in smaller parts, without KV slots ({ended} ended, out of memory)", file=sys.stderr)
                        if len(step_tickets) > 1:
                            self._reserve_less_after([t.reserved_bytes for t in step_tickets])
                for request in stepping:
                    request.note_memory(meter)
            else:
                engine.batch_ended()  # no batch left: its KV slots go now, not at the next request

    def _reserve_less_after(self, reservations: list[int]) -> None:
        """A decode step of requests holding these KV reservations ran out of memory: the budget promised more
        than the device holds beside the weights and the step's own work (another process on the GPU, a
        ``--kv-budget-mb`` set too high). From now on, until the server restarts, the running requests may reserve
        half of what these did, but never less than the largest of them, which may still run alone: requests
        like these then decode in smaller batches instead of failing together again."""
        lowered = max(max(reservations), sum(reservations) // 2)
        with self.condition:
            if lowered >= self.kv_budget_bytes:
                return
            before, self.kv_budget_bytes = self.kv_budget_bytes, lowered
        print(f"glimpse: the KV budget is now {lowered / 2**20:,.1f} MiB (was {before / 2**20:,.1f} MiB): "
              f"{len(reservations)} requests reserving {sum(reservations) / 2**20:,.1f} MiB ran out of memory "
              "decoding together", file=sys.stderr)

    def _prefill(self, ticket: Ticket, meter: MemoryMeter) -> None:
        """Prefill a request taken from the queue; it joins the running batch, or ends alone if it failed."""
        engine = self.engine
        # Asked before the encoder, before each of its blocks and before each decoder layer: a client that leaves, or
        # a server whose grace ran out, during a long video's prefill frees the model within a block or a layer, not
        # at the prefill's end.
        def interrupted() -> bool:
            return ticket.cancel.is_set() or self._past_grace()

        try:
            if interrupted():  # cancelled while it waited, or the grace ran out during the prefills before it
                raise PrefillInterrupted("interrupted before its prefill")
            request = engine.start(ticket.prompt, ticket.policy, 0.0, ticket.max_new_tokens, ticket.sampling,
                                   ticket.ignore_eos, ticket.caches, defer=True, interrupted=interrupted)
        except PrefillInterrupted:  # nothing of it is kept: cancelled, it has no answer; cut, it is told why
            self._end(ticket, None, None if ticket.cancel.is_set() else ServerStopping(STOPPING_CUT))
            return
        except Exception as error:  # this request's own failure (a policy parameter, memory): it alone ends
            self._end(ticket, None, error)
            return
        request.cancel, request.t_queued, request.t_decode = ticket.cancel, ticket.submitted, time.perf_counter()
        request.t_received = ticket.received
        ticket.request = request
        with self.condition:  # from prefilling to running at once: counted in one of them, never both or neither
            self.admitted.remove(ticket)
            self.running.append(ticket)
        # Its first token goes out now, not after the prefills of the others that arrived with it:
        # with eight arrivals at once the last one's first token still waits for eight prefills,
        # the first one's no longer does.
        self._take(ticket, meter)

    def _past_grace(self) -> bool:
        """Closing, and the grace period is over: what still runs is cut."""
        cut_at = self.cut_at  # set once by close(), from another thread: read once
        return cut_at is not None and time.perf_counter() >= cut_at

    def _take(self, ticket: Ticket, meter: MemoryMeter) -> None:
        """Hand the ticket its request's newest token (the prefill's, or the last decode step's)."""
        request, engine = ticket.request, self.engine
        request.note_memory(meter)
        if request.error is not None:  # the last step failed for it (its policy, or the step itself): it ends
            self._end(ticket, request, request.error)
            return
        token = engine.take_token(request)
        if token is not None:
            text = ticket.stop.feed(request.detok.push(token))
            if ticket.stop.hit:
                engine.finish(request, "stop")
            if text:
                ticket.text += text
                ticket.sink(StreamChunk(text, token))
        if request.done:
            self._end(ticket, request, None)

    def _end(self, ticket: Ticket, request: Request | None, error: BaseException | None) -> None:
        """Hand the ticket its last chunk (the result) or its error; free its cache."""
        ticket.ended = True
        result = None
        if request is not None:
            tail = "" if ticket.stop.hit else ticket.stop.feed(request.detok.flush()) + ticket.stop.flush()
            ticket.text += tail
            try:
                result = self.engine._result(request, batch_size=ticket.batch)
            except Exception as failure:  # noqa: BLE001 — reported to this request alone
                error = failure
            else:
                if ticket.stop.stops:
                    result.text = ticket.text  # the answer before its stop string
                service = time.perf_counter() - (ticket.admitted_at or ticket.submitted)
                self.service_s = 0.8 * self.service_s + 0.2 * service
            request.ctx.cache = None  # the KV cache goes now, not when the submitter drops the ticket
            ticket.sink(error if error is not None else StreamChunk(tail, None, result))
        else:
            # Never started: cancelled while waiting, or its prefill failed.
            ticket.sink(error)
        for hook in self.on_finish:
            hook(ticket, result, error)


STOPPING = "the server is shutting down and takes no new requests; try again once it is back"
STOPPING_CUT = "the server shut down before this answer ended"


def _cache_bytes(request: Request | None) -> int:
    cache = request.ctx.cache if request is not None else None  # None once the request ended
    return cache.nbytes() if cache is not None else 0


@contextlib.contextmanager
def one_torch_thread(device: torch.device) -> Iterator[None]:
    """Torch kernels of the calling thread on one OpenMP thread while inside, for an engine on a CPU.

    Why: every thread that runs a parallel torch kernel keeps an OpenMP team for its life, and once the
    process has more OpenMP threads than CPUs, libgomp spins only briefly between parallel regions, which
    made every later kernel of the thread that runs the model about 2x slower (docs/engine.md, "One thread
    runs the model"). Preparing a prompt (frame resizing for Qwen video) is the only torch work of the
    submitters' threads, so it runs single-threaded; OpenMP's thread count is per thread, so the model's
    thread keeps its own. On a GPU nothing changes (the model's thread runs few CPU kernels)."""
    if device.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def default_kv_budget(device: torch.device) -> int:
    """Half the GPU memory free now (the weights are loaded), or on CPU a quarter of the machine's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.5)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.25)
    except (ValueError, OSError, AttributeError):
        return 4 * 2**30
