"""The server's scheduler: iteration-level batching that changes nothing in any answer, admission
bounded by batch size, KV budget and queue, cancellation that frees the model at once, stop strings."""

from __future__ import annotations

import threading
import time

import pytest

from glimpse import vision
from glimpse.common import UserError
from glimpse.pipeline import load_engine
from glimpse.pipeline.scheduler import Cancelled, QueueFull, Scheduler, ServerStopping, StopText
from glimpse.pruning import NoPruning


@pytest.fixture(scope="module")
def engine(deep_checkpoints):
    return load_engine(str(deep_checkpoints["qwen2_vl"]), device="cpu")


def _conversations(media):
    image = str(media["image"])
    return [
        [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "Describe it."}]}],
        [{"role": "user", "content": "Write one line about the sea."}],
        [{"role": "user", "content": [{"type": "video", "video": str(media["video"])},
                                      {"type": "text", "text": "What happens?"}]}],
        [{"role": "user", "content": [{"type": "image", "image": image},
                                      {"type": "text", "text": "What colours? Answer in a long sentence please."}]}],
    ]


# Every policy, at speeds that make it prune, mixed in one batch.
MIX = [("none", 0.0), ("auto", 1.0), ("lazyllm", 0.7), ("zipvl", 1.0), ("st3", 1.0), ("dash", 0.6),
       ("fastv", 0.8), ("hidivdrop", 1.0), ("auto", 0.5)]


def test_answers_with_company_equal_answers_alone_for_every_policy(engine, media):
    """Requests join a running batch between its decode steps and leave it when done: each greedy answer
    is token for token what the engine gives the request alone, whatever policies and speeds share it."""
    conversations = _conversations(media)
    cases = [(conversations[i % len(conversations)], name, speed, 6 + 3 * (i % 3)) for i, (name, speed) in enumerate(MIX)]
    alone = [engine.generate(c, policy=name, speed=speed, max_new_tokens=n) for c, name, speed, n in cases]
    scheduler = Scheduler(engine, max_batch=4, queue_size=16)
    try:
        first = scheduler.submit(cases[0][0], policy=cases[0][1], speed=cases[0][2], max_new_tokens=cases[0][3])
        stream = first.chunks(timeout=60)
        next(stream)  # the first request is decoding: the others join it mid-answer
        tickets = [first] + [scheduler.submit(c, policy=name, speed=speed, max_new_tokens=n)
                             for c, name, speed, n in cases[1:]]
        results = [next(chunk.result for chunk in stream if chunk.result is not None)]
        results += [t.result(timeout=120) for t in tickets[1:]]
    finally:
        scheduler.close()
    assert max(r.metrics["batch_size"] for r in results) == 4  # they did share steps
    for (_, name, speed, _), together, single in zip(cases, results, alone):
        assert together.policy == single.policy
        assert together.token_ids == single.token_ids, (name, speed)
        assert together.finish_reason == single.finish_reason
        assert together.metrics["active_tokens_per_layer"] == single.metrics["active_tokens_per_layer"]
        assert together.metrics["kv_bytes"] == single.metrics["kv_bytes"]


def test_prefix_cache_hits_in_a_running_batch_answer_as_requests_alone_without_it(engine, media):
    """With the prefix cache on, unpruned requests about a picture or video seen before prefill only what is new
    — a few text tokens in the decode step the running batch takes anyway — while other requests, pruned or
    not, decode beside them: every greedy answer is still token for token the engine's answer to the request
    alone with the cache off."""
    conversations = _conversations(media)
    mix = [("none", 0.0), ("fastv", 0.8), ("auto", 0.0), ("none", 0.0), ("lazyllm", 0.7), ("none", 0.0)]
    cases = [(conversations[i % len(conversations)], name, speed, 5 + 2 * (i % 3)) for i, (name, speed) in enumerate(mix * 2)]
    alone = [engine.generate(c, policy=name, speed=speed, max_new_tokens=n) for c, name, speed, n in cases]
    engine.prefix_cache.max_bytes = 256 * 2**20
    in_step = []  # requests whose prompt's end a decode step computed
    done = engine._prompt_done
    engine._prompt_done = lambda request, logits: (in_step.append(request), done(request, logits))
    scheduler = Scheduler(engine, max_batch=4, queue_size=16)
    try:
        tickets = [scheduler.submit(c, policy=name, speed=speed, max_new_tokens=n) for c, name, speed, n in cases]
        results = [t.result(timeout=120) for t in tickets]
    finally:
        scheduler.close()
        del engine._prompt_done
        engine.prefix_cache.max_bytes = 0
        engine.prefix_cache.entries.clear()
        engine.prefix_cache.bytes = 0
    reused = [r.metrics["prefix_reused_tokens"] for r in results]
    assert sum(1 for r in reused if r) >= 4 and max(r.metrics["batch_size"] for r in results) > 1
    assert len(in_step) >= 2 and {id(t.request) for t in tickets} >= {id(r) for r in in_step}
    for (_, name, speed, _), together, single, n in zip(cases, results, alone, reused):
        assert together.token_ids == single.token_ids, (name, speed, n)
        assert n == 0 or name in ("none", "auto")


def test_a_request_cancelled_while_streaming_ends_at_the_next_step_and_the_others_go_on(engine, media):
    conversations = _conversations(media)
    scheduler = Scheduler(engine, max_batch=4)
    try:
        leaving = scheduler.submit(conversations[0], policy="none", max_new_tokens=40, ignore_eos=True)
        staying = scheduler.submit(conversations[1], policy="none", max_new_tokens=12, ignore_eos=True)
        chunks = leaving.chunks(timeout=60)
        next(chunks), next(chunks)
        leaving.cancel.set()
        last = [c for c in chunks][-1].result
        assert last.finish_reason == "cancelled" and 2 <= len(last.token_ids) < 40
        assert leaving.request.ctx.cache is None  # its KV went with it
        assert staying.result(timeout=60).token_ids == engine.generate(
            conversations[1], policy="none", max_new_tokens=12, ignore_eos=True).token_ids
        _wait(lambda: scheduler.state()["running"] == 0)
        assert not engine._lock.locked()
    finally:
        scheduler.close()


