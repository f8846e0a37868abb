"""Where a compiled program's time goes: the op self-times of a jax.profiler trace, attributed
to the named scopes (`layer/qkv`, `layer/attention`, ...) of the HLO instructions they ran.

An op event is one whose name is an instruction of the program; its self-time excludes the
ops nested in it (a while loop's body). Other events on the threads that run ops (the
runtime's own bookkeeping, waits) count as `runtime`. Ops of one program may run on several
threads at once, so op time can exceed wall time.
"""
import bisect
import collections
import re

import jax

from profiling.timing import trace_events

_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = ')
_OP_NAME = re.compile(r'metadata=\{op_name="([^"]*)"')
_EXECUTE = "ThunkExecutor::Execute (wait for completion)"
_END = "end: "  # the runtime's marker of an op's completion
_DOT = re.compile(r'^\s*(?:ROOT )?%([\w.\-]+) = \S+ dot\(')


def op_scopes(compiled: jax.stages.Compiled) -> dict[str, str]:
    """HLO instruction name -> its op_name metadata (the jax named-scope path). An instruction
    the compiler made without one (a dot rewritten for one row) takes that of the nearest named
    instruction of its computation."""
    scopes, unnamed, last = {}, [], None
    for line in compiled.as_text().splitlines():
        if line.endswith("{") or line.strip() == "}":  # a computation starts or ends
            unnamed, last = [], None
            continue
        if not (m := _INSTRUCTION.match(line)):
            continue
        if (op := _OP_NAME.search(line)) is None:
            unnamed.append(m.group(1))
            if last is not None:
                scopes[m.group(1)] = last
            continue
        last = scopes[m.group(1)] = op.group(1)
        scopes.update((name, last) for name in unnamed if name not in scopes)
        unnamed = []
    return scopes


def op_events(trace_dir: str) -> list[dict]:
    """Complete ('X') events of the newest trace under `trace_dir`."""
    return [e for e in trace_events(trace_dir, "*.trace.json.gz") if e.get("ph") == "X"]


def completed(events: list[dict], async_ops: set[str]) -> list[dict]:
    """Events of `async_ops` spanned to their completion. XLA CPU runs its (Eigen) dots
    asynchronously: an op's event ends once the op is handed to the thread pool, and the
    runtime's marker `end: <name>`, on any thread, says when it completed."""
    ends = collections.defaultdict(list)
    for e in events:
        if e["name"].startswith(_END):
            ends[e["name"][len(_END):]].append(e["ts"])
    for times in ends.values():
        times.sort()

    def spanned(e):
        marks = ends.get(e["name"], []) if e["name"] in async_ops else []
        i = bisect.bisect_left(marks, e["ts"])
        return {**e, "dur": max(e["dur"], marks[i] - e["ts"])} if i < len(marks) else e
    return [spanned(e) for e in events]


def self_times(events: list[dict]) -> list[tuple[int, str, float]]:
    """(thread, name, self-time in µs) of every event: the time in which it is the latest
    started of its thread's open events (an asynchronous op's span need not nest)."""
    by_thread = collections.defaultdict(list)
    for e in events:
        by_thread[e["tid"]].append(e)
    out = []
    for tid, evs in by_thread.items():
        timed = [(i, e) for i, e in enumerate(evs) if e["dur"] > 0]  # markers own nothing
        bounds = sorted([(e["ts"] + e["dur"], 0, 0, i) for i, e in timed]
                        + [(e["ts"], 1, -e["dur"], i) for i, e in timed])
        open_, own, last = [], [0.0] * len(evs), 0.0
        for t, starts, _, i in bounds:
            if open_:
                own[open_[-1]] += t - last
            last = t
            if starts:
                open_.append(i)
            else:
                open_.remove(i)
        out += [(tid, e["name"], own[i]) for i, e in enumerate(evs)]
    return out


def scope_of(op_name: str, scopes: tuple[str, ...]) -> str:
    """The first of `scopes` named in an op's path, or `other`."""
    parts = op_name.split("/")
    return next((s for s in scopes if s in parts), "other")


def breakdown(compiled: jax.stages.Compiled, trace_dir: str, calls: int,
              scopes: tuple[str, ...]) -> dict[str, float]:
    """Seconds per call: op self-time by scope, `other` ops, `runtime` (non-op events on the
    op threads) and `executions` (the runtime's span of each execution, where it reports it)."""
    names, events = op_scopes(compiled), op_events(trace_dir)
    dots = {m.group(1) for m in map(_DOT.match, compiled.as_text().splitlines()) if m}
    times = self_times(completed(events, dots))
    op_threads = {tid for tid, name, _ in times if name in names}
    total = collections.Counter({s: 0.0 for s in (*scopes, "other", "runtime")})
    for tid, name, us in times:
        if name in names:
            total[scope_of(names[name], scopes)] += us
        elif tid in op_threads and name != _EXECUTE and not name.startswith(_END):
            total["runtime"] += us
    total["executions"] = sum(e["dur"] for e in events if e["name"] == _EXECUTE)
    return {k: v / 1e6 / calls for k, v in total.items()}
