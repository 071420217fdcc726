"""``GET /metrics``: the prefill node's state in the Prometheus text format (``prometheus_client``).

Why a collector that reads the engine at scrape time: queue depth, pages and
token counters already live in the engine (:meth:`PrefillEngine.snapshot`);
copying them into gauges after every step would race the scrape and cost the
step loop time.  Only what needs bucketing is observed as it happens: the
time to first token (TTFT) and the HTTP responses by status.  Each server
has its own registry, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

# name -> (help) of every series the collector yields; docs/serve.md lists the same.
SERIES = {
    "cpgraph_queue_depth": "Requests waiting for admission",
    "cpgraph_running_requests": "Requests admitted and not yet finished",
    "cpgraph_running_tokens": "Prompt tokens of running requests still to compute",
    "cpgraph_step_tokens": "Prompt tokens computed by the last step",
    "cpgraph_kv_pages": "KV pages of this rank's pool by state (used includes cached)",
    "cpgraph_kv_cached_pages": "Logical KV pages held by the radix cache in L1",
    "cpgraph_prompt_tokens": "Prompt tokens of finished requests",
    "cpgraph_cached_tokens": "Prompt tokens taken from the prefix cache, by tier",
    "cpgraph_computed_tokens": "Prompt tokens computed (not cached)",
    "cpgraph_steps": "Forward steps by kind (graph = replayed a captured CUDA graph)",
    "cpgraph_requests": "Requests by outcome",
    "cpgraph_transfer_bytes": "KV bytes sent to decode rooms (this rank's pages)",
    "cpgraph_transfer_failures": "Requests whose KV transfer failed",
    "cpgraph_cold_steps": "Steps whose forward compiled a graph or captured a new CUDA-graph bucket (after warm-up: "
                          "a shape first seen under load)",
}


class _EngineCollector:
    def __init__(self, engine):
        self.engine = engine

    def describe(self):
        return []

    def collect(self):
        s = self.engine.snapshot()
        for name, key in (("cpgraph_queue_depth", "waiting"), ("cpgraph_running_requests", "running"),
                          ("cpgraph_running_tokens", "running_tokens"), ("cpgraph_step_tokens", "step_tokens"),
                          ("cpgraph_kv_cached_pages", "pages_cached")):
            yield GaugeMetricFamily(name, SERIES[name], value=s[key])
        pages = GaugeMetricFamily("cpgraph_kv_pages", SERIES["cpgraph_kv_pages"], labels=["state"])
        pages.add_metric(["used"], s["pages_used"])
        pages.add_metric(["free"], s["pages_free"])
        yield pages
        yield CounterMetricFamily("cpgraph_prompt_tokens", SERIES["cpgraph_prompt_tokens"], value=s["prompt_tokens"])
        yield CounterMetricFamily("cpgraph_computed_tokens", SERIES["cpgraph_computed_tokens"],
                                  value=s["computed_tokens"])
        for name, key, label in (("cpgraph_cached_tokens", "cached_tokens", "tier"), ("cpgraph_steps", "steps", "kind"),
                                 ("cpgraph_requests", "outcomes", "outcome")):
            fam = CounterMetricFamily(name, SERIES[name], labels=[label])
            for k, v in s[key].items():
                fam.add_metric([k], v)
            yield fam
        yield CounterMetricFamily("cpgraph_transfer_bytes", SERIES["cpgraph_transfer_bytes"], value=s["transfer_bytes"])
        yield CounterMetricFamily("cpgraph_transfer_failures", SERIES["cpgraph_transfer_failures"],
                                  value=s["transfer_failures"])
        yield CounterMetricFamily("cpgraph_cold_steps", SERIES["cpgraph_cold_steps"], value=s["cold_steps"])


class ServeMetrics:
    """The registry of one server: the engine's state plus TTFT and HTTP responses."""

    def __init__(self, engine):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("cpgraph_ttft_seconds", "Time from request arrival to its first token",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.responses = Counter("cpgraph_http_responses", "HTTP responses by endpoint and status",
                                 ["endpoint", "status"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