def test_requests_arriving_together_each_get_their_first_token_right_after_their_own_prefill(engine, media,
                                                                                               monkeypatch):
    """Arrivals are prefilled one after another between decode steps; each one's first token goes out as
    soon as its own prefill is done, not after the prefills of those that arrived with it (time to first
    token under a burst), and the answers are still the ones given alone."""
    conversations = _conversations(media)[:3]
    alone = [engine.generate(c, policy="none", max_new_tokens=4) for c in conversations]
    events, names = [], {}
    start, take_token = engine.start, engine.take_token

    def recording_start(prompt, *args, **kwargs):
        request = start(prompt, *args, **kwargs)
        names[id(request)] = names_by_prompt[id(prompt)]
        events.append(("prefill", names[id(request)]))
        return request

    def recording_take(request):
        if ("first token", names[id(request)]) not in events:
            events.append(("first token", names[id(request)]))
        return take_token(request)

    monkeypatch.setattr(engine, "start", recording_start)
    monkeypatch.setattr(engine, "take_token", recording_take)
    scheduler = Scheduler(engine, max_batch=4, queue_size=8, start=False)  # all three queued before the loop runs
    tickets = [scheduler.submit(c, policy="none", max_new_tokens=4) for c in conversations]
    names_by_prompt = {id(t.prompt): i for i, t in enumerate(tickets)}
    loop = threading.Thread(target=scheduler.run, daemon=True)
    loop.start()
    try:
        results = [t.result(timeout=120) for t in tickets]
    finally:
        scheduler.close()
        loop.join(timeout=60)
    assert events[:6] == [("prefill", 0), ("first token", 0), ("prefill", 1), ("first token", 1),
                          ("prefill", 2), ("first token", 2)]
    assert max(r.metrics["batch_size"] for r in results) == 3  # then they decoded together
    assert [r.token_ids for r in results] == [r.token_ids for r in alone]


def test_the_wait_estimates_count_a_request_s_time_in_the_batch_not_its_wait_in_the_queue_and_count_down(
        engine, media):
    """The chat's "about N s" and a 429's Retry-After: each place in the batch frees about service_s after its
    request took it, and service_s is how long a request holds its place, not how long it waited before (which,
    with a long queue, would make every estimate count the queue twice). Counted from when the places were taken,
    the estimate counts down as a request waits (it stood still: an outside pass)."""
    from types import SimpleNamespace

    scheduler = Scheduler(engine, max_batch=4, queue_size=4)
    try:
        began = time.perf_counter()
        ticket = scheduler.submit(_conversations(media)[0], policy="none", max_new_tokens=3)
        ticket.submitted -= 1000.0  # as if it had waited 1000 s in the queue
        ticket.result(timeout=60)
        held = time.perf_counter() - began  # at least its time in the batch
        # The default 10 s moved a fifth of the way to the time it held its place (not its 1000 s in the queue).
        assert 0.8 * 10.0 <= scheduler.service_s <= 0.8 * 10.0 + 0.2 * held
        scheduler.service_s = 8.0
        assert scheduler.wait_estimate(1) == pytest.approx(8.0)  # nothing running yet: a whole request's time
        now = time.perf_counter()
        held = [SimpleNamespace(admitted_at=now - 6.0), SimpleNamespace(admitted_at=now - 2.0)]
        with scheduler.condition:  # (held: the loop must not see these stand-ins)
            scheduler.running = held  # two places, taken 6 s and 2 s ago: they free in about 2 s and 6 s
            estimates = [scheduler.wait_estimate(position) for position in (1, 2, 3)]
            assert estimates == pytest.approx([2.0, 6.0, 2.0 + 8.0], abs=0.1)
            for place in held:
                place.admitted_at -= 0.5  # half a second on: every estimate is half a second shorter
            later = [scheduler.wait_estimate(position) for position in (1, 2, 3)]
            assert later == pytest.approx([e - 0.5 for e in estimates], abs=0.1)
            for place in held:
                place.admitted_at -= 100.0  # both overdue: any moment now, said as the least estimate
            assert scheduler.wait_estimate(1) == 1.0 and scheduler.wait_estimate(3) == pytest.approx(8.0, abs=0.1)
            scheduler.running = []
    finally:
        scheduler.close()


def test_a_server_stopped_by_ctrl_c_tells_the_answers_it_cuts_that_it_stopped(engine, media, monkeypatch):
    """Ctrl-C on `glimpse serve` (or a second SIGTERM) interrupts the loop in a step: the answers under way and those
    waiting ended with "KeyboardInterrupt: " as their error (an outside pass); they are told the server stopped."""
    scheduler = Scheduler(engine, max_batch=1, queue_size=2, start=False)
    tickets = [scheduler.submit(conversation, policy="none", max_new_tokens=3)
               for conversation in _conversations(media)[:2]]

    def interrupted(joining):
        raise KeyboardInterrupt

    monkeypatch.setattr(scheduler, "_iteration", interrupted)
    with pytest.raises(KeyboardInterrupt):
        scheduler.run()
    for ticket in tickets:
        with pytest.raises(ServerStopping, match="the server shut down before this answer ended"):
            ticket.result(timeout=5)

def test_a_request_cancelled_while_queued_is_never_computed_and_frees_its_place(engine, media):
    conversations = _conversations(media)
    scheduler = Scheduler(engine, max_batch=1, queue_size=1)
    started = []
    scheduler.on_finish.append(lambda ticket, result, error: started.append(ticket.request is not None))
    try:
        running = scheduler.submit(conversations[1], policy="none", max_new_tokens=30, ignore_eos=True)
        next(running.chunks(timeout=60))  # running: the next one waits
        queued = scheduler.submit(conversations[0], policy="none", max_new_tokens=5)
        assert scheduler.position(queued) == 1
        with pytest.raises(QueueFull) as full:  # queue_size=1: no room for a third
            scheduler.submit(conversations[0], policy="none", max_new_tokens=5)
        assert full.value.retry_s > 0
        queued.cancel.set()
        with pytest.raises(Cancelled):
            queued.result(timeout=60)
        _wait(lambda: scheduler.state()["running"] == 0)
        assert started == [True, False]  # the cancelled one never reached the model
    finally:
        scheduler.close()


def test_a_client_that_gave_up_while_queued_holds_no_place_in_the_queue(engine, media):
    """A queued request whose client left stays in the queue until the loop next takes requests from it (behind a
    long prefill, minutes), but it no longer counts: a live client is not refused for it, and nobody waits behind it."""
    conversations = _conversations(media)
    scheduler = Scheduler(engine, max_batch=1, queue_size=1, start=False)  # the loop not running: nothing leaves
    ended = []
    scheduler.on_finish.append(lambda ticket, result, error: ended.append((ticket, ticket.request)))
    first = scheduler.submit(conversations[0], policy="none", max_new_tokens=3)  # the batch's place is its
    gone = scheduler.submit(conversations[1], policy="none", max_new_tokens=3)  # the queue's one place
    with pytest.raises(QueueFull):
        scheduler.submit(conversations[0], policy="none", max_new_tokens=3)
    gone.cancel.set()  # its client left
    live = scheduler.submit(conversations[0], policy="none", max_new_tokens=3)
    assert scheduler.state()["waiting"] == 2 and scheduler.position(live) == 2
    loop = threading.Thread(target=scheduler.run, daemon=True)
    loop.start()
    try:
        assert len(first.result(timeout=120).token_ids) == 3 and len(live.result(timeout=120).token_ids) == 3
    finally:
        scheduler.close()
        loop.join(timeout=60)
    assert [(ticket, request is None) for ticket, request in ended] == [(first, False), (gone, True), (live, False)]


