"""Prometheus metrics of the HTTP front (``ragserve:*``), those vLLM also exports repeated
under vLLM's names (``VLLM_ALIASES``), so dashboards built for vLLM work unchanged. One
registry per app; handlers update the counters, ``Server.stats()`` gauges are read at scrape."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 1.5, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
RETRIEVAL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0)

# Top-level Server.stats() keys -> exported gauge (nested keys go to the generic families).
_STAT_GAUGES = {
    "num_running": ("ragserve:num_requests_running", "Requests running in the LLM engine."),
    "num_waiting": ("ragserve:num_requests_waiting", "Requests waiting for the LLM engine."),
    "num_blocks_used": ("ragserve:kv_cache_blocks_used", "KV cache blocks in use."),
    "num_blocks_total": ("ragserve:kv_cache_blocks_total", "KV cache blocks in the pool."),
    "num_active_requests": (
        "ragserve:num_requests_active",
        "Workflow requests active in the scheduler.",
    ),
}

# ragserve family -> vLLM's names for the same measure (the labels stay ragserve's: TTFT and
# e2e latency are per ``workflow``, token counts and inter-token latency per ``model_name``).
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "ragserve:time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "ragserve:e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "ragserve:inter_token_latency_seconds": (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
    ),
    "ragserve:prompt_tokens": ("vllm:prompt_tokens",),
    "ragserve:generation_tokens": ("vllm:generation_tokens",),
    "ragserve:num_requests_running": ("vllm:num_requests_running",),
    "ragserve:num_requests_waiting": ("vllm:num_requests_waiting",),
    "ragserve:kv_cache_usage_perc": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
}


class VllmAliases(Collector):
    """The families of ``source``, each one in ``VLLM_ALIASES`` followed by its copies."""

    def __init__(self, source: Collector) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            yield family
            for alias in VLLM_ALIASES.get(family.name, ()):
                copy = Metric(alias, family.documentation, family.type, family.unit)
                suffix = len(family.name)
                copy.samples = [s._replace(name=alias + s.name[suffix:]) for s in family.samples]
                yield copy


def flatten_stats(stats: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """``{"engine": {"num_running": 2}}`` -> ``{"engine.num_running": 2.0}``; numbers and
    booleans (as 0/1) only."""
    flat: dict[str, float] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_stats(value, name + "."))
        elif isinstance(value, (int, float)):
            flat[name] = float(value)
    return flat


class StatsCollector(Collector):
    """Turns ``stats()`` into gauges at scrape time; unknown numeric keys go to
    ``ragserve:server_stat{key=...}`` so nothing the runtime reports is hidden."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], admitted: Callable[[], int]):
        self._stats = stats
        self._admitted = admitted

    def collect(self) -> Iterator[GaugeMetricFamily]:
        flat = flatten_stats(self._stats())
        known: dict[str, float] = {}
        other = GaugeMetricFamily(
            "ragserve:server_stat", "Other numeric Server.stats() entries.", labels=["key"]
        )
        queues = GaugeMetricFamily(
            "ragserve:queue_depth", "Items waiting in the runtime's queues.", labels=["queue"]
        )
        workers = GaugeMetricFamily(
            "ragserve:worker_stat",
            "Per worker / Ray actor (LLM replica, index shard) Server.stats() entries.",
            labels=["worker", "stat"],
        )
        for key, value in sorted(flat.items()):
            parts = key.split(".")
            if len(parts) == 3 and parts[0] == "workers":
                workers.add_metric(parts[1:], value)
            if key in _STAT_GAUGES:
                known[key] = value
            elif parts[-1] == "pending" or "queue" in key:  # e.g. a worker's bounded inbox
                queues.add_metric([key], value)
            else:
                other.add_metric([key], value)
        for key, value in known.items():
            yield GaugeMetricFamily(*_STAT_GAUGES[key], value=value)
        used, total = known.get("num_blocks_used"), known.get("num_blocks_total")
        if used is not None and total:
            yield GaugeMetricFamily(
                "ragserve:kv_cache_usage_perc", "Fraction of KV blocks in use.", value=used / total
            )
        yield GaugeMetricFamily(
            "ragserve:num_requests_admitted",
            "HTTP generation requests admitted and not yet finished.",
            value=self._admitted(),
        )
        yield queues
        yield workers
        yield other


class ServerMetrics:
    """The app's registry and the instruments handlers update."""

    def __init__(self, stats: Callable[[], Mapping[str, Any]], admitted: Callable[[], int]):
        self.registry = r = CollectorRegistry(auto_describe=False)

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(f"ragserve:{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, label: str, buckets: tuple) -> Histogram:
            return Histogram(f"ragserve:{name}", doc, [label], buckets=buckets, registry=r)

        doc = "Finished HTTP generation requests by workflow and status."
        self.requests = counter("requests", doc, "workflow", "status")
        doc = "Time from arrival to the first answer token."
        self.ttft = histogram("time_to_first_token_seconds", doc, "workflow", TTFT_BUCKETS)
        doc = "Time from arrival to the last byte of the answer."
        self.e2e = histogram("e2e_request_latency_seconds", doc, "workflow", E2E_BUCKETS)
        doc = "Latency of one retrieval node (embed + search) of a request."
        self.retrieval = histogram("retrieval_latency_seconds", doc, "workflow", RETRIEVAL_BUCKETS)
        every_node = "of completions and chats (every generation node of a workflow)."
        self.prompt_tokens = counter("prompt_tokens", f"Prompt tokens {every_node}", "model_name")
        doc = f"Generated tokens {every_node}"
        self.generation_tokens = counter("generation_tokens", doc, "model_name")
        doc = "Time between two tokens of an answer (each answer's mean, once per gap)."
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", doc, "model_name", ITL_BUCKETS
        )
        doc = "Tokens read by the embedder for /v1/embeddings."
        self.embedding_tokens = counter("embedding_tokens", doc, "model_name")
        self.rejected = counter("requests_rejected", "Requests refused at admission (429).")
        r.register(StatsCollector(stats, admitted))

    def count_tokens(self, model_name: str, num_prompt: int, num_generated: int) -> None:
        self.prompt_tokens.labels(model_name).inc(num_prompt)
        self.generation_tokens.labels(model_name).inc(num_generated)

    def observe_itl(self, model_name: str, first: Any, last: Any, num_tokens: int) -> None:
        """``num_tokens - 1`` gaps of ``(last - first) / (num_tokens - 1)`` seconds each (the
        times of one answer's first and last tokens); nothing for answers of fewer than two
        tokens or without both times."""
        if first is None or last is None or num_tokens < 2 or last < first:
            return
        child = self.inter_token_latency.labels(model_name)
        gap = (last - first) / (num_tokens - 1)
        for _ in range(num_tokens - 1):
            child.observe(gap)

    def render(self) -> bytes:
        return generate_latest(VllmAliases(self.registry))
