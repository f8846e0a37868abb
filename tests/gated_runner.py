"""A ModelRunner.run wrapper for fault and cancellation tests."""
import threading


class GatedRunner:
    """Wraps runner.run: holds forwards until released, records their rows, fails chosen ones."""

    def __init__(self, runner, monkeypatch, fail=lambda call: False):
        self.real, self.fail = runner.run, fail
        self.entered, self.release = threading.Event(), threading.Event()
        self.rows = []
        monkeypatch.setattr(runner, "run", self.run)

    def run(self, batch, shape):
        call = len(self.rows)
        self.rows.append(int(batch.num_rows))
        self.entered.set()
        assert self.release.wait(60)
        if self.fail(call):
            raise RuntimeError(f"injected fault in forward {call}")
        return self.real(batch, shape)