def test_a_full_scheduler_refuses_a_request_before_reading_its_media(engine, media, monkeypatch):
    """``submit`` checks for room before the prompt is built: a full server does not decode a request's pictures
    (or the chat's, which has no room check of its own) only to refuse it after."""
    scheduler = Scheduler(engine, max_batch=1, queue_size=0, start=False)  # nothing leaves: the first holds the place
    try:
        scheduler.submit([{"role": "user", "content": "Say hi."}], max_new_tokens=2)
        monkeypatch.setattr(scheduler, "prepare", lambda *args, **kwargs: pytest.fail("read a refused request's media"))
        with pytest.raises(QueueFull):
            scheduler.submit(_conversations(media)[0], max_new_tokens=2)
    finally:
        scheduler.close()


def test_a_burst_takes_max_batch_requests_and_queue_size_more(engine, media):
    """Requests that will have a place in the batch wait only for the loop to take them (after a prefill under way,
    or before the loop starts): they are not in the queue. ``--max-batch 2 --queue-size 2`` took three requests of a
    burst, refusing the fourth (an outside pass); it takes four, and refuses the fifth."""
    conversations = _conversations(media)
    scheduler = Scheduler(engine, max_batch=2, queue_size=2, start=False)
    try:
        taken = [scheduler.submit(conversations[i % 2], policy="none", max_new_tokens=2) for i in range(4)]
        with pytest.raises(QueueFull) as full:
            scheduler.submit(conversations[0], policy="none", max_new_tokens=2)
        # "4 requests are waiting", as /health counts them (the queue's two said "2"; with --queue-size 0, "0")
        assert full.value.waiting == scheduler.state()["waiting"] == 4
        assert [scheduler.position(ticket) for ticket in taken] == [1, 2, 3, 4]
    finally:
        scheduler.close()


def test_prefills_under_way_are_in_the_state_and_each_one_counts_as_progress(engine, media, monkeypatch):
    """Requests taken from the queue are 'prefilling' until their first token, with their KV reservation, not
    invisible between 'waiting' and 'running'; and each finished prefill is progress, so several long prompts
    prefilled one after another in one iteration are not read as a wedged scheduler (``stalled_s``)."""
    conversations = _conversations(media)[:3]
    scheduler = Scheduler(engine, max_batch=4, queue_size=8, start=False)
    seen, start = [], engine.start

    def recording_start(*args, **kwargs):
        seen.append((scheduler.state(), scheduler.busy_since))
        return start(*args, **kwargs)

    monkeypatch.setattr(engine, "start", recording_start)
    tickets = [scheduler.submit(c, policy="none", max_new_tokens=3) for c in conversations]
    reserved = [t.reserved_bytes for t in tickets]
    loop = threading.Thread(target=scheduler.run, daemon=True)
    loop.start()
    try:
        for ticket in tickets:
            ticket.result(timeout=120)
    finally:
        scheduler.close()
        loop.join(timeout=60)
    states = [state for state, _ in seen]
    assert [(s["running"], s["prefilling"], s["waiting"]) for s in states] == [(0, 3, 0), (1, 2, 0), (2, 1, 0)]
    assert states[0]["kv_reserved_bytes"] == sum(reserved)  # the prefilling requests' reservations count
    marks = [busy for _, busy in seen]
    assert marks[0] < marks[1] < marks[2]  # measured from the last prefill, not from the iteration's start
    assert scheduler.state()["prefilling"] == 0


