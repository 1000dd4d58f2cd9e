"""What `glimpse serve` exposes at ``/metrics``, with prometheus_client, in the names serving stacks use.

Every request the scheduler ends (from the API or the chat) is recorded once, by the scheduler's
``on_finish`` hook; requests refused before they reach it (a bad body, a full queue) by ``refused``.
Gauges read the scheduler's state when scraped. Latency histograms carry the model and the policy.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from glimpse.common import UserError
from glimpse.pipeline.out_of_memory import OutOfMemory
from glimpse.pipeline.scheduler import ServerStopping

OUTCOMES = ("ok", "cancelled", "bad_request", "rejected", "unauthorized", "out_of_memory", "error")
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.5)
SHARE_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Telemetry:
    def __init__(self, scheduler, model_name: str):
        self.model = model_name
        self.registry = registry = CollectorRegistry()  # one per server: tests run several in one process
        by_policy = ["model", "policy"]
        self.ttft = Histogram("glimpse_time_to_first_token_seconds", "Request received to first token, queue included.",
                              by_policy, buckets=LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("glimpse_e2e_request_latency_seconds", "Request received to its last token.",
                             by_policy, buckets=LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram("glimpse_queue_wait_seconds", "Time a request waited for the engine.",
                               by_policy, buckets=LATENCY_BUCKETS, registry=registry)
        self.tpot = Histogram("glimpse_time_per_output_token_seconds", "Decode time per token after the first.",
                              by_policy, buckets=TOKEN_BUCKETS, registry=registry)
        self.pruned = Histogram("glimpse_visual_token_layers_pruned_share",
                                "Per request with images or video: the share of visual token-layers pruning skipped.",
                                by_policy, buckets=SHARE_BUCKETS, registry=registry)
        self.requests = Counter("glimpse_requests", "Chat completion requests (API and chat) by outcome.",
                                ["model", "outcome"], registry=registry)
        self.prompt_tokens = Counter("glimpse_prompt_tokens", "Prompt tokens by modality.", ["model", "modality"],
                                     registry=registry)
        self.generation_tokens = Counter("glimpse_generation_tokens", "Generated tokens.", by_policy,
                                         registry=registry)
        self.reused_tokens = Counter("glimpse_prefix_cache_reused_tokens",
                                     "Prompt tokens taken from the prefix cache instead of computed.", ["model"],
                                     registry=registry)
        self.reused_tokens.labels(model_name)
        for outcome in OUTCOMES:  # every outcome present from the start, at 0
            self.requests.labels(model_name, outcome)
        for modality in ("text", "image", "video"):
            self.prompt_tokens.labels(model_name, modality)
        state = scheduler.state
        gauges = {"glimpse_requests_running": ("Requests in the running batch.", "running"),
                  "glimpse_requests_prefilling": ("Requests taken from the queue whose prefill is under way or next.",
                                                  "prefilling"),
                  "glimpse_requests_waiting": ("Requests waiting for the engine (not those whose client left).",
                                               "waiting"),
                  "glimpse_kv_cache_bytes": ("KV cache bytes held by running requests.", "kv_bytes"),
                  "glimpse_kv_cache_reserved_bytes": ("KV bytes reserved by running and prefilling requests.",
                                                      "kv_reserved_bytes"),
                  "glimpse_kv_cache_budget_bytes": ("The KV budget admission keeps within.", "kv_budget_bytes")}
        for name, (help_text, key) in gauges.items():
            Gauge(name, help_text, registry=registry).set_function(lambda key=key: state()[key])
        prefixes = scheduler.engine.prefix_cache
        Gauge("glimpse_prefix_cache_bytes", "Keys and values the prefix cache holds.",
              registry=registry).set_function(lambda: prefixes.bytes)
        registry.register(MediaCaches(model_name, {"media": scheduler.engine.media_cache,
                                                   "encoder": scheduler.engine.encoder_cache}))
        scheduler.on_finish.append(self.finished)

    def refused(self, outcome: str) -> None:
        """A request that never reached the scheduler: "bad_request" or "rejected" (queue full)."""
        self.requests.labels(self.model, outcome).inc()

    def finished(self, ticket, result, error) -> None:
        if error is not None:
            self.refused("out_of_memory" if isinstance(error, OutOfMemory) else
                         "rejected" if isinstance(error, ServerStopping) else  # shutting down
                         "bad_request" if isinstance(error, UserError) else "error")
            return
        if result is None or result.finish_reason == "cancelled":  # cancelled while waiting, or mid-answer
            self.refused("cancelled")
            if result is None:
                return
        else:
            self.refused("ok")
        m, labels = result.metrics, (self.model, result.policy)
        self.ttft.labels(*labels).observe(m["ttft_s"])
        self.queue.labels(*labels).observe(m["queue_s"])
        self.e2e.labels(*labels).observe(ticket.request.t_end - ticket.received)
        if m["new_tokens"] > 1 and m["decode_tokens_per_s"]:
            self.tpot.labels(*labels).observe(1.0 / m["decode_tokens_per_s"])
        for modality, count in m["prompt_tokens"].items():
            self.prompt_tokens.labels(self.model, modality).inc(count)
        self.generation_tokens.labels(*labels).inc(m["new_tokens"])
        self.reused_tokens.labels(self.model).inc(m["prefix_reused_tokens"])
        depth = m["keep_map"]["depth"]
        if depth:
            layers = m["keep_map"]["num_layers"]
            self.pruned.labels(*labels).observe(1.0 - sum(depth) / (len(depth) * layers))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class MediaCaches:
    """The media and encoder caches' lookups and bytes, read from the caches when scraped (they count their own
    hits and misses): ``glimpse_<name>_cache_hits_total``, ``..._misses_total`` and ``..._bytes``."""

    def __init__(self, model_name: str, caches: dict):
        self.model, self.caches = model_name, caches

    def collect(self):
        for name, cache in self.caches.items():
            prefix = f"glimpse_{name}_cache"
            for kind, value in (("hits", cache.hits), ("misses", cache.misses)):
                family = CounterMetricFamily(f"{prefix}_{kind}", f"Lookups the {name} cache answered" if kind == "hits"
                                             else f"Lookups the {name} cache could not answer", labels=["model"])
                family.add_metric([self.model], value)
                yield family
            held = GaugeMetricFamily(f"{prefix}_bytes", f"Bytes the {name} cache holds.", labels=["model"])
            held.add_metric([self.model], cache.bytes)
            yield held
