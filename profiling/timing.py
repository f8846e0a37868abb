"""How the studies time things: wall clock, or device time of named ops in a profiler trace."""
import contextlib
import glob
import gzip
import json
import os
import statistics
import tempfile
import time

import jax

WALL_CLOCK = "wall clock after block_until_ready, median"
TRACE_DEVICE_TIME = "device time of the named kernel in a jax.profiler trace, mean"


def wall_time(fn, args=(), repeats: int = 3, trace_dir: str | None = None) -> float:
    """Median seconds per call after block_until_ready, after one warm-up call (compiles).
    With `trace_dir`, the timed calls are traced there."""
    jax.block_until_ready(fn(*args))
    with tracing(trace_dir):
        return statistics.median(_rounds([(fn, args)], repeats)[0])


def interleaved_rounds(calls, repeats: int = 3) -> list[list[float]]:
    """Seconds of each `(fn, args)` in `calls` in each of `repeats` rounds, timed in turn (one
    call of each per round, after a warm-up round), so that a shared machine's slow spells fall
    on all: a ratio of two calls is best taken round by round."""
    for fn, args in calls:
        jax.block_until_ready(fn(*args))
    return _rounds(calls, repeats)


def _rounds(calls, repeats: int) -> list[list[float]]:
    times = [[] for _ in calls]
    for _ in range(repeats):
        for (fn, args), out in zip(calls, times):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            out.append(time.perf_counter() - start)
    return times


def tracing(trace_dir: str | None):
    """A jax.profiler trace into `trace_dir` (for TensorBoard), or nothing when None."""
    return jax.profiler.trace(trace_dir) if trace_dir else contextlib.nullcontext()


def subdir(root: str | None, name: str) -> str | None:
    """One study's measurement as its own TensorBoard run under `root`."""
    return os.path.join(root, name) if root else None


def write_json(result: dict, path: str | None) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=2)


def trace_events(trace_dir: str, file_name: str = "perfetto_trace.json.gz") -> list[dict]:
    """The events of the newest trace file `file_name` under `trace_dir`."""
    paths = glob.glob(os.path.join(trace_dir, "**", file_name), recursive=True)
    if not paths:
        raise FileNotFoundError(f"no {file_name} under {trace_dir}")
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
        events = trace_events(out)
    durations = [e["dur"] for e in events
                 if e.get("ph") == "X" and name in e.get("name", "")
                 and not e["name"].startswith("end:")]
    return sum(durations) / 1e6 / repeats if durations else None