def test_admission_keeps_the_kv_reservations_within_the_budget(engine, media):
    conversations = _conversations(media)
    per_token = engine.kv_bytes_per_token()
    prompt = len(engine.prepare(conversations[1]))
    # Room for exactly one request of this prompt and 8 new tokens at a time.
    scheduler = Scheduler(engine, max_batch=8, kv_budget_bytes=per_token * (prompt + 8) * 3 // 2)
    peaks = []
    scheduler.on_finish.append(lambda ticket, result, error: peaks.append(result.metrics["batch_size"]))
    try:
        with pytest.raises(Exception, match="budget"):  # could never fit: refused at once
            scheduler.submit(conversations[1], policy="none", max_new_tokens=10 * prompt)
        tickets = [scheduler.submit(conversations[1], policy="none", max_new_tokens=8, ignore_eos=True)
                   for _ in range(3)]
        results = [t.result(timeout=60) for t in tickets]
    finally:
        scheduler.close()
    assert peaks == [1, 1, 1]  # one at a time: two would exceed the budget
    assert all(len(r.token_ids) == 8 for r in results)



def test_running_out_of_memory_decoding_together_undoes_the_step_decodes_apart_and_lowers_the_budget(engine, media):
    """When a decode step of two requests runs out of memory, neither ends: the step is undone and run again, one
    request at a time, and so are the steps after it, so that both answers are token for token what each is alone.
    The KV budget, a promise about the device's memory, drops to what one of them reserves: a request queued behind
    them that needs more than that is refused with the budget's reason instead of waiting for ever at the head of
    the queue, and the next two like them are answered one after the other."""
    from tiny_models import RunsOutOfMemory

    conversation = _conversations(media)[1]
    alone = engine.generate(conversation, policy="none", max_new_tokens=12, ignore_eos=True)
    scheduler = Scheduler(engine, max_batch=2, start=False)
    budget = scheduler.kv_budget_bytes
    batches = []
    scheduler.on_finish.append(lambda ticket, result, error: error or batches.append(result.metrics["batch_size"]))

    def ask(tokens):  # caches=False: every prompt is prefilled whole, none joins a step as a prompt's rest
        return scheduler.submit(conversation, policy="none", max_new_tokens=tokens, ignore_eos=True, caches=False)

    try:
        with RunsOutOfMemory(engine.adapter.layers[1].mlp, "cpu", lambda rows: rows == 2) as fault:
            pair, larger = [ask(12), ask(12)], ask(48)  # all queued before the loop starts: the pair is admitted
            scheduler.thread.start()
            survived = [ticket.result(timeout=60) for ticket in pair]
            with pytest.raises(UserError, match="more than the server's budget"):
                larger.result(timeout=60)
        assert len(fault.refused) == 2  # the first step, with its KV slots and without them: not one per step
        assert [result.token_ids for result in survived] == [alone.token_ids] * 2
        assert pair[0].reserved_bytes == pair[1].reserved_bytes < larger.reserved_bytes <= budget
        assert scheduler.kv_budget_bytes == pair[0].reserved_bytes == scheduler.state()["kv_budget_bytes"]
        results = [ticket.result(timeout=60) for ticket in [ask(12), ask(12)]]
    finally:
        scheduler.close()
    assert [result.token_ids for result in results] == [alone.token_ids] * 2
    assert batches == [2, 2, 1, 1]  # together until memory ran out; one at a time now


def test_stop_strings_end_the_answer_before_them(engine, media):
    conversation = _conversations(media)[1]
    alone = engine.generate(conversation, policy="none", max_new_tokens=16, ignore_eos=True)
    stop = alone.text[len(alone.text) // 2:len(alone.text) // 2 + 3]
    assert stop.strip(), alone.text
    expected = alone.text[:alone.text.find(stop)]
    scheduler = Scheduler(engine)
    try:
        ticket = scheduler.submit(conversation, policy="none", max_new_tokens=16, ignore_eos=True, stop=(stop,))
        chunks = list(ticket.chunks(timeout=60))
    finally:
        scheduler.close()
    result = chunks[-1].result
    assert result.finish_reason == "stop"
    assert result.text == expected == "".join(c.text for c in chunks)


def test_stop_text_holds_back_only_what_could_start_a_stop_string():
    stop = StopText(("END", "##"))
    assert stop.feed("hello E") == "hello"  # " E" could still start "END": held back
    assert stop.feed("N") == " "
    assert stop.feed("D and more") == "" and stop.hit
    partial = StopText(("END",))
    assert partial.feed("the E") == "the" and partial.flush() == " E"  # the answer ended before any stop
    plain = StopText(())
    assert plain.feed("anything") == "anything" and not plain.hit


def _wait(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_failing_request_ends_alone_and_the_scheduler_keeps_serving(engine, media):
    conversations = _conversations(media)
    scheduler = Scheduler(engine)
    try:
        policy = engine.make_policy("fastv", 0.5)
        policy.layer = 10_000  # a parameter only prefill finds wrong
        bad = scheduler.submit(conversations[1], policy=policy, max_new_tokens=4)
        with pytest.raises(UserError):
            bad.result(timeout=60)
        good = scheduler.submit(conversations[1], policy="none", max_new_tokens=4)
        assert len(good.result(timeout=60).token_ids) >= 1
        assert scheduler.state()["alive"]
    finally:
        scheduler.close()


def test_closing_turns_the_waiting_away_and_lets_a_running_answer_finish_as_it_would_have(engine, media):
    """What SIGTERM starts in `glimpse serve`: no new request is taken, one still queued ends with
    ``ServerStopping`` without being computed, the one running decodes on to its end, token for token its answer
    alone, and then the loop returns."""
    conversations = _conversations(media)
    alone = engine.generate(conversations[1], policy="none", max_new_tokens=30, ignore_eos=True)
    scheduler = Scheduler(engine, max_batch=1, queue_size=4)
    running = scheduler.submit(conversations[1], policy="none", max_new_tokens=30, ignore_eos=True)
    queued = scheduler.submit(conversations[1], policy="none", max_new_tokens=4)
    chunks = running.chunks(timeout=60)
    got = [next(chunks)]
    assert scheduler.state()["waiting"] == 1  # max_batch=1: the second waits behind the first's 30 tokens
    scheduler.close(wait=False)
    with pytest.raises(ServerStopping, match="shutting down"):
        scheduler.submit(conversations[1], max_new_tokens=3)
    got += list(chunks)
    result = got[-1].result
    assert result.token_ids == alone.token_ids and result.finish_reason == "length"
    assert "".join(c.text for c in got) == alone.text  # every piece streamed once
    with pytest.raises(ServerStopping, match="shutting down"):
        queued.result(timeout=60)
    assert queued.request is None  # never prefilled
    scheduler.thread.join(timeout=60)
    assert not scheduler.thread.is_alive() and scheduler.error is None and not engine._lock.locked()


def test_closing_with_a_grace_period_cuts_an_answer_still_running_after_it_with_what_it_said(engine, media):
    conversations = _conversations(media)
    alone = engine.generate(conversations[1], policy="none", max_new_tokens=60, ignore_eos=True)
    scheduler = Scheduler(engine, max_batch=2)
    running = scheduler.submit(conversations[1], policy="none", max_new_tokens=60, ignore_eos=True)
    chunks = running.chunks(timeout=60)
    got = [next(chunks), next(chunks)]
    scheduler.close(grace_s=0.0, wait=False)
    with pytest.raises(ServerStopping, match="shut down before this answer ended"):
        for chunk in chunks:
            got.append(chunk)
    said = "".join(c.text for c in got)
    assert said and alone.text.startswith(said) and len(said) < len(alone.text)  # what it said stands, and is right
    scheduler.thread.join(timeout=60)
    assert not scheduler.thread.is_alive() and scheduler.error is None
    assert running.request.ctx.cache is None and not engine._lock.locked()  # its KV went with it


def test_closing_waits_within_the_grace_for_submitters_building_prompts_to_be_told(engine, media, monkeypatch):
    """SIGTERM while a request still builds its prompt (decoding a long video, in its submitter's thread): the loop
    ends at once, nothing running, and `glimpse serve` used to close that request's connection a second later. Now
    ``wait_for_submitters`` waits, within the grace period, until that submitter has got its ``ServerStopping``
    (the API's 503); past the grace it waits no more."""
    conversations = _conversations(media)
    real_prepare, building, release = engine.prepare, threading.Event(), threading.Event()

    def slow_prepare(messages, caches=True, **options):
        building.set()
        release.wait(timeout=60)
        return real_prepare(messages, caches, **options)

    monkeypatch.setattr(engine, "prepare", slow_prepare)
    for grace_s in (60.0, 0.3):
        building.clear()
        release.clear()
        scheduler = Scheduler(engine)
        told = []

        def submit():
            try:
                scheduler.submit(conversations[0], max_new_tokens=4)
            except ServerStopping as error:
                told.append(error)

        submitter = threading.Thread(target=submit)
        submitter.start()
        assert building.wait(timeout=30)
        scheduler.close(grace_s=grace_s)  # the loop returns: nothing runs or waits
        assert not scheduler.thread.is_alive() and scheduler.preparing == 1
        waiter = threading.Thread(target=scheduler.wait_for_submitters)
        waiter.start()
        if grace_s > 1:
            waiter.join(timeout=0.5)
            assert waiter.is_alive()  # the submitter has not been told yet: it still builds its prompt
            release.set()
            waiter.join(timeout=60)
            assert not waiter.is_alive() and len(told) == 1 and "shutting down" in str(told[0])
        else:
            waiter.join(timeout=30)
            assert not waiter.is_alive() and not told  # the grace is over: it is not waited for
            release.set()
        submitter.join(timeout=60)
        assert len(told) == 1 and scheduler.preparing == 0


def test_a_request_whose_media_are_still_read_holds_up_no_other_prompt(engine, media):
    """Prompts are built in their submitters' threads. They were built one at a time, so a request whose video took
    long to decode (a 600 KB MP4 of 20,000 frames behind one keyframe: 18 s) held up every other request, a text
    question too, until it was decoded (found from outside). Now only the tokenizer takes them one at a time: while a
    request's video is still being read — held here where reading asks whether to stop — a question is answered;
    then the video's answer is what it is alone."""
    conversations = _conversations(media)
    video, text = conversations[2], conversations[1]
    alone = [engine.generate(c, policy="none", max_new_tokens=4).token_ids for c in (video, text)]
    reading, release = threading.Event(), threading.Event()

    def held() -> bool:  # asked before each image or video and each packet of a video: the client is still there
        reading.set()
        release.wait(timeout=120)
        return False

    scheduler = Scheduler(engine)
    results = {}

    def ask(name, conversation, left=None):
        ticket = scheduler.submit(conversation, policy="none", max_new_tokens=4, left=left)
        results[name] = ticket.result(timeout=120).token_ids

    try:
        reader = threading.Thread(target=ask, args=("video", video, held))
        reader.start()
        assert reading.wait(timeout=60)
        asker = threading.Thread(target=ask, args=("text", text))
        asker.start()
        asker.join(timeout=120)
        assert not asker.is_alive() and "text" in results  # answered ...
        assert reader.is_alive() and "video" not in results  # ... while the video was still being read
        release.set()
        reader.join(timeout=120)
    finally:
        release.set()
        scheduler.close()
    assert [results["video"], results["text"]] == alone


def test_media_are_read_by_a_bounded_number_of_requests_at_once_and_a_waiting_one_can_leave(engine, media):
    """Decoding is CPU work that holds the frames it decodes: at most ``media_readers`` requests read media at once.
    With one place, held by a request whose video is still being read: a text question needs no place and is
    answered; a question about a picture waits for the place, and gives up when its client leaves; once the place is
    free again, a question about the picture is answered, and the video's answer is what it is alone."""
    conversations = _conversations(media)
    video, text, picture = conversations[2], conversations[1], conversations[0]
    alone = engine.generate(video, policy="none", max_new_tokens=3).token_ids
    reading, release, leaves = threading.Event(), threading.Event(), threading.Event()

    def held() -> bool:
        reading.set()
        release.wait(timeout=120)
        return False

    scheduler = Scheduler(engine, media_readers=1)
    results = {}

    def ask(name, conversation, left=None):
        try:
            ticket = scheduler.submit(conversation, policy="none", max_new_tokens=3, left=left)
            results[name] = ticket.result(timeout=120).token_ids
        except vision.ReadingStopped as stopped:
            results[name] = stopped

    try:
        reader = threading.Thread(target=ask, args=("video", video, held))
        reader.start()
        assert reading.wait(timeout=60)
        waiter = threading.Thread(target=ask, args=("picture", picture, leaves.is_set))
        waiter.start()
        ask("text", text)  # answered while the one place is held
        assert isinstance(results["text"], list) and waiter.is_alive() and "picture" not in results
        leaves.set()  # the picture's client leaves while it waits for the place
        waiter.join(timeout=30)
        assert not waiter.is_alive() and isinstance(results["picture"], vision.ReadingStopped)
        assert reader.is_alive() and "video" not in results
        release.set()
        reader.join(timeout=120)
        ask("picture again", picture)  # the place was given back
        assert isinstance(results["picture again"], list)
    finally:
        release.set()
        scheduler.close()
    assert results["video"] == alone


def test_reading_a_requests_media_ends_at_the_time_limit_when_its_client_leaves_and_when_the_server_closes(engine,
                                                                                                           media):
    """What a request's media make the server do is bounded: past ``media_timeout_s`` the request is refused with a
    ``MediaError`` naming the file (the API's 400); a client that left stops the reading (``ReadingStopped``); SIGTERM
    during it tells the request the server is stopping. Nothing of them is queued, and the server answers on."""
    video = _conversations(media)[2]
    scheduler = Scheduler(engine, media_timeout_s=0.0)
    try:
        with pytest.raises(vision.MediaError) as refused:
            scheduler.submit(video, max_new_tokens=2)
        assert not isinstance(refused.value, vision.ReadingStopped)
        assert str(refused.value).startswith("clip.mp4: reading the images and videos of this request took longer "
                                             "than 0 s")
        scheduler.media_timeout_s = None  # no limit
        with pytest.raises(vision.ReadingStopped):
            scheduler.submit(video, max_new_tokens=2, left=lambda: True)
        assert scheduler.state()["waiting"] == 0 and scheduler.preparing == 0
        answered = scheduler.submit(video, policy="none", max_new_tokens=2).result(timeout=120)
        assert answered.token_ids == engine.generate(video, policy="none", max_new_tokens=2).token_ids
        with pytest.raises(ServerStopping, match="shutting down"):  # SIGTERM comes while the video is read
            scheduler.submit(video, max_new_tokens=2, left=lambda: scheduler.close(wait=False))
    finally:
        scheduler.close()


class _AtEachPrefillLayer(NoPruning):
    """No pruning, and a call of ``on_layer(layer_idx)`` as each decoder layer of the prefill starts: a test's way to
    act at a known point inside a prefill (a function survives the scheduler's copy of the policy as itself)."""

    on_layer = None

    def select(self, layer_idx: int, active, ctx):
        self.on_layer(layer_idx)
        return active


def test_a_client_leaving_during_a_prefill_frees_the_model_at_the_next_layer_and_the_batch_goes_on(engine, media):
    """A long video's prefill on a CPU takes a minute: a client that left during it held the model for all of it.
    Now the prefill stops before its next decoder layer, the request ends with no answer, and the answer already
    running beside it, and the next request, are token for token what they are alone."""
    conversations = _conversations(media)
    alone = engine.generate(conversations[1], policy="none", max_new_tokens=24, ignore_eos=True)
    after_alone = engine.generate(conversations[0], max_new_tokens=6)
    layers, leaving = [], []

    def on_layer(layer_idx):
        layers.append(layer_idx)
        if layer_idx == 1:
            leaving[0].cancel.set()  # the client leaves while layer 1 runs

    policy = _AtEachPrefillLayer()
    policy.on_layer = on_layer
    scheduler = Scheduler(engine, max_batch=4)
    try:
        running = scheduler.submit(conversations[1], policy="none", max_new_tokens=24, ignore_eos=True)
        chunks = running.chunks(timeout=60)
        got = [next(chunks)]
        leaving.append(scheduler.submit(conversations[2], policy=policy, max_new_tokens=8, caches=False))
        with pytest.raises(Cancelled):
            leaving[0].result(timeout=60)
        assert layers == [0, 1]  # layer 2 and after never ran
        assert leaving[0].request is None  # no request was made: nothing of its prefill is kept
        got += list(chunks)
        assert got[-1].result.token_ids == alone.token_ids
        assert "".join(c.text for c in got) == alone.text
        after = scheduler.submit(conversations[0], max_new_tokens=6).result(timeout=60)
        assert after.token_ids == after_alone.token_ids
        _wait(lambda: scheduler.state()["running"] == 0)
        assert scheduler.state()["prefilling"] == 0 and scheduler.state()["alive"]
    finally:
        scheduler.close()
    assert not engine._lock.locked()

    # The engine's own stream: its cancel event stops the prefill the same way.
    cancel = threading.Event()
    layers.clear()
    policy.on_layer = lambda layer_idx: (layers.append(layer_idx), layer_idx == 1 and cancel.set())
    assert list(engine.stream(conversations[2], policy=policy, max_new_tokens=8, cancel=cancel)) == []
    assert layers == [0, 1]
    assert engine.generate(conversations[0], max_new_tokens=6).token_ids == after_alone.token_ids


def test_a_client_leaving_while_the_vision_encoder_runs_stops_it_before_its_next_block(engine, media):
    """On a CPU a long video's vision tower is most of its prefill: a client that leaves while it runs stops it
    before its next block, and no decoder layer runs. Nothing of it stays behind: the same image asked again gets the
    answer it gets alone (a stop hook left on the tower would interrupt it, its ticket's flag being still set)."""
    conversations = _conversations(media)
    alone = engine.generate(conversations[0], policy="none", max_new_tokens=6)
    blocks = engine.adapter.vision_blocks()
    assert blocks is not None and len(blocks) >= 2
    done, leaving = [], []
    watch = [block.register_forward_hook(lambda module, args, out, i=i: done.append(("vision", i)))
             for i, block in enumerate(blocks)]
    watch += [layer.register_forward_hook(lambda module, args, kwargs, out, i=i: done.append(("decoder", i)),
                                          with_kwargs=True) for i, layer in enumerate(engine.adapter.layers)]
    watch.append(blocks[0].register_forward_hook(lambda *_: leaving[0].cancel.set()))  # leaves during block 0
    scheduler = Scheduler(engine, max_batch=2)
    try:
        leaving.append(scheduler.submit(conversations[0], policy="none", max_new_tokens=6, caches=False))
        with pytest.raises(Cancelled):
            leaving[0].result(timeout=60)
        assert done == [("vision", 0)]  # block 1 and every decoder layer never ran
    finally:
        for handle in watch:
            handle.remove()
    try:
        again = scheduler.submit(conversations[0], policy="none", max_new_tokens=6, caches=False).result(timeout=60)
        assert again.token_ids == alone.token_ids
    finally:
        scheduler.close()


def test_a_prefill_under_way_when_the_grace_runs_out_stops_at_the_next_layer(engine, media):
    """Stopping the server: a prefill still running when the grace period ends stops before its next decoder layer,
    its client told the server shut down; it does not hold the server past the grace for the rest of the prompt."""
    conversations = _conversations(media)
    layers = []
    scheduler = Scheduler(engine, max_batch=2)

    def on_layer(layer_idx):
        layers.append(layer_idx)
        if layer_idx == 1:
            scheduler.close(grace_s=0.0, wait=False)  # SIGTERM, with no grace, while layer 1 runs

    policy = _AtEachPrefillLayer()
    policy.on_layer = on_layer
    ticket = scheduler.submit(conversations[2], policy=policy, max_new_tokens=8, caches=False)
    with pytest.raises(ServerStopping, match="shut down before this answer ended"):
        ticket.result(timeout=60)
    assert layers == [0, 1] and ticket.request is None
    scheduler.thread.join(timeout=60)
    assert not scheduler.thread.is_alive() and scheduler.error is None and not engine._lock.locked()


class _FailsAtStep(NoPruning):
    """A policy that fails in its third decode step (as ST3 did on a NaN share, before such values were
    refused): what any bug of one policy's per-step work looks like from the scheduler."""

    def decode_step(self, step: int, ctx) -> None:
        if step == 3:
            raise ValueError("cannot convert float NaN to integer")


def test_a_policy_failing_mid_answer_ends_its_request_alone_and_the_batch_goes_on(engine, media):
    """Found from outside: one request whose policy raised in a decode step ended the scheduler's loop, and
    with it `glimpse serve`. Now that request gets the error; the others in its batch answer exactly as alone."""
    conversations = _conversations(media)
    others = [(conversations[i], name, 8) for i, name in ((0, "none"), (1, "st3"), (3, "none"))]
    alone = [engine.generate(c, policy=name, speed=1.0, max_new_tokens=n) for c, name, n in others]
    scheduler = Scheduler(engine, max_batch=4)
    try:
        bad = scheduler.submit(conversations[1], policy=_FailsAtStep(), max_new_tokens=8)
        tickets = [scheduler.submit(c, policy=name, speed=1.0, max_new_tokens=n) for c, name, n in others]
        with pytest.raises(ValueError, match="NaN"):
            bad.result(timeout=60)
        together = [t.result(timeout=120) for t in tickets]
        assert max(r.metrics["batch_size"] for r in together) == 4  # the failing request shared their steps
        assert [r.token_ids for r in together] == [r.token_ids for r in alone]
        assert scheduler.state()["alive"]
        assert len(scheduler.submit(conversations[1], max_new_tokens=3).result(timeout=60).token_ids) >= 1
    finally:
        scheduler.close()
    # The engine's own batch path raises the failure to its caller (the captioner then retries one by one).
    with pytest.raises(ValueError, match="NaN"):
        engine.generate_batch([conversations[1], conversations[0]], policy=_FailsAtStep(), max_new_tokens=8)


class _FailsInsideTheStep(NoPruning):
    """A policy whose per-layer decode work fails on its third step: a failure inside the pass through the
    model, which the scheduler cannot pin on one request of the batch."""

    def decode_rows(self, layer_idx: int, rows, ctx):
        if ctx.generated == 2 and layer_idx == 1:
            raise RuntimeError("a bug inside the step")
        return rows


def test_a_step_that_fails_inside_the_model_ends_its_requests_and_the_server_goes_on(engine, media):
    conversations = _conversations(media)
    scheduler = Scheduler(engine, max_batch=4)
    try:
        bad = scheduler.submit(conversations[1], policy=_FailsInsideTheStep(), max_new_tokens=8)
        with pytest.raises(RuntimeError, match="inside the step"):
            bad.result(timeout=60)
        assert scheduler.state()["alive"]
        alone = engine.generate(conversations[0], max_new_tokens=6)
        after = scheduler.submit(conversations[0], max_new_tokens=6).result(timeout=60)
        assert after.token_ids == alone.token_ids  # nothing of the failed step is left behind
    finally:
        scheduler.close()


def test_submitters_prepare_prompts_on_one_torch_thread_and_the_model_thread_keeps_its_own(engine, media,
                                                                                         monkeypatch, tmp_path):
    """On a CPU, a submitter's thread builds its prompt (Qwen video frames are resized with torch) on one
    OpenMP thread, so that it never keeps an OpenMP team of its own beside the model's thread (which would
    slow every kernel of that thread); the submitter's count is restored after, and the model's thread runs
    with the count the scheduler was made with, whatever count a new thread would start with by then."""
    import torch

    original = torch.get_num_threads()
    seen = {"prepare": [], "step": []}
    prepare, decode_step = engine.prepare, engine.decode_step

    def watched_prepare(messages, *args, **kwargs):
        seen["prepare"].append(torch.get_num_threads())
        return prepare(messages, *args, **kwargs)

    def watched_step(*args, **kwargs):
        seen["step"].append(torch.get_num_threads())
        return decode_step(*args, **kwargs)

    monkeypatch.setattr(engine, "prepare", watched_prepare)
    monkeypatch.setattr(engine, "decode_step", watched_step)
    torch.set_num_threads(2)
    scheduler = Scheduler(engine, max_batch=2, queue_size=4, start=False)
    torch.set_num_threads(1)  # a thread that starts from now on would run torch on one thread
    loop = threading.Thread(target=scheduler.run)
    loop.start()
    try:
        first = scheduler.submit(_conversations(media)[1], max_new_tokens=3, ignore_eos=True)
        assert first.result(timeout=120).metrics["new_tokens"] == 3
        torch.set_num_threads(2)
        second = scheduler.submit(_conversations(media)[2], max_new_tokens=3, ignore_eos=True)
        assert torch.get_num_threads() == 2  # restored in the submitter's thread
        assert second.result(timeout=120).metrics["new_tokens"] == 3
        corrupt = tmp_path / "corrupt.mp4"
        corrupt.write_bytes(b"\x00\x00\x00\x18ftypmp42" + b"\xff" * 64)  # a truncated clip: prepare fails
        with pytest.raises(UserError):
            scheduler.submit([{"role": "user", "content": [{"type": "video", "video": str(corrupt)},
                                                           {"type": "text", "text": "What happens?"}]}])
        assert torch.get_num_threads() == 2  # restored after the failure too
    finally:
        scheduler.close()
        loop.join(timeout=30)
        torch.set_num_threads(original)
    assert seen["prepare"] == [1, 1, 1]
    assert seen["step"] and set(seen["step"]) == {2}


def test_time_to_first_token_counts_building_the_prompt_and_each_steps_rate_its_own_batch(engine, media, monkeypatch):
    """An outside pass timed the server: its ``ttft_s`` started once the prompt was built, leaving out the media's
    reading and decoding (0.02 s reported for a first token 0.55 s after the request), and a request that shared
    its batch for a few steps had every step rated at that batch's size. Now the clock starts at ``received``
    (the API's handler, the chat's turn; by default ``submit``), with ``prompt_s`` the building's share, and each
    step's rate counts the tokens made in that step."""
    prepare = engine.prepare

    def slow_prepare(*args, **kwargs):  # a picture that takes its time to read
        time.sleep(0.3)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(engine, "prepare", slow_prepare)
    scheduler = Scheduler(engine, max_batch=2, queue_size=4, start=False)
    try:
        conversation = _conversations(media)[0]
        arrived = time.perf_counter() - 0.2  # its body was read before it was submitted
        long = scheduler.submit(conversation, policy="none", max_new_tokens=10, ignore_eos=True, received=arrived)
        short = scheduler.submit(conversation, policy="none", max_new_tokens=3, ignore_eos=True)
        loop = threading.Thread(target=scheduler.run, daemon=True)
        loop.start()
        long_result, short_result = long.result(timeout=120), short.result(timeout=120)
    finally:
        scheduler.close()
    for result, before in ((long_result, 0.5), (short_result, 0.3)):
        m = result.metrics
        assert m["prompt_s"] >= before and m["ttft_s"] >= m["prompt_s"] + m["queue_s"] + m["prefill_s"] - 1e-6
    steps = long_result.metrics
    made = [round(rate * s) for rate, s in zip(steps["decode_tokens_per_s_per_step"], steps["decode_step_s"])]
    assert made == [2, 2] + [1] * 7  # beside the short answer's two steps after its first token, then alone


def test_state_never_reads_a_cache_the_loop_is_changing(engine, media, monkeypatch):
    """/health and /metrics call ``state()`` from the server's threads; it summed the running requests' caches there
    while the loop changed them, and a ZipVL cache caught mid-change raised ZeroDivisionError (a 500 on a busy,
    healthy server; an outside pass's randomized clients). The loop counts them between its steps."""
    from glimpse.pipeline.cache import KVCache

    scheduler = Scheduler(engine, max_batch=2, queue_size=4)
    nbytes = KVCache.nbytes

    def loop_thread_only(self, *args, **kwargs):
        assert threading.current_thread() is scheduler.thread, "a cache read outside the loop"
        return nbytes(self, *args, **kwargs)

    monkeypatch.setattr(KVCache, "nbytes", loop_thread_only)
    try:
        ticket = scheduler.submit(_conversations(media)[0], policy="zipvl", speed=1.0, max_new_tokens=12,
                                  ignore_eos=True)
        seen = []
        for chunk in ticket.chunks(timeout=60):
            seen.append(scheduler.state()["kv_bytes"])
            if chunk.result is not None:
                break
    finally:
        scheduler.close()
    assert scheduler.error is None and max(seen) > 0
    assert scheduler.state()["kv_bytes"] == 0  # none running


def test_a_request_the_kv_budget_holds_back_counts_against_the_queue(engine, media):
    """``--queue-size`` bounds the requests that wait. One counted as waiting only when the batch was full: with a
    KV budget room for fewer than ``--max-batch``, any number waited in a queue of one (an outside pass: 7 in a queue
    of 0). A request waits too when the budget cannot take it after those ahead of it."""
    conversation = [{"role": "user", "content": "Write one line about the sea."}]
    tokens = 24
    reserved = engine.kv_bytes_per_token() * (len(engine.prepare(conversation)) + tokens)
    scheduler = Scheduler(engine, max_batch=8, queue_size=1, kv_budget_bytes=reserved)  # room for one at a time
    try:
        first = scheduler.submit(conversation, policy="none", max_new_tokens=tokens, ignore_eos=True)
        stream = first.chunks(timeout=60)
        next(stream)  # it runs, and holds the whole budget
        second = scheduler.submit(conversation, policy="none", max_new_tokens=tokens, ignore_eos=True)  # waits
        with pytest.raises(QueueFull):
            scheduler.submit(conversation, policy="none", max_new_tokens=tokens, ignore_eos=True)
        assert scheduler.state()["waiting"] == 1
        assert len(second.result(timeout=120).token_ids) == tokens  # the one that waited is answered in its turn
    finally:
        scheduler.close()


def test_media_read_outside_a_prompt_wait_for_a_reader_place_and_a_closing_server_ends_the_wait(engine):
    """The chat checks a turn's files before building its prompt: that reading waits for one of the server's
    media-reader places as a prompt's does, and a server that closes meanwhile says it is stopping (as ``prepare``
    does), not that the turn's files could not be read (an outside pass: a refusal counted as the client's mistake)."""
    scheduler = Scheduler(engine, max_batch=1, media_readers=1, start=False)
    with scheduler.reading_turn():
        assert not scheduler.media_readers.acquire(blocking=False)  # the one place is this reading's
    assert scheduler.media_readers.acquire(blocking=False)  # given back; now held by another reading
    threading.Timer(0.5, scheduler.close, kwargs={"wait": False}).start()
    with pytest.raises(ServerStopping):
        with scheduler.reading_turn():
            pass
    scheduler.media_readers.release()


def test_a_kv_budget_of_exactly_two_requests_takes_two_and_queue_size_more(engine, media):
    """``--queue-size`` counts the requests that wait for a place: a request that fits the KV budget exactly, beside
    those ahead of it, has its place and is not in the queue, so a burst under a budget of exactly two requests and
    ``--queue-size 1`` gets three in and the fourth is refused (as ``--max-batch 2 --queue-size 1`` would)."""
    conversation = [{"role": "user", "content": "Write one line about the sea."}]
    tokens = 4
    reserved = engine.kv_bytes_per_token() * (len(engine.prepare(conversation)) + tokens)
    scheduler = Scheduler(engine, max_batch=8, queue_size=1, kv_budget_bytes=2 * reserved, start=False)
    try:
        taken = [scheduler.submit(conversation, policy="none", max_new_tokens=tokens) for _ in range(3)]
        assert [t.reserved_bytes for t in taken] == [reserved] * 3
        with pytest.raises(QueueFull):
            scheduler.submit(conversation, policy="none", max_new_tokens=tokens)
    finally:
        scheduler.close()


def test_running_out_of_memory_never_lowers_the_budget_below_the_largest_request_of_the_step(engine, media):
    """After a decode step of requests of different sizes runs out of memory, the budget is half of what they reserved
    together but never less than the largest of them, which still runs alone (docs/serving.md): a request as large
    as it is answered afterwards, not refused as over the budget."""
    from tiny_models import RunsOutOfMemory

    conversation = _conversations(media)[1]
    scheduler = Scheduler(engine, max_batch=2, start=False)

    def ask(tokens):
        return scheduler.submit(conversation, policy="none", max_new_tokens=tokens, ignore_eos=True, caches=False)

    try:
        with RunsOutOfMemory(engine.adapter.layers[1].mlp, "cpu", lambda rows: rows == 2):
            pair = [ask(2), ask(40)]  # queued before the loop starts: admitted together
            scheduler.thread.start()
            for ticket in pair:
                ticket.result(timeout=60)
        small, large = (t.reserved_bytes for t in pair)
        assert (small + large) // 2 < large  # half of the two is less than the larger one
        assert scheduler.kv_budget_bytes == large
        assert len(ask(40).result(timeout=60).token_ids) == 40  # one as large is still answered, alone
    finally:
        scheduler.close()


def test_once_every_answer_has_ended_the_kv_slots_are_given_back_at_once(engine, media):
    """Memory goes back when the load drops: the KV slots the requests decoded in go as soon as the last answer
    ends, not when the next request arrives (an idle server would hold them for ever)."""
    conversations = _conversations(media)
    scheduler = Scheduler(engine, max_batch=4)
    held = []
    step = engine.decode_step

    def spy(running):
        out = step(running)
        held.append(bool(engine.slot_groups))
        return out

    engine.decode_step = spy
    try:
        tickets = [scheduler.submit(c, policy="none", max_new_tokens=6, ignore_eos=True) for c in conversations[:2]]
        for ticket in tickets:
            ticket.result(timeout=60)
        assert any(held)  # they decoded in KV slots
        _wait(lambda: scheduler.state()["running"] == 0 and not scheduler.busy_since)
        assert engine.slot_groups == []
    finally:
        del engine.decode_step
        scheduler.close()


def test_a_request_s_batch_size_is_the_largest_batch_it_decoded_in(engine, media):
    """``batch_size``: the requests decoded together, as ``generate_batch`` counts them: a request that went on alone
    after its companion ended still decoded in a batch of two (it said 1, the size of its last step only)."""
    conversation = [{"role": "user", "content": "Write one line about the sea."}]
    scheduler = Scheduler(engine, max_batch=2, start=False)
    try:
        short, long = (scheduler.submit(conversation, policy="none", max_new_tokens=tokens, ignore_eos=True)
                       for tokens in (3, 10))
        scheduler.thread.start()  # both queued before the loop starts: they decode together
        results = [short.result(timeout=60), long.result(timeout=60)]
    finally:
        scheduler.close()
    assert [len(r.token_ids) for r in results] == [3, 10]
    assert [r.metrics["batch_size"] for r in results] == [2, 2]


def test_a_request_whose_prefill_is_under_way_holds_its_place_against_the_queue(engine, media, monkeypatch):
    """A request taken from the queue holds its place in the batch while it is prefilled: with ``--max-batch 1
    --queue-size 0`` a request that arrives during that prefill has no place and no room to wait, so it is refused
    (429), not queued beyond ``--queue-size``."""
    conversation = [{"role": "user", "content": "Write one line about the sea."}]
    scheduler = Scheduler(engine, max_batch=1, queue_size=0)
    prefilling, go, start = threading.Event(), threading.Event(), engine.start

    def held_start(*args, **kwargs):
        prefilling.set()
        go.wait(60)
        return start(*args, **kwargs)

    monkeypatch.setattr(engine, "start", held_start)
    try:
        first = scheduler.submit(conversation, policy="none", max_new_tokens=2)
        assert prefilling.wait(60)
        assert scheduler.state()["prefilling"] == 1
        with pytest.raises(QueueFull):
            scheduler.submit(conversation, policy="none", max_new_tokens=2)
        go.set()
        assert len(first.result(timeout=60).token_ids) >= 1
    finally:
        go.set()
        scheduler.close()


def test_out_of_memory_is_told_apart_from_other_errors_and_caught_for_each_kind():
    """``attempt`` turns every allocation that failed (CUDA's ``OutOfMemoryError``, the CPU allocator's
    ``RuntimeError``, Python's ``MemoryError``) into ``(None, what it tried)``, and lets any other error through."""
    import torch

    from glimpse.pipeline.out_of_memory import attempt, is_out_of_memory

    def failing(error):
        def work():
            raise error
        return work

    assert attempt(lambda: 3) == (3, None)
    cpu = RuntimeError(f"[enforce fail at alloc_cpu.cpp:117] . DefaultCPUAllocator: can't allocate memory: you tried "
                       f"to allocate {2**31} bytes. Error code 12 (Cannot allocate memory)")
    cuda = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8 GiB")
    for error in (MemoryError(), cpu, cuda):
        assert is_out_of_memory(error)
        result, said = attempt(failing(error))
        assert result is None and isinstance(said, str)
    assert "2.00 GiB" in attempt(failing(cpu))[1] and "2.00 GiB" in attempt(failing(cuda))[1]
    for error in (RuntimeError("mat1 and mat2 shapes cannot be multiplied"), ValueError("bad")):
        assert not is_out_of_memory(error)
        with pytest.raises(type(error)):
            attempt(failing(error))


@pytest.mark.parametrize("max_new_tokens", [-40, 0, 2.5, "8"])
def test_a_bad_max_new_tokens_is_refused_before_the_kv_budget_counts_it(engine, max_new_tokens):
    """``Scheduler.submit`` refuses what the engine would (a whole number of at least 1) before it reserves the
    request's KV: a negative count reserved negative bytes, and two requests behind it were admitted together under a
    budget with room for one (an outside mutation pass; the engine refused the bad one only at its prefill)."""
    conversation = [{"role": "user", "content": "Write one line about the sea."}]
    room = engine.kv_bytes_per_token() * (len(engine.prepare(conversation)) + 8)
    scheduler = Scheduler(engine, max_batch=4, kv_budget_bytes=room, start=False)
    try:
        with pytest.raises(UserError, match="max_new_tokens must be a whole number of at least 1"):
            scheduler.submit(conversation, policy="none", max_new_tokens=max_new_tokens)
        first, second = (scheduler.submit(conversation, policy="none", max_new_tokens=8) for _ in range(2))
        with scheduler.condition:
            joining = scheduler._admit()
        assert joining == [first] and first.reserved_bytes + second.reserved_bytes > room  # the second waits
    finally:
        scheduler.close()
