"""`/metrics` in Prometheus' text format (prometheus_client, one registry per app).

Counters: requests by endpoint and HTTP status, prompt and generated tokens, prompt tokens restored from the
prompt cache and the requests that hit it, tokens the MTP layer drafted and those of them accepted; gauges:
requests waiting and running, the slots and the last batch step's rows (read from the queue at scrape time)
and the last request's decode speed; histograms: time to first token and decode tok/s.
Names follow vLLM's where one exists (`..._prompt_tokens_total`, `..._generation_tokens_total`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
_P = "quantkit_"


class Metrics:
    def __init__(self, queue_stats: Callable[[], Any]):
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(_P + "requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(_P + "prompt_tokens", "prompt tokens of finished generations", registry=r)
        self.generation_tokens = Counter(_P + "generation_tokens", "tokens generated", registry=r)
        self.cache_hit_tokens = Counter(_P + "prompt_cache_hit_tokens",
                                        "prompt tokens restored from the prompt cache instead of prefilled",
                                        registry=r)
        self.cache_hits = Counter(_P + "prompt_cache_hits", "generations that restored a cached prefix",
                                  registry=r)
        # speculative decoding with the MTP layer, per slot (vLLM's spec_decode_num_draft / accepted_tokens)
        self.draft_tokens = Counter(_P + "spec_decode_draft_tokens", "tokens the MTP layer drafted", registry=r)
        self.accepted_tokens = Counter(_P + "spec_decode_accepted_tokens", "drafted tokens the model accepted",
                                       registry=r)
        waiting = Gauge(_P + "queue_waiting", "requests waiting for a free slot (at most --max-queue)", registry=r)
        running = Gauge(_P + "queue_running", "slots in use: requests (choices) being prefilled or decoded", registry=r)
        waiting.set_function(lambda: getattr(queue_stats(), "waiting", 0))
        running.set_function(lambda: getattr(queue_stats(), "running", 0))
        # `serve --parallel N`: the slots and the rows of the last batch step (one slot, one row, without it)
        slots = Gauge(_P + "slots", "requests that may be decoded together (--parallel)", registry=r)
        batch = Gauge(_P + "batch_size", "requests decoded together in the last step", registry=r)
        slots.set_function(lambda: getattr(queue_stats(), "slots", 1))
        batch.set_function(lambda: getattr(queue_stats(), "batch_size", getattr(queue_stats(), "running", 0)))
        self.last_tps = Gauge(_P + "generation_tokens_per_second", "decode speed of the last generation",
                              registry=r)
        self.ttft = Histogram(_P + "time_to_first_token_seconds", "queue + prefill until the first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r)
        self.tps = Histogram(_P + "decode_tokens_per_second", "decode speed per generation",
                             buckets=(1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 250), registry=r)

    def watch_disk_cache(self, disk: Callable[[], dict[str, Any] | None]) -> None:
        """Gauges of the disk prompt cache (quantkit/runtime/prompt_disk.py), read from `disk()` at scrape time:
        this model's bytes and their bound, other files' bytes, entries, restores from disk and the seconds they
        took, entries of other weights ignored."""
        r = self.registry
        for key, name, doc in (("bytes", "bytes", "bytes of this model's entries in --prompt-cache-dir"),
                               ("other_bytes", "other_bytes", "bytes of other models' entries and other files "
                                                              "there, outside the bound"),
                               ("max_bytes", "max_bytes", "--prompt-cache-disk-size"),
                               ("entries", "entries", "entries of these weights on disk"),
                               ("hits", "hits", "prompts restored from disk instead of prefilled"),
                               ("restored_tokens", "restored_tokens", "prompt tokens restored from disk"),
                               ("restore_seconds", "restore_seconds", "seconds spent restoring states from disk"),
                               ("ignored_other_weights", "ignored", "entries of other weights or recipes, never "
                                                                    "restored")):
            g = Gauge(f"{_P}prompt_cache_disk_{name}", doc, registry=r)
            g.set_function(lambda k=key: float((disk() or {}).get(k, 0)))

    def generation(self, prompt_tokens: int, cached_tokens: int, tokens: int, ttft_s: float, decode_s: float,
                   drafts: dict[str, int] | None = None) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        if drafts:
            self.draft_tokens.inc(drafts["drafted"])
            self.accepted_tokens.inc(drafts["accepted"])
        self.generation_tokens.inc(tokens)
        if cached_tokens:
            self.cache_hit_tokens.inc(cached_tokens)
            self.cache_hits.inc()
        self.ttft.observe(ttft_s)
        if tokens > 1 and decode_s > 0:
            tps = (tokens - 1) / decode_s
            self.last_tps.set(tps)
            self.tps.observe(tps)

    def text(self) -> bytes:
        return generate_latest(self.registry)



class CountRequests:
    """ASGI middleware: each answered request to one of `endpoints` counted with its status (others as "other")."""

    def __init__(self, app: Any, *, metrics: Metrics, endpoints: tuple[str, ...]):
        self.app, self.metrics, self.endpoints = app, metrics, endpoints

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in self.endpoints else "other"

        async def counting_send(msg: dict[str, Any]) -> None:
            if msg["type"] == "http.response.start":
                self.metrics.requests.labels(endpoint, str(msg["status"])).inc()
            await send(msg)
        await self.app(scope, receive, counting_send)
