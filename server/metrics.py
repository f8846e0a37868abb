"""Prometheus text exposition of the server's and the runtime's counters and gauges."""
import bisect
import collections

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _total(field: str):
    """An engine metric: the sum of a ReplicaStatus field over the replicas."""
    return lambda engine, statuses: sum(getattr(s, field) for s in statuses)


_ENGINE_METRICS = [  # (name, type, help, value of an Engine and its replicas' statuses)
    ("jax_score_compilations_total", "counter", "programs compiled (warm-up included)",
     _total("compilations")),
    ("jax_score_forwards_total", "counter", "forward passes run", _total("forwards")),
    ("jax_score_failed_forwards_total", "counter", "forward passes that raised",
     _total("failed_forwards")),
    ("jax_score_computed_tokens_total", "counter", "prompt tokens run through the model",
     _total("computed_tokens")),
    ("jax_score_padded_tokens_total", "counter", "tokens of the shape buckets the forwards "
     "ran: computed tokens and their padding", _total("padded_tokens")),
    ("jax_score_cached_tokens_total", "counter", "prompt tokens served from the prefix cache",
     _total("cached_tokens")),
    ("jax_score_forward_in_flight_seconds_total", "counter", "wall time with a forward "
     "dispatched to the devices and its results not yet read", _total("in_flight_s")),
    ("jax_score_scheduler_host_seconds_total", "counter", "the schedulers' CPU time on "
     "forwards: forming, building, dispatching, answering", _total("host_s")),
    ("jax_score_waiting_sequences", "gauge", "sequences queued for a forward",
     _total("waiting")),
    ("jax_score_kv_pages_used", "gauge", "KV pages held by sequences or the prefix cache",
     lambda engine, statuses: sum(s.kv_pages - s.kv_pages_free for s in statuses)),
    ("jax_score_kv_pages_total", "gauge", "KV pages in the pool", _total("kv_pages")),
    ("jax_score_replicas", "gauge", "data parallel replicas",
     lambda engine, statuses: len(statuses)),
    ("jax_score_tokenized_texts_total", "counter", "score requests' texts (queries, items) "
     "tokenized", lambda engine, statuses: engine.token_cache.misses),
    ("jax_score_cached_texts_total", "counter", "score requests' texts found tokenized "
     "before (runtime.token_cache)", lambda engine, statuses: engine.token_cache.hits),
    ("jax_score_affine_routes_total", "counter", "requests routed to the replica that took "
     "their query before", lambda engine, statuses: engine.router.affine_routes),
]

_SERVER_GAUGES = {"jax_score_open_connections": "open client connections",
                  "jax_score_pending_requests": "score requests queued or running"}


class ServerMetrics:
    """Request counters of one server, updated on its event loop."""

    def __init__(self):
        self.requests = collections.Counter()  # (route, status) -> answered requests
        self.items_scored = 0
        self.latency_counts = [0] * (len(LATENCY_BUCKETS_S) + 1)  # /v1/score, per bucket
        self.latency_sum_s = 0.0

    def observe(self, route: str, status: int, seconds: float, items: int) -> None:
        self.requests[route, status] += 1
        self.items_scored += items
        if route == "/v1/score":
            self.latency_counts[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1
            self.latency_sum_s += seconds

    def lines(self) -> list[str]:
        name = "jax_score_http_requests_total"
        out = [f"# HELP {name} answered requests by route and status", f"# TYPE {name} counter"]
        out += [f'{name}{{route="{route}",status="{status}"}} {n}'
                for (route, status), n in sorted(self.requests.items())]
        out += _metric("jax_score_items_scored_total", "counter", "items scored",
                       self.items_scored)
        return out + self._histogram("jax_score_request_duration_seconds")

    def _histogram(self, name: str) -> list[str]:
        out = [f"# HELP {name} /v1/score latency, from the request read to its answer",
               f"# TYPE {name} histogram"]
        cumulative = 0
        for bound, n in zip((*LATENCY_BUCKETS_S, "+Inf"), self.latency_counts):
            cumulative += n
            out.append(f'{name}_bucket{{le="{bound}"}} {cumulative}')
        return out + [f"{name}_sum {self.latency_sum_s}", f"{name}_count {cumulative}"]


def _metric(name: str, kind: str, help_text: str, value) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value}"]


def prometheus_text(engine, statuses: list, server: ServerMetrics,
                    gauges: dict[str, int]) -> str:
    """`statuses`: the engine's replicas' (Engine.statuses)."""
    lines = server.lines()
    for name, value in gauges.items():
        lines += _metric(name, "gauge", _SERVER_GAUGES[name], value)
    for name, kind, help_text, value in _ENGINE_METRICS:
        lines += _metric(name, kind, help_text, value(engine, statuses))
    return "\n".join(lines) + "\n"
