"""POST /start_profile and /stop_profile: one jax.profiler trace at a time, for TensorBoard."""
import tempfile

import jax

from runtime.errors import ScoreError


class Profiler:
    """Traces go to `trace_dir` (a new temporary directory when None); clients cannot choose
    where the server writes."""

    def __init__(self, trace_dir: str | None):
        self.trace_dir = trace_dir
        self.active: str | None = None

    def start(self) -> str:
        if self.active is not None:
            raise ScoreError(f"a profile is already being written to {self.active}; "
                             "POST /stop_profile first", status=409)
        out = self.trace_dir or tempfile.mkdtemp(prefix="jax-score-trace-")
        try:
            jax.profiler.start_trace(out)
        except RuntimeError as e:  # another trace of this process is running
            raise ScoreError(f"cannot start a profile: {e}", status=409) from None
        self.active = out
        return out

    def stop(self) -> str:
        if self.active is None:
            raise ScoreError("no profile is running; POST /start_profile first", status=409)
        out, self.active = self.active, None
        jax.profiler.stop_trace()
        return out
