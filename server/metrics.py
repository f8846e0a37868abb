"""Prometheus text exposition of the runtime's counters and gauges."""

_METRICS = [  # (name, type, help, value of an Engine)
    ("jax_score_compilations_total", "counter", "programs compiled (warm-up included)",
     lambda e: e.runner.compile_count),
    ("jax_score_forwards_total", "counter", "forward passes run",
     lambda e: e.scheduler.stats.forwards),
    ("jax_score_failed_forwards_total", "counter", "forward passes that raised",
     lambda e: e.scheduler.stats.failed_forwards),
    ("jax_score_computed_tokens_total", "counter", "prompt tokens run through the model",
     lambda e: e.scheduler.stats.computed_tokens),
    ("jax_score_cached_tokens_total", "counter", "prompt tokens served from the prefix cache",
     lambda e: e.scheduler.stats.cached_tokens),
    ("jax_score_waiting_sequences", "gauge", "sequences queued for a forward",
     lambda e: e.scheduler.waiting),
    ("jax_score_kv_pages_free", "gauge", "free KV pages", lambda e: e.scheduler.pool.free_count),
    ("jax_score_kv_pages_total", "gauge", "KV pages in the pool",
     lambda e: e.scheduler.pool.num_pages),
]


def prometheus_text(engine) -> str:
    lines = []
    for name, kind, help_text, value in _METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {value(engine)}"]
    return "\n".join(lines) + "\n"
