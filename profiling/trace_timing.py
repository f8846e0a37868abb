"""Device time of named ops, read from a jax.profiler trace (the perfetto JSON it writes)."""
import glob
import gzip
import json
import os
import tempfile

import jax


def _trace_events(trace_dir: str) -> list[dict]:
    paths = glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no perfetto trace under {trace_dir}")
    with gzip.open(max(paths, key=os.path.getmtime)) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def op_time(fn, args, name: str, repeats: int = 3, trace_dir: str | None = None) -> float | None:
    """Mean seconds per call spent in trace events whose name contains `name`
    (e.g. a pallas_call's `name=`), or None when the trace has no such event."""
    jax.block_until_ready(fn(*args))  # compile outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        out = trace_dir or tmp
        with jax.profiler.trace(out, create_perfetto_trace=True):
            for _ in range(repeats):
                jax.block_until_ready(fn(*args))
        events = _trace_events(out)
    durations = [e["dur"] for e in events
                 if e.get("ph") == "X" and name in e.get("name", "")
                 and not e["name"].startswith("end:")]
    return sum(durations) / 1e6 / repeats if durations else None
