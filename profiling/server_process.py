"""A server started as a user starts it, `python -m server` in a subprocess, for the
benchmarks that measure it from outside."""
import collections
import contextlib
import re
import shlex
import subprocess
import sys
import threading
import time
from typing import NamedTuple

_SERVING = re.compile(r"serving .* on (http://[\w.\-]+:\d+)")
_DEVICES = re.compile(r"replicas: (\d+ of \d+ .* device\(s\))")


class Served(NamedTuple):
    url: str
    devices: str | None  # as its start-up log says, e.g. "1 of 1 cpu device(s)"
    start_s: float       # from its start to its first line saying it serves
    pid: int


def _drain(stream) -> None:
    for _ in stream:
        pass


@contextlib.contextmanager
def running_server(model_path: str | None, extra_args: str, cwd: str | None = None,
                   module: str = "server"):
    """`python -m server` (or another `module` serving as it does: a benchmark's
    profiling.simulated_server) on a free port, run in `cwd` (a checkout; default: this
    process's directory); yields a Served once it serves. Its log until then is echoed to
    stderr."""
    cmd = [sys.executable, "-m", module, "--port", "0", "--noaccess_log",
           *(["--model-path", model_path] if model_path else []), *shlex.split(extra_args)]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=cwd)
    try:
        log, devices = collections.deque(maxlen=20), None
        for line in proc.stderr:
            log.append(line)
            sys.stderr.write(line)
            if found := _DEVICES.search(line):
                devices = found.group(1)
            if match := _SERVING.search(line):
                break
        else:
            raise RuntimeError(f"the server exited with {proc.wait()} before serving:\n"
                               + "".join(log))
        # Its later log lines must be read, or a full pipe would stall the server.
        threading.Thread(target=_drain, args=(proc.stderr,), daemon=True).start()
        yield Served(match.group(1), devices, time.perf_counter() - start, proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
