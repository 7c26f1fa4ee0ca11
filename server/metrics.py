"""The server's Prometheus metrics (`GET /metrics`, prometheus-client's text format) and its
readiness (`GET /health?ready=1`). docs/server.md, "Metrics and readiness", names every series.

Events are counted where they happen: HTTP answers by route template and status
(`MetricsMiddleware`), steps with their forward and route time and prefix-cache answer
(`ServerMetrics.step`), the OpenAI routes' images with their time (`ServerMetrics.image`).
The rest is read from the live objects when scraped (`LiveState`): the image worker's queue,
the upload caches, the models held and loading, the memory plan's budget and what is held,
the rank group's state. Each server has its own collector registry, so two
servers in one process (the tests', the bench's) count apart.
"""

from __future__ import annotations

from typing import Any

import falcon
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Seconds: a tiny model's step is a few milliseconds, a large one's tens of seconds.
STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ROUTE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
# Seconds: a tiny model's image is a fraction of one, a large one's minutes.
IMAGE_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RANK_STATES = ("ok", "stuck", "broken")
UNMATCHED = "unmatched"  # the route label of a request no route took (404s, front refusals)
RETRY_AFTER_S = 5  # what a not-ready answer tells the client to wait

# No `_created` twin of every counter and histogram: a timestamp per series that no dashboard
# reads, doubling what a scrape carries.
disable_created_metrics()


class ServerMetrics:
    """One server's metrics: the event series, and a scrape-time collector over `service`
    (a service.StepsService) and `group` (the rank group, None for one process)."""

    def __init__(self, service: Any, group: Any = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.responses = self._counter(
            "gmlx_http_responses",
            "HTTP answers by route template, method and status code",
            ("route", "method", "status"),
        )
        self.steps = self._counter(
            "gmlx_steps",
            "Denoise steps answered, by family and prefix-cache answer",
            ("family", "prefix_cache"),
        )
        self.forward = self._by_family(
            "gmlx_step_forward_seconds",
            "A step's model evaluation alone (X-Gmlx-Forward-Ms)",
            STEP_BUCKETS,
        )
        self.route = self._by_family(
            "gmlx_step_route_seconds",
            "A step's time in the server beside its forward: parsing, checks, planning, queueing",
            ROUTE_BUCKETS,
        )
        self.images = self._counter(
            "gmlx_images",
            "Images the OpenAI routes sampled, by family and how each ended (done; stopped:"
            " its client went away)",
            ("family", "outcome"),
        )
        self.image_time = self._by_family(
            "gmlx_image_seconds",
            "An OpenAI route's image from its prompt's encoding to its picture",
            IMAGE_BUCKETS,
        )
        self.registry.register(LiveState(service, group))

    def _counter(self, name: str, documentation: str, labels: tuple) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def _by_family(self, name: str, documentation: str, buckets: tuple) -> Histogram:
        """A histogram of seconds, by family."""
        return Histogram(name, documentation, ("family",), buckets=buckets, registry=self.registry)

    def step(self, family: str, prefix_cache: str, forward_ms: float, server_ms: float) -> None:
        self.steps.labels(family, prefix_cache).inc()
        self.forward.labels(family).observe(forward_ms / 1000.0)
        self.route.labels(family).observe(max(0.0, server_ms - forward_ms) / 1000.0)

    def image(self, family: str, seconds: float | None) -> None:
        """An image done in `seconds`, or (None) stopped as its client went away."""
        self.images.labels(family, "stopped" if seconds is None else "done").inc()
        if seconds is not None:
            self.image_time.labels(family).observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class LiveState:
    """The gauges and totals read from the live objects at each scrape."""

    def __init__(self, service: Any, group: Any) -> None:
        self.service = service
        self.group = group

    def describe(self) -> list:
        return []  # the families vary with what is loaded: described only when collected

    def collect(self):
        service, registry = self.service, self.service.registry
        yield _gauge(
            "gmlx_worker_queue_depth", "Image jobs queued, not started", service.worker.depth
        )
        yield from self._caches()
        yield _gauge("gmlx_models_resident", "Models held in memory", len(registry.resident_ids()))
        yield _gauge("gmlx_models_loading", "Models loading now", len(registry.loading_ids()))
        yield _counter("gmlx_model_loads", "Models loaded", registry.loads)
        yield _counter(
            "gmlx_model_load_seconds", "Seconds spent loading models", registry.load_seconds
        )
        yield _gauge("gmlx_runs_open", "Runs open", service.run_count())
        memory = service.memory
        yield _gauge(
            "gmlx_memory_budget_bytes", "The image worker's memory budget", memory.budget()
        )
        # weights and upload caches: a model's held states change on the image worker meanwhile
        held = memory.held(states=False)
        yield _gauge("gmlx_memory_held_bytes", "Weights and upload caches held", held)
        if self.group is not None:
            state = self.group.describe()
            family = GaugeMetricFamily(
                "gmlx_rank_group_state",
                "The rank group's state (1: the state it is in)",
                labels=["state"],
            )
            for name in RANK_STATES:
                family.add_metric([name], 1.0 if state["state"] == name else 0.0)
            yield family
            yield _gauge("gmlx_rank_group_size", "Ranks in the group", state["world_size"])
            yield _gauge(
                "gmlx_rank_group_silent_ranks",
                "Ranks that stopped answering",
                len(state["silent_ranks"]),
            )

    def _caches(self):
        caches = (self.service.tensors, self.service.adapters)
        stored = GaugeMetricFamily("gmlx_cache_bytes", "Bytes in an upload cache", labels=["cache"])
        entries = GaugeMetricFamily(
            "gmlx_cache_entries", "Entries in an upload cache", labels=["cache"]
        )
        hits = CounterMetricFamily(
            "gmlx_cache_hits", "Reads that found their entry", labels=["cache"]
        )
        misses = CounterMetricFamily("gmlx_cache_misses", "Reads that did not", labels=["cache"])
        for cache in caches:
            stored.add_metric([cache.name], cache.total)
            entries.add_metric([cache.name], len(cache))
            hits.add_metric([cache.name], cache.hits)
            misses.add_metric([cache.name], cache.misses)
        yield from (stored, entries, hits, misses)


def _gauge(name: str, text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, text, value=float(value))


def _counter(name: str, text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, text, value=float(value))


class MetricsMiddleware:
    """Counts every answer by the route template that took it (UNMATCHED for none)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def process_response(self, req, resp, resource, req_succeeded: bool) -> None:
        route = req.uri_template or UNMATCHED
        status = str(falcon.code_to_http_status(resp.status)).split(" ", 1)[0]
        self.metrics.responses.labels(route, req.method, status).inc()


class Metrics:
    """GET /metrics: the text exposition format (unversioned, like /health; behind the API key)."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.content_type = CONTENT_TYPE_LATEST
        resp.data = self.metrics.exposition()


def readiness(service: Any, group: Any) -> str | None:
    """Why the server is not ready for work now (None: ready): a model loading, the image
    worker stopped, or the rank group stuck or broken."""
    if not service.worker.alive:
        return "the image worker has stopped"
    loading = service.registry.loading_ids()
    if loading:
        return f"loading {', '.join(loading)}"
    if group is not None:
        state = group.describe()
        if state["state"] != "ok":
            return f"the rank group is {state['state']}: {state.get('reason') or 'see the log'}"
    return None
